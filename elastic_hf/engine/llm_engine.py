"""The step loop of one instance: requests in, one scheduled packed step at a time, RequestOutputs out.
Not thread-safe: one thread drives it (AsyncEngine does this for the server; a deployment drives one engine per
instance). The model behind it is a `Runner` (engine/step_plan.py): the engine never touches model tensors."""
from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from elastic_hf.engine.batch_queue import BatchQueue
from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.grammar import fill_bitmasks
from elastic_hf.engine.input_processor import EngineRequest, InputProcessor
from elastic_hf.engine.metrics import EngineMetrics
from elastic_hf.engine.output_processor import OutputProcessor
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.sampler import RemoteSampling, adopt_sampled, make_sampler_state, sample, token_logprobs
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.scheduler import Scheduler
from elastic_hf.engine.sequence import Request, Sequence, SeqStatus
from elastic_hf.engine.step_plan import ModelRunnerOutput, Runner, ScheduledSeq, SchedulerOutput, SeqStepInput
from elastic_hf.engine.timeline import Timeline

_RECENT_LATENCIES = 1024   # TTFT / TPOT samples kept for the next load snapshot


@dataclass(slots=True)
class EngineLoad:
    """What a monitor (the morph controller) sees of one engine at a step boundary."""
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    num_running: int
    queue_delay_s: float          # how long the oldest waiting request has waited
    blocked_on_kv: bool           # the oldest waiting request cannot get its next chunk's KV blocks
    ttft_s: list[float] = field(default_factory=list)   # first tokens since the previous snapshot
    tpot_s: list[float] = field(default_factory=list)   # inter-token gaps since the previous snapshot


