"""A deployment: one or more workers (the data plane) under one control plane in this process, which keeps a
torch-free scheduler and an LLMEngine per instance and drives every instance's steps. It implements the engine
interface the server drives (engine/protocol.py), so one worker in-process and N worker processes look the same to
ElasticModel and AsyncEngine.

Decisions are made in engine/ (routing, scale up/down: TPPolicy) and morph/ (MorphManager per worker) and executed
here; a reshape is a transaction (parallel/reshape.py)."""
from __future__ import annotations

import itertools
import logging

from elastic_hf.config import EngineConfig
from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.llm_engine import LLMEngine
from elastic_hf.engine.metrics import EngineMetrics
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.input_processor import EngineRequest, InputProcessor
from elastic_hf.engine.request_limits import check_queue_capacity, resolve_max_model_len
from elastic_hf.engine.routing import InstanceLoad, TPPolicy
from elastic_hf.engine.sampler import request_seeds
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.scheduler import Scheduler
from elastic_hf.engine.sequence import worst_case_kv_blocks
from elastic_hf.engine.timeline import Timeline
from elastic_hf.kv.kv_manager import KVManager
from elastic_hf.kv.prefix_cache import PrefixCache, hash_function, prompt_lookup_hashes
from elastic_hf.layers.shard_layout import allowed_tp_degrees
from elastic_hf.model.generation_defaults import generation_defaults
from elastic_hf.model.loader import eos_token_ids
from elastic_hf.morph.builder import create_manager, swap_order
from elastic_hf.morph.manager import MorphManager
from elastic_hf.morph.metrics import MorphMetrics
from elastic_hf.parallel.instance_runner import Instance, InstanceRunner
from elastic_hf.parallel.deployment_stats import deployment_stats, instance_loads, load_totals
from elastic_hf.parallel.metrics import DeploymentMetrics
from elastic_hf.parallel.overload_control import OverloadControl
from elastic_hf.parallel.queue_balancer import QueueBalancer
from elastic_hf.parallel.recovery import replace_dead_workers
from elastic_hf.parallel.reshape import (RETIRED_COUNTERS, ReshapeAborted, ReshapeReport, resume_instances,
                                        run_reshape)
from elastic_hf.parallel.executor import Executor
from elastic_hf.parallel.executor_factory import start_executor
from elastic_hf.parallel.worker import Worker
from elastic_hf.parallel.worker_pool import WorkerError
from elastic_hf.patches import get_adapter
from elastic_hf.topology import InstanceShape, Topology, candidate_topologies, parse_topology

log = logging.getLogger(__name__)


SCALE_DOWN_BACKOFF_STEPS = 16  # steps to wait after a scale-down that did not fit before trying again
MAX_DEFAULT_MODEL_LEN = 8192


