"""The one place a step's new tokens become what a caller sees (vLLM's OutputProcessor): stop conditions (EOS and
stop tokens, stop strings, length), incremental detokenization (engine/detokenizer.py) and each request's
RequestOutput in its output kind. Torch-free; the engine calls it after `Scheduler.update_from_output` and ends the
sequences it says are done through the scheduler. Log-probabilities are formatted for the wire by
serving/logprobs_format.py."""
from __future__ import annotations

import time

from elastic_hf.engine.detokenizer import Detokenizer
from elastic_hf.engine.outputs import CompletionOutput, RequestOutput
from elastic_hf.engine.sampling_params import RequestOutputKind
from elastic_hf.engine.sequence import Request, Sequence


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.detokenizer = Detokenizer(tokenizer)
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """`token` has just joined `seq`: detokenize it, and say whether the sequence is done ("stop": EOS, a stop
        token or a stop string; "length") or not (None). An EOS / stop token is not part of the output."""
        params = seq.params
        reason = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_set:
            reason = "stop"
            # The EOS / stop token is not part of the text; keep it out of the output like OpenAI does.
            seq.token_ids.pop()
            if len(seq.logprobs) > seq.num_output_tokens:
                seq.logprobs.pop()
        stopped_by_string = self.detokenizer.update(seq)
        if reason is None and stopped_by_string:
            reason = "stop"
        if reason is None and seq.grammar is not None and seq.grammar.is_stopped():
            reason = "stop"   # the structured output is complete: nothing but EOS could follow
        if reason is None and (seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len):
            reason = "length"
        if reason is not None and not stopped_by_string:
            self.detokenizer.finish(seq)
        return reason

    def request_output(self, request: Request) -> RequestOutput | None:
        """The request's output after this step, in its params.output_kind; None for a FINAL_ONLY request that is
        still running. DELTA and FINAL_ONLY touch only what is new, so their per-step cost does not grow with the
        output's length (CUMULATIVE copies the whole output each time, as asked). A finished request gets its
        finish time."""
        finished = request.is_finished
        kind = request.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        completions = [self._completion(seq, kind) for seq in request.seqs]
        if finished:
            request.finish_time = time.time()
        return RequestOutput(request.request_id, request.prompt_token_ids, completions, finished,
                             request.arrival_time, request.first_token_time, request.finish_time,
                             request.prompt_logprobs, request.error,
                             max(seq.num_cached_tokens for seq in request.seqs))

    def _completion(self, seq: Sequence, kind: RequestOutputKind) -> CompletionOutput:
        """One sequence's output; advances what it has emitted."""
        end = self.detokenizer.emittable_length(seq, seq.is_finished)
        first_new = seq.num_prompt_tokens + seq.num_emitted_tokens   # index in token_ids of the first new token
        delta_ids = seq.token_ids[first_new:]
        delta_text = seq.text[seq.num_emitted_chars:end]
        wants_logprobs = seq.params.logprobs is not None
        delta_logprobs = seq.logprobs[seq.num_emitted_tokens:] if wants_logprobs else None
        if kind is RequestOutputKind.DELTA:
            text, token_ids, logprobs = delta_text, delta_ids, delta_logprobs
        else:
            text, token_ids = seq.text[:end], seq.output_token_ids
            logprobs = list(seq.logprobs) if wants_logprobs else None
        seq.num_emitted_chars = end
        seq.num_emitted_tokens += len(delta_ids)
        return CompletionOutput(index=seq.index, text=text, token_ids=token_ids, delta_text=delta_text,
                                delta_token_ids=delta_ids, finish_reason=seq.finish_reason, logprobs=logprobs,
                                delta_logprobs=delta_logprobs)