class LLMEngine:
    def __init__(self, runner: Runner, scheduler: Scheduler, tokenizer, *, model_id: str, max_model_len: int,
                 eos_token_ids: list[int], input_processor: InputProcessor, metrics: EngineMetrics | None = None,
                 seq_ids: Iterator[int] | None = None, request_seeds: Iterator[int] | None = None):
        """seq_ids: where sequence ids come from; engines that exchange sequences (the instances of a deployment)
        share one counter so ids stay unique and keep meaning admission order. request_seeds: the seed of each
        accepted request that brings none (a server's --seed: the instances share one stream, so the k-th request
        samples alike after a restart); None: a random one."""
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.metrics = metrics or EngineMetrics(model_id, max_model_len=max_model_len)
        self.input_processor = input_processor   # shared by a deployment's instance engines
        self.output_processor = OutputProcessor(tokenizer, self.eos_token_ids, max_model_len)
        self.requests: dict[str, Request] = {}
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count()
        self._request_seeds = request_seeds
        self.num_steps = 0
        self.num_computed_prompt_tokens = 0  # prefill work done, including recompute after preemption
        self._reported_preemptions = 0
        # Called at every step boundary, before scheduling: morph controllers apply finished swaps and resize the
        # KV cache here, where no forward pass is running.
        self.step_boundary_hooks: list[Callable[[LLMEngine], None]] = []
        # Work that needs step boundaries even with no requests (a swap in flight, layers to restore once the load
        # is gone): has_unfinished_requests() reports it, so a driver keeps calling step().
        self.idle_work_checks: list[Callable[[], bool]] = []
        self._recent_ttft: deque[float] = deque(maxlen=_RECENT_LATENCIES)
        self._recent_tpot: deque[float] = deque(maxlen=_RECENT_LATENCIES)
        self.batches = BatchQueue(self)   # batches in flight of a pipelined instance (cross-step pipelining)
        self.timeline: Timeline | None = None   # per-step and per-request records (engine/timeline.py), if asked

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int] | EngineRequest,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """prompt: an EngineRequest the input processor made, or text / token ids it processes now."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        request = prompt if isinstance(prompt, EngineRequest) else self.input_processor.process(
            prompt, params, request_id, arrival_time)
        prompt_ids, params, now = request.prompt_token_ids, request.params, request.arrival_time
        self._check_kv_capacity(prompt_ids, params)
        seqs = [Sequence(next(self._seq_ids), request_id, i, list(prompt_ids), len(prompt_ids), params, now)
                for i in range(params.n)]
        fallback_seed = next(self._request_seeds) if self._request_seeds is not None else None
        for seq in seqs:
            seq.sampler_state = make_sampler_state(seq, fallback_seed, sorted(self.eos_token_ids))
            seq.grammar = request.grammar.state() if request.grammar is not None else None
            self.scheduler.add(seq)
        self.requests[request_id] = Request(request_id, prompt_ids, params, seqs, now,
                                            # nothing predicts the first prompt token
                                            prompt_logprobs=None if params.prompt_logprobs is None else [None])
        self.metrics.on_request_arrived()
        self.metrics.on_prompt_tokens(len(prompt_ids))
        self._update_gauges()

    def _check_kv_capacity(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What depends on this instance: the whole request must fit its KV cache (the input processor checked
        the rest)."""
        num_prompt = len(prompt_ids)
        kv = self.scheduler.kv
        blocks_needed = kv.blocks_for_tokens(num_prompt + params.max_tokens)
        if blocks_needed > kv.num_total:
            raise InvalidRequest(f"request needs {blocks_needed} KV blocks ({num_prompt} prompt + {params.max_tokens} "
                                 f"new tokens) but the KV cache holds {kv.num_total} blocks of {kv.block_size} "
                                 "tokens", param="max_tokens", code="context_length_exceeded")

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        self.metrics.on_request_finished("abort", request)
        if self.timeline is not None:
            self.timeline.on_request_finished(request)
        self._update_gauges()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self.batches.stashed) or any(check() for check in self.idle_work_checks)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update_from_output, then output processing (engine/scheduler.py)."""
        for hook in self.step_boundary_hooks:
            hook(self)
        if self.batches.active():   # a pipelined instance: several batches in flight (engine/batch_queue.py)
            return self.batches.step()
        start = time.time()
        scheduler_output = self.scheduler.schedule()
        self._count_prefix_cache(scheduler_output)
        if not scheduler_output:
            self._update_gauges()
            return []
        mix = self.timeline.step_mix(scheduler_output) if self.timeline is not None else None
        outputs = self._complete(scheduler_output, self._submit(scheduler_output)())
        if mix is not None:
            self._record_step(start, scheduler_output, mix)
        return outputs

    def _record_step(self, start: float, scheduler_output: SchedulerOutput, mix: tuple[int, int, int]) -> None:
        scheduler, kv = self.scheduler, self.scheduler.kv
        admitted = sum(s.seq.scheduled_time is not None and s.seq.scheduled_time >= start for s in scheduler_output)
        self.timeline.on_step(start, time.time(), mix, admitted=admitted, waiting=len(scheduler.waiting),
                              running=len(scheduler.running), kv_used=kv.num_used, kv_total=kv.num_total,
                              preemptions=scheduler.num_preemptions)

    def _count_prefix_cache(self, scheduler_output: SchedulerOutput) -> None:
        if scheduler_output.prefix_cache_queries:
            self.metrics.on_prefix_cache(scheduler_output.prefix_cache_queries, scheduler_output.prefix_cache_hits)

    def _complete(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[RequestOutput]:
        """The step's output in: advance its sequences, then stop conditions and outputs."""
        self.num_steps += 1
        touched = self._fail_sampling_errors(scheduler_output, runner_output)
        self.num_computed_prompt_tokens += self.scheduler.update_from_output(scheduler_output, runner_output)
        return self._process_outputs(scheduler_output, runner_output, touched)

    def _submit(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Send the step to the runner; returns a call that waits for its ModelRunnerOutput. Sampled where the
        logits are: on the worker when the runner offers it and no row needs the logits here (log-probabilities),
        else here. Only a step sampled on the workers of a runner that overlaps calls is in flight on return."""
        scheduled = scheduler_output.scheduled
        inputs = [SeqStepInput(s.seq.token_ids[s.start:s.start + s.num_new_tokens], s.start, s.seq.block_ids,
                               s.completes_prompt, self._wants_prompt_logits(s)) for s in scheduled]
        seqs = scheduler_output.sampling_seqs   # the step's sampling rows, in order
        constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        bitmask = fill_bitmasks([seqs[row].grammar for row in constrained]) if constrained else None   # [n, W]
        remote = self._sampling_runner(inputs, seqs)
        if remote is not None:   # sampled where the logits are; only token ids come back
            row_masks = dict(zip(constrained, bitmask.numpy())) if constrained else {}
            sampling = [RemoteSampling.of(seq, row_masks[row].tobytes() if row in row_masks else None)
                        for row, seq in enumerate(seqs)]
            submit = getattr(self.runner, "submit_sampled", None)
            if submit is not None and self.batches.depth() > 1:
                wait = submit(inputs, sampling)
                return lambda: ModelRunnerOutput(*adopt_sampled(wait(), seqs))
            done = ModelRunnerOutput(*adopt_sampled(remote(inputs, sampling), seqs))
            return lambda: done
        logits = self.runner.execute(inputs)  # [rows, vocab]: see Runner.execute
        if any(i.all_logits for i in inputs):
            logits = self._take_prompt_logprobs(scheduled, inputs, logits)  # -> [num_sampling, vocab]
        masks = (constrained, bitmask) if constrained else None
        # log-probabilities are of the raw distribution, before the grammar's mask (vLLM's default)
        raw_needed = constrained and any(seqs[row].params.logprobs is not None for row in constrained)
        tokens, raised = sample(logits.clone() if raw_needed else logits, seqs, masks) if seqs else ([], {})
        failures = {row: f"{type(exc).__name__}: {exc}" for row, exc in raised.items()}
        done = ModelRunnerOutput(tokens, failures, self._sampled_logprobs(logits, seqs, tokens, failures))
        return lambda: done

    def _fail_sampling_errors(self, scheduler_output: SchedulerOutput,
                              runner_output: ModelRunnerOutput) -> dict[str, Request]:
        """A request whose sampling raised (e.g. on NaN logits) fails alone; the batch goes on. Returns the failed
        requests by id (they get a final output this step)."""
        touched: dict[str, Request] = {}
        for row, reason in runner_output.failures.items():
            request = self.requests.get(scheduler_output.sampling_seqs[row].request_id)
            if request is None:   # aborted while its step was in flight (cross-step pipelining)
                continue
            self._fail_request(request, f"sampling failed: {reason}")
            touched[request.request_id] = request
        return touched

    def _process_outputs(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                         touched: dict[str, Request]) -> list[RequestOutput]:
        """Stop conditions, detokenization, latency metrics and the outputs of every request the step touched."""
        now = time.time()
        for seq, token in zip(scheduler_output.sampling_seqs, runner_output.sampled_token_ids):
            if token is None or seq.is_finished:
                continue
            request = self.requests[seq.request_id]
            self.metrics.on_generation_tokens(1)
            if seq.grammar is not None and not seq.grammar.consume(token):
                self._fail_request(request, f"structured output: token {token} broke the constraint "
                                            f"({seq.grammar.error()})")
                touched[request.request_id] = request
                continue
            reason = self.output_processor.finish_reason(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            touched[request.request_id] = request
        for request in touched.values():
            if request.error is not None:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
                self.metrics.observe_ttft(now - request.arrival_time, len(request.prompt_token_ids))
                self._recent_ttft.append(now - request.arrival_time)
            elif request.last_token_time is not None:
                self.metrics.observe_tpot(now - request.last_token_time)
                self._recent_tpot.append(now - request.last_token_time)
            request.last_token_time = now
        outputs = [out for out in map(self._make_output, touched.values()) if out is not None]
        self._update_gauges()
        return outputs

    def _sampling_runner(self, inputs: list[SeqStepInput], seqs: list[Sequence]):
        """The runner's `execute_sampled` when this step can sample where the logits are: no row asks for
        log-probabilities (those need the logits here). None: the logits come back and are sampled here."""
        if not getattr(self.runner, "samples_remotely", False):
            return None
        if any(i.all_logits for i in inputs) or any(q.params.logprobs is not None for q in seqs):
            return None
        return self.runner.execute_sampled

    # ------------------------------------------------------------------ log-probabilities and failures
    def _wants_prompt_logits(self, s: ScheduledSeq) -> bool:
        """Does this chunk hold prompt positions whose log-probabilities the request still lacks? Only the first
        sequence of a request computes them (its siblings share the prompt); a recompute after preemption does not
        compute them again."""
        seq = s.seq
        if seq.params.prompt_logprobs is None or seq.index != 0:
            return False
        have = len(self.requests[seq.request_id].prompt_logprobs)   # prompt positions 0 .. have - 1 are done
        # the chunk's logits predict positions num_computed + 1 .. num_computed + num_new_tokens
        return have < seq.num_prompt_tokens and seq.num_computed_tokens + s.num_new_tokens >= have

    def _take_prompt_logprobs(self, scheduled: list[ScheduledSeq], inputs: list[SeqStepInput], logits):
        """Record the prompt log-probabilities in the rows of all_logits inputs; returns the sampling rows only
        ([num_sampling, vocab], one per input with needs_logits, in order)."""
        sampling_rows, row = [], 0
        for s, step_input in zip(scheduled, inputs):
            rows = len(step_input.token_ids) if step_input.all_logits else int(step_input.needs_logits)
            if step_input.all_logits:
                request = self.requests[s.seq.request_id]
                first = len(request.prompt_logprobs)                       # next prompt position without one
                last = min(step_input.num_computed + rows, s.seq.num_prompt_tokens - 1)
                if first <= last:
                    # row r predicts position num_computed + 1 + r
                    start = row + first - step_input.num_computed - 1
                    request.prompt_logprobs.extend(token_logprobs(
                        logits[start:start + last - first + 1], request.prompt_token_ids[first:last + 1],
                        [request.params.prompt_logprobs] * (last - first + 1)))
            if step_input.needs_logits:
                sampling_rows.append(row + rows - 1)
            row += rows
        return logits[sampling_rows]

    @staticmethod
    def _sampled_logprobs(logits, seqs: list[Sequence], tokens: list[int | None],
                          failures: dict[int, str]) -> list | None:
        """Each sampled token's log-probability record for the rows that asked (one batched call), None for the
        others and for the rows of a request that failed this step; None when no row asked."""
        failed = {seqs[row].request_id for row in failures}
        rows = [r for r, (seq, token) in enumerate(zip(seqs, tokens))
                if token is not None and seq.params.logprobs is not None and seq.request_id not in failed]
        if not rows:
            return None
        records = token_logprobs(logits[rows], [tokens[r] for r in rows], [seqs[r].params.logprobs for r in rows])
        out: list = [None] * len(seqs)
        for r, record in zip(rows, records):
            out[r] = record
        return out

    def _fail_request(self, request: Request, message: str) -> None:
        """End one request with an error (its sampling raised, e.g. on NaN logits); its blocks come back now."""
        request.error = message
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")

    def _make_output(self, request: Request) -> RequestOutput | None:
        output = self.output_processor.request_output(request)
        if request.is_finished and output is not None:
            del self.requests[request.request_id]
            self.metrics.on_request_finished("error" if request.error else request.seqs[0].finish_reason, request)
            if self.timeline is not None:
                self.timeline.on_request_finished(request)
        return output

    def release_unstarted(self, request_id: str) -> Request:
        """Hand over a request none of whose sequences has started, for another engine to adopt() (rebalance.py)."""
        if request_id not in self.requests or not self.requests[request_id].is_unstarted:
            raise ValueError(f"request {request_id!r} is not waiting unstarted in this engine")
        request = self.requests.pop(request_id)
        self.scheduler.remove_waiting(request.seqs)
        return request

    def adopt(self, request: Request, block_ids: dict[int, list[int]], recompute: bool = False,
              exchanging: bool = False) -> None:
        """Take over a request another engine ran (a reshape moves it here with its KV cache): block_ids maps
        each of its sequences' seq_id to the blocks that now hold its cache in this engine's KV manager. Nothing
        is recomputed; the scheduler keeps admission order. recompute=True: it comes without its KV cache (the new
        layout had no room), so its running sequences are preempted by recompute here. exchanging=True: its KV is
        still in transit (a parameter drop's exchange): its running sequences wait until release_exchanging."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in this engine")
        running, waiting = [], []
        for seq in request.seqs:
            # Its KV was computed in another instance (another layout): none of it becomes findable here, and a
            # recompute hashes its chain anew in this instance's cache epoch.
            seq.cache_epoch = None
            if recompute and seq.status is SeqStatus.RUNNING:
                self.scheduler.reset_for_recompute(seq)
            if seq.seq_id in block_ids:
                seq.block_ids = list(block_ids[seq.seq_id])
            if seq.status is SeqStatus.RUNNING:
                running.append(seq)
            elif seq.status is SeqStatus.WAITING:
                waiting.append(seq)
        self.requests[request.request_id] = request
        if exchanging:
            self.scheduler.park_exchanging(running)
            running = []
        self.scheduler.adopt(running, waiting)

    def preempt_request(self, request_id: str) -> int:
        """Preempt the running sequences of one request by recompute (its KV cache is gone). Returns how many."""
        running = [seq for seq in self.requests[request_id].seqs if seq.status is SeqStatus.RUNNING]
        for seq in running:
            self.scheduler.preempt(seq)
        return len(running)

    def preempt_running(self) -> int:
        """Preempt every running sequence by recompute (its KV cache was lost, e.g. with a dead worker); the
        oldest ends up first in the queue. Returns how many."""
        running = list(self.scheduler.running)
        for seq in reversed(running):
            self.scheduler.preempt(seq)
        return len(running) + self.scheduler.drop_exchanging()

    # ------------------------------------------------------------------ visibility
    def load_snapshot(self) -> EngineLoad:
        """KV use, queue and the TTFT / TPOT samples since the previous snapshot (which this call drains)."""
        scheduler = self.scheduler
        kv = scheduler.kv
        head, blocked = scheduler.head_of_line()
        delay = max(0.0, time.time() - head.arrival_time) if head is not None else 0.0
        ttft, tpot = list(self._recent_ttft), list(self._recent_tpot)
        self._recent_ttft.clear()
        self._recent_tpot.clear()
        return EngineLoad(kv.num_used, kv.num_total, len(scheduler.waiting), len(scheduler.running),
                          delay, blocked, ttft, tpot)

    def _update_gauges(self) -> None:
        kv = self.scheduler.kv
        self.metrics.set_load(kv.num_used, kv.num_total, len(self.scheduler.waiting),
                              len(self.scheduler.running))
        new_preemptions = self.scheduler.num_preemptions - self._reported_preemptions
        if new_preemptions:
            self.metrics.on_preemption(new_preemptions)
            self._reported_preemptions = self.scheduler.num_preemptions

    def stats(self) -> dict:
        kv = self.scheduler.kv
        cache = kv.prefix_cache
        return {"kv_blocks_used": kv.num_used, "kv_blocks_total": kv.num_total,
                "prefix_cache_blocks": len(cache) if cache is not None else 0,
                "prefix_cache_free_blocks": kv.num_cached_free,
                "prefix_cache_queried_tokens": cache.num_queried_tokens if cache is not None else 0,
                "prefix_cache_hit_tokens": cache.num_hit_tokens if cache is not None else 0,
                "num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "num_exchanging": len(self.scheduler.exchanging),
                "num_preemptions": self.scheduler.num_preemptions, "num_requests": len(self.requests),
                "num_steps": self.num_steps, "num_computed_prompt_tokens": self.num_computed_prompt_tokens}