class Deployment:
    def __init__(self, config: EngineConfig, *, checkpoint_dir, model_id: str, tokenizer, hf_config):
        """Start the workers of `config` for a resolved checkpoint (ElasticModel.from_pretrained resolves it)."""
        self.config = config
        self.model_id = model_id
        self.checkpoint_dir = checkpoint_dir
        self.tokenizer = tokenizer
        self.hf_config = hf_config
        self.generation_defaults = generation_defaults(config.generation_config, checkpoint_dir)
        adapter = get_adapter(hf_config).for_workers(config.num_workers)
        _, self.num_kv_heads, self.head_dim = adapter.head_counts(hf_config)
        self.degrees = allowed_tp_degrees(config.num_workers, self.num_kv_heads)
        self.num_layers = hf_config.num_hidden_layers
        self.candidates = candidate_topologies(config.num_workers, self.degrees, with_standby=True,
                                               max_pp=min(config.num_workers, self.num_layers))
        self.topology = self.check_topology(config.topology)
        self.eos_token_ids = eos_token_ids(checkpoint_dir, tokenizer)
        self._seq_ids = itertools.count()   # shared by every instance engine: ids stay unique across moves
        self.timeline = Timeline(config.timeline) if config.timeline else None   # shared by every instance engine
        self._request_ids = itertools.count()
        self.retired = dict.fromkeys(RETIRED_COUNTERS, 0)   # counters of engines replaced by reshapes
        self.reshapes: list[ReshapeReport] = []
        self.num_recoveries = self.num_rejected_reshapes = 0
        self._scale_down_backoff = 0
        self.drained_outputs: list[RequestOutput] = []   # of batches finished between steps (drain_batches)
        self._capacities: dict[tuple[int, ...], int] = {}
        self.long_request_ids: set[str] = set()
        # --seed: one stream of request seeds across the instance engines, drawn in order of acceptance
        self._request_seeds = request_seeds(config.seed) if config.seed is not None else None
        self.policy = TPPolicy(config, self.degrees)
        self._hash_fn = hash_function(config.prefix_caching_hash_algo)   # cache-aware routing hashes prompts once
        self.balancer = QueueBalancer(config, self._lookup_hashes)   # moves unstarted requests between queues
        self.morph_managers: dict[int, MorphManager] = {}
        self.overload: OverloadControl | None = None
        self.pool: Executor | None = None   # the executor of the workers (parallel/executor.py)
        self.instances: list[Instance] = []
        try:
            self.pool = start_executor(config, str(checkpoint_dir), model_id, hf_config)
            self.tp1_blocks = self.pool.call(0, Worker.kv_capacity, 1, 0)  # "long": more than a TP1 instance holds
            self.max_model_len = self._max_model_len()
            self.input_processor = InputProcessor.for_config(config, tokenizer, hf_config.vocab_size,
                                                             self.max_model_len, self.eos_token_ids)
            # One set of request metrics across every instance engine (engines come and go with reshapes): gauges show
            # the whole deployment; the deployment's and morph metrics share its registry (one /metrics page).
            self.metrics = EngineMetrics(model_id, max_model_len=self.max_model_len)
            self.metrics.load_totals = lambda: load_totals(self.instances)
            self.deployment_metrics = DeploymentMetrics(self.metrics.registry)
            self.deployment_metrics.set_topology(self.topology)
            self.instances = self._build_instances(self.topology)
            if config.morph.enabled:
                self._start_morph()
            self.overload = OverloadControl(self)   # the arbiter over morphing, TP merges and parameter drops
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ assembly
    def check_topology(self, value) -> Topology:
        """The topology `value` names, if it is a candidate (layer splits of pipelined instances aside) whose
        splits fit the model; else ValueError naming what is allowed."""
        topology = parse_topology(value)
        if topology.without_splits() not in self.candidates:
            raise ValueError(f"topology {topology} is not a candidate for {self.config.num_workers} workers, "
                             f"{self.num_kv_heads} KV heads and {self.num_layers} layers: "
                             f"{[str(t) for t in self.candidates]}")
        topology.check_layers(self.num_layers)
        return topology

    def capacity(self, key: tuple[tuple[int, ...], InstanceShape]) -> int:
        """KV blocks of a full-precision instance (workers, shape). Fixed per key: the budgets do not change. Every
        stage holds the same block ids for its own layers, so a pipelined instance holds what its fullest stage
        holds."""
        if key not in self._capacities:
            workers, shape = key
            bounds = shape.stage_bounds(self.num_layers)
            self._capacities[key] = min(
                self.pool.call(w, Worker.kv_capacity, shape.tp, i % shape.tp,
                               bounds[i // shape.tp] if shape.pp > 1 else None)
                for i, w in enumerate(workers))
        return self._capacities[key]

    def _new_instance(self, key: tuple[tuple[int, ...], InstanceShape], kv: KVManager) -> Instance:
        workers, shape = key
        kv.bind_pools(lambda resize: self.pool.collective_rpc(Worker.resize_kv, (resize,), workers))
        if self.config.enable_prefix_caching:
            kv.prefix_cache = PrefixCache(self.config.prefix_caching_hash_algo)
        runner = InstanceRunner(self.pool, workers, shape, self.deployment_metrics.on_pipeline_step,
                                self.config.pipeline_batches)
        engine = LLMEngine(runner, Scheduler(self.config, kv, shape.pp), self.tokenizer,
                           model_id=self.model_id, max_model_len=self.max_model_len,
                           eos_token_ids=self.eos_token_ids, input_processor=self.input_processor,
                           metrics=self.metrics, seq_ids=self._seq_ids, request_seeds=self._request_seeds)
        engine.timeline = self.timeline
        return Instance(workers, engine, shape, runner)

    def _build_instances(self, topology: Topology) -> list[Instance]:
        instances = []
        for key in topology.instance_keys():
            num_blocks = self.capacity(key)
            self.pool.collective_rpc(Worker.init_kv, (num_blocks,), key[0])
            instances.append(self._new_instance(key, KVManager(num_blocks, self.config.block_size)))
        return instances

    def _max_model_len(self) -> int:
        """The configured limit, else what the model and the largest KV cache a reshape can reach allow (a request
        too long for the current instances merges them under the elastic policy, or waits for an admin reshape)."""
        limit = getattr(self.hf_config, "max_position_embeddings", None) or MAX_DEFAULT_MODEL_LEN
        kv_tokens = max(self.capacity(key) for t in self.candidates for key in t.instance_keys()) \
            * self.config.block_size
        return resolve_max_model_len(self.config, limit, kv_tokens, MAX_DEFAULT_MODEL_LEN)

    def _start_morph(self) -> None:
        morph_metrics = MorphMetrics(self.metrics.registry)
        for w in range(self.config.num_workers):
            info = self.pool.call(w, Worker.morph_info)
            order = swap_order(self.config.morph, self.hf_config, info.num_layers)
            send = (lambda method, *args, worker=w: self.pool.call(worker, method, *args))
            self.morph_managers[w] = create_manager(self.config.morph, send, w, info, order, morph_metrics)
        self.bind_morph()

    def bind_morph(self) -> None:
        """Each TP1 instance's worker morphs; a worker in a larger instance (or in standby) pauses."""
        owner = {inst.workers[0]: inst.engine for inst in self.instances if inst.shape == InstanceShape(1)}
        for w, manager in self.morph_managers.items():
            if manager.engine is not (engine := owner.get(w)):
                manager.bind(engine)

    # ------------------------------------------------------------------ the engine interface
    @property
    def num_steps(self) -> int:
        return self.retired["num_steps"] + sum(i.engine.num_steps for i in self.instances)

    @property
    def num_computed_prompt_tokens(self) -> int:
        live = sum(i.engine.num_computed_prompt_tokens for i in self.instances)
        return self.retired["num_computed_prompt_tokens"] + live

    def loads(self, prompt_hashes: list | None = None) -> list[InstanceLoad]:
        """What the routing policy reads of every instance (with the cached prefix of a request being routed)."""
        return instance_loads(self.instances, self.capacity, self.long_request_ids, prompt_hashes)

    def add_request(self, request_id: str | None, prompt: str | list[int] | EngineRequest,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    instance: int | None = None) -> str:
        """Route a request (Gyges Alg. 1, engine/routing.py). `prompt`: text or token ids (validated here by the
        input processor), or the EngineRequest it already made (the server's input thread). Only a valid request
        is routed: under the elastic TP policy one that no instance can hold first merges instances (x2, a reshape
        at this step boundary). Returns the request id."""
        request = prompt if isinstance(prompt, EngineRequest) else self.input_processor.process(
            prompt, params or SamplingParams(temperature=0.0), request_id, arrival_time)
        params = request.params
        request_id = request_id or request.request_id or f"dep-{next(self._request_ids)}"
        if any(request_id in inst.engine.requests for inst in self.instances):
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        if instance is not None and not 0 <= instance < len(self.instances):
            raise InvalidRequest(f"instance must be in [0, {len(self.instances)}) for topology {self.topology}, "
                                 f"got {instance}", param="instance")
        check_queue_capacity(self.config, params, sum(len(i.engine.scheduler.waiting) for i in self.instances))
        need = worst_case_kv_blocks(len(request.prompt_token_ids), params.max_tokens, self.config.block_size,
                                    params.n)
        is_long = need > self.tp1_blocks
        pinned = instance is not None
        if instance is None:
            instance = self._admit(need, is_long, self._lookup_hashes(request))
        engine = self.instances[instance].engine
        if engine.scheduler.kv.num_total < need and len(self.instances) > 1:
            raise InvalidRequest(f"request needs {need} KV blocks; instance {instance} of topology {self.topology} "
                                 f"holds {engine.scheduler.kv.num_total} and the TP policy "
                                 f"{self.policy.tp_policy!r} cannot merge further", param="max_tokens",
                                 code="context_length_exceeded")
        engine.add_request(request_id, request)
        if is_long:
            self.long_request_ids.add(request_id)
        if pinned:
            self.balancer.pinned.add(request_id)
        return request_id

    def _lookup_hashes(self, request: EngineRequest) -> list | None:
        """The prompt's prefix-cache lookup hashes (the same in every instance), when routing has a choice."""
        if self.config.enable_prefix_caching and len(self.instances) > 1 and not request.params.prompt_logprobs:
            return prompt_lookup_hashes(request.prompt_token_ids, self.config.block_size, self._hash_fn,
                                        request.params.cache_salt)

    def _admit(self, need: int, is_long: bool, prompt_hashes: list | None = None) -> int:
        # The elastic TP policy merges and splits TP instances; with a pipelined instance it only routes.
        merge_failed = not self.topology.is_tensor_only
        for _ in range(len(self.degrees) + 1):
            admission = self.policy.admit(self.loads(prompt_hashes), self.topology.sizes, need, is_long, merge_failed)
            if admission.merge_to is None:
                return admission.instance
            try:
                self.reshape(admission.merge_to)
            except (ValueError, ReshapeAborted) as exc:  # the old topology serves on
                self.num_rejected_reshapes += 1
                merge_failed = True
                log.info("scale-up to %s refused: %s", list(admission.merge_to), exc)
        return self.policy.admit(self.loads(prompt_hashes), self.topology.sizes, need, is_long, True).instance

    def abort_request(self, request_id: str) -> None:
        """Idempotent: a no-op for unknown or finished requests."""
        for inst in self.instances:
            if request_id in inst.engine.requests:
                inst.engine.abort_request(request_id)
        self.long_request_ids.discard(request_id)
        self.balancer.pinned.discard(request_id)

    def has_unfinished_requests(self) -> bool:
        return (bool(self.drained_outputs) or any(i.engine.has_unfinished_requests() for i in self.instances)
                or self.overload.wants_steps())

    def has_runnable_work(self) -> bool:
        """Some sequence can run a step now (requests waiting on a KV exchange cannot)."""
        return any(i.engine.scheduler.running or i.engine.scheduler.waiting for i in self.instances)

    def step(self) -> list[RequestOutput]:
        """One step of every instance with work (requests, or a morph in progress), the instances concurrently."""
        self.balancer.on_step(self.instances, self.long_request_ids)
        busy = [i for i in self.instances if i.engine.has_unfinished_requests()]
        outputs, errors, self.drained_outputs = self.drained_outputs, [], []
        if len(busy) == 1 or self.pool.step_threads is None:
            steps = [inst.engine.step for inst in busy]
        else:
            futures = [self.pool.step_threads.submit(inst.engine.step) for inst in busy]
            steps = [future.result for future in futures]
        for step in steps:
            try:
                outputs.extend(step())
            except WorkerError as exc:  # that instance's step did not happen; its scheduler state is retryable
                errors.append(exc)
        if errors:
            if not self.pool.check_health():
                raise errors[0]
            self.recover()
        self._maybe_scale_down()
        try:
            self.overload.on_step()
        except WorkerError:   # a group member died mid-exchange: its requests are recomputed
            if not self.pool.check_health():
                raise
            self.recover()
        self.metrics.set_load(*load_totals(self.instances))   # a reshape in this step may have changed the instances
        return outputs

    def drain_batches(self) -> None:
        """Finish the batches in flight (cross-step pipelining); the next step returns their outputs."""
        for inst in self.instances:
            inst.engine.batches.drain()
            self.drained_outputs += inst.engine.batches.take_stashed()

    def _maybe_scale_down(self) -> None:
        """Gyges Alg. 2 at a step boundary: split a merged instance once no long request is left on it and its
        load is low enough."""
        if not self.policy.is_elastic or not self.topology.is_tensor_only or self.overload.arbiter.active:
            return   # a merge made by the overload arbiter is undone by the arbiter
        live = {r for inst in self.instances for r in inst.engine.requests}
        self.long_request_ids &= live
        if self._scale_down_backoff > 0:
            self._scale_down_backoff -= 1
            return
        target = self.policy.scale_down_target(self.topology.sizes, self.loads())
        if target is None:
            return
        try:
            self.reshape(target)
        except (ValueError, ReshapeAborted) as exc:
            # The running requests do not fit the halves yet (plan or budget said so): serve on, retry later.
            self.num_rejected_reshapes += 1
            self._scale_down_backoff = SCALE_DOWN_BACKOFF_STEPS
            log.info("scale-down to %s postponed: %s", list(target), exc)

    def stats(self) -> dict:
        return deployment_stats(self)

    def reset_prefix_cache(self) -> int:
        """Empty every instance's prefix cache (POST /reset_prefix_cache) between steps; returns the blocks named."""
        return sum(inst.engine.scheduler.kv.reset_prefix_cache() for inst in self.instances)

    def memory_report(self) -> list[dict]:
        """Every worker's ledger (committed bytes per owner, KV blocks, RSS)."""
        return self.pool.collective_rpc(Worker.memory_report)

    # ------------------------------------------------------------------ reshape and recovery
    def reshape(self, target, weights_source: str | None = None, allow_preemption: bool = False,
                overlap_weights: bool = True) -> ReshapeReport:
        """Change the topology in place (a transaction, see parallel/reshape.py) between steps. Requests whose KV
        the new layout cannot hold are preempted by recompute only with allow_preemption (an operator's reshape);
        the TP policy's own merges and splits wait. overlap_weights=False: weights after the KV (measurements)."""
        return run_reshape(self, target, weights_source, allow_preemption, overlap_weights)

    def resume(self, new: Topology, plan, placement) -> None:
        self.instances, retired = resume_instances(self.instances, new, plan, placement, self._new_instance)
        self.retired = {key: self.retired[key] + retired[key] for key in RETIRED_COUNTERS}
        self.topology = new
        self.bind_morph()
        self.overload.apply_lookahead()
        if plan.defer_kv:
            self.overload.start_exchange(plan)

    def settle_exchange(self) -> None:
        """Finish a parameter drop's KV exchange now (before another reshape moves anything)."""
        if self.overload is not None:
            self.overload.settle_exchange()

    def on_reshape(self, report: ReshapeReport) -> None:
        self.reshapes.append(report)
        self.deployment_metrics.on_reshape(report.committed, report.seconds, report.worker_stats)
        if report.committed:
            self.deployment_metrics.set_topology(self.topology)

    def recover(self) -> list[int]:
        """Replace dead worker processes under the current topology (parallel/recovery.py). Returns them."""
        return replace_dead_workers(self)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __enter__(self) -> "Deployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
