"""ElasticModel: the one user-facing object over a deployment of one worker (in this process) or several (worker
processes joined by torch.distributed). `generate`, `chat` and `stream` drive the deployment in the calling thread;
the server drives the same deployment (`model.engine`) from its own thread through AsyncEngine. `morph` and
`reshape` change the running deployment, `drop` and `restore` drop and restore replicated layers (KunServe);
`memory_report` reads every worker's ledger."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Iterable, Iterator

from elastic_hf.config import EngineConfig, MorphConfig
from elastic_hf.engine.sampling_params import sampling_params_from_generation_config
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.sampling_params import RequestOutputKind, SamplingParams
from elastic_hf.parallel.deployment import Deployment
from elastic_hf.parallel.reshape import ReshapeReport
from elastic_hf.units import format_bytes

log = logging.getLogger(__name__)

_MEMORY_TOTALS = ("budget_bytes", "weights_bytes", "kv_bytes", "free_bytes", "kv_blocks")


class MorphControls:
    """Precision morphing of a running model (`ElasticModel.morph`). Each TP-1 instance's worker morphs its own
    layers and grows its own KV cache; `instance` picks which (0 for a single-worker model)."""

    def __init__(self, deployment: Deployment):
        self._deployment = deployment

    @property
    def managers(self) -> dict:
        """worker id -> its MorphManager."""
        return self._deployment.morph_managers

    def manager(self, instance: int = 0):
        instances = self._deployment.instances
        if isinstance(instance, bool) or not isinstance(instance, int) or not 0 <= instance < len(instances):
            raise ValueError(f"instance must be in [0, {len(instances)}) for topology {self._deployment.topology}, "
                             f"got {instance!r}")
        inst = instances[instance]
        if inst.tp != 1:
            raise ValueError(f"instance {instance} runs at TP{inst.tp} on workers {list(inst.workers)}: precision "
                             "morphing runs on TP-1 instances; reshape it back first")
        return self.managers[inst.workers[0]]

    def to_precision(self, layers: int | Iterable[int] | str, precision: str, *, instance: int = 0,
                     wait: bool = True, timeout: float = 120.0, controller: bool | None = None) -> dict:
        """Force `layers` ("all", an index or a list) of one instance to `precision` ("fp", "w8", "w4"); see
        MorphManager.to_precision. Returns that instance's state()."""
        return self.manager(instance).to_precision(layers, precision, wait=wait, timeout=timeout,
                                                   controller=controller)

    def state(self, instance: int = 0) -> dict:
        return {"instance": instance, **self.manager(instance).state()}

    def states(self) -> list[dict]:
        """state() of every TP-1 instance."""
        return [self.state(i) for i, inst in enumerate(self._deployment.instances) if inst.tp == 1]

    def set_controller(self, enabled: bool, instance: int | None = None) -> None:
        """Turn the automatic controller on or off, for one instance or (None) all of them."""
        managers = self.managers.values() if instance is None else [self.manager(instance)]
        for manager in managers:
            manager.set_controller(enabled)

    def attach_driver(self, wake) -> None:
        """Another thread drives the engine from now on (the server's AsyncEngine)."""
        for manager in self.managers.values():
            manager.attach_driver(wake)


class ElasticModel:
    def __init__(self, deployment: Deployment):
        self.deployment = deployment
        self.morph = MorphControls(deployment) if deployment.config.morph.enabled else None
        self._request_ids = itertools.count()

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike | None = None, *, workers: int = 1,
                        tp: int | None = None, morph: str = "off", profile: str | None = None,
                        morph_options: dict | None = None, **options) -> "ElasticModel":
        """Load a local HF checkpoint dir, a .gguf file, a Hub repo id ("org/name": from the Hugging Face cache,
        downloaded when missing and the Hub is reachable) or (None) the embedded SmolLM2-135M-Instruct, on
        `workers` workers (1: in this process; more: worker processes) as instances of TP degree `tp` (default 1;
        or give `topology=(2, 1, 1)`).

        options: the fields of EngineConfig (elastic_hf/config.py): dtype ("auto": the checkpoint's), device,
        revision, tokenizer, download_dir, trust_remote_code, generation_config, memory_budget (per worker:
        bytes, "2GiB" or a fraction of the device), kv_cache_memory, block_size, max_num_seqs,
        max_num_batched_tokens, max_model_len, page_size, packed_weights ("auto", "on", "off"), tp_policy, router,
        overload ("off", "morph", "tp-merge", "drop", "auto", or a dict of OverloadConfig fields), cost_profile, ...
        and transformers' spellings: torch_dtype, device_map ("auto", "cpu", "cuda", "cuda:N"), token.
        morph: "off", "manual" (only model.morph.to_precision), or a controller mode "accuracy" | "default" |
        "performance"; profile: LIS profile JSON for the swap order; morph_options: the other MorphConfig fields
        (precisions, use_cache, calib_path, controller={ControllerConfig overrides}, ...)."""
        if tp is not None:
            if "topology" in options:
                raise ValueError("give either tp or topology, not both")
            if tp < 1 or workers % tp:
                raise ValueError(f"tp must divide workers: tp={tp} does not divide workers={workers}")
            options["topology"] = (tp,) * (workers // tp)
        options = hf_style_options(options)
        model = None if name_or_path is None else str(name_or_path)
        config = EngineConfig(model=model, num_workers=workers,
                              morph=MorphConfig(mode=morph, profile=profile, **(morph_options or {})), **options)
        return cls.from_config(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "ElasticModel":
        from transformers import AutoConfig, AutoTokenizer

        from elastic_hf.model.hub import hub_snapshot, looks_like_repo_id
        from elastic_hf.model.loader import resolve_model, set_chat_template

        resolved = resolve_model(config.model, dtype=config.dtype, device=config.device, revision=config.revision,
                                 download_dir=config.download_dir, token=config.hf_token,
                                 trust_remote_code=config.trust_remote_code)
        config = dataclasses.replace(config, dtype=resolved.dtype)   # "auto" resolved: what every worker loads
        tokenizer_source = config.tokenizer or resolved.checkpoint_dir
        named = config.tokenizer
        if named is not None and not os.path.isdir(named) and looks_like_repo_id(named):
            tokenizer_source = hub_snapshot(config.tokenizer, cache_dir=config.download_dir, token=config.hf_token,
                                            trust_remote_code=config.trust_remote_code, tokenizer_only=True)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=config.trust_remote_code)
        if config.chat_template is not None:   # before the workers load: a bad template fails fast
            set_chat_template(tokenizer, config.chat_template)
        hf_config = AutoConfig.from_pretrained(resolved.checkpoint_dir, trust_remote_code=config.trust_remote_code)
        deployment = Deployment(config, checkpoint_dir=resolved.checkpoint_dir, model_id=resolved.model_id,
                                tokenizer=tokenizer, hf_config=hf_config)
        model = cls(deployment)
        report = model.memory_report()
        log.info("loaded %s (%s) on %d worker(s), topology %s: weights %s, KV %d blocks (%s), max_model_len %d",
                 resolved.model_id, config.dtype, config.num_workers, deployment.topology,
                 format_bytes(report["weights_bytes"]),
                 report["kv_blocks"], format_bytes(report["kv_bytes"]), deployment.max_model_len)
        return model

    # ------------------------------------------------------------------ what it is
    @property
    def engine(self) -> Deployment:
        """What AsyncEngine drives (engine/protocol.EngineCore)."""
        return self.deployment

    @property
    def config(self) -> EngineConfig:
        return self.deployment.config

    @property
    def model_id(self) -> str:
        return self.deployment.model_id

    @property
    def tokenizer(self):
        return self.deployment.tokenizer

    @property
    def checkpoint_dir(self):
        return self.deployment.checkpoint_dir

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len

    @property
    def topology(self):
        """The current layout of the workers into instances (a Topology; str() gives e.g. "[1,1]")."""
        return self.deployment.topology

    @property
    def instances(self) -> list:
        """The serving instances (workers, LLMEngine) of the current topology."""
        return self.deployment.instances

    @property
    def worker(self):
        """The in-process Worker of a single-worker model (its model, arenas and KV pool); None with worker
        processes."""
        return getattr(self.deployment.pool, "worker", None)

    # ------------------------------------------------------------------ generation
    def _params(self, sampling_params, sampling: dict) -> SamplingParams:
        """sampling_params: a SamplingParams, a transformers GenerationConfig or None (then the keywords, HF's
        max_new_tokens included, over the model's offline defaults: greedy, as HF generate, unless its
        generation_config.json says do_sample)."""
        if "max_new_tokens" in sampling:
            if "max_tokens" in sampling:
                raise ValueError("give max_tokens or its alias max_new_tokens, not both")
            sampling["max_tokens"] = sampling.pop("max_new_tokens")
        if sampling_params is not None:
            if sampling:
                raise ValueError(f"pass either sampling_params or keyword options, not both: {sorted(sampling)}")
            if not isinstance(sampling_params, SamplingParams):
                return sampling_params_from_generation_config(sampling_params)
            return sampling_params
        # Offline calls default to greedy like HF generate; the server uses OpenAI's defaults.
        return SamplingParams(**{**self.deployment.generation_defaults.offline(), **sampling})

    def _submit(self, prompt: str | list[int], params: SamplingParams) -> str:
        return self.deployment.add_request(f"offline-{next(self._request_ids)}", prompt, params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(request_ids):
                for out in self.deployment.step():
                    if out.finished:
                        results[out.request_id] = out
        except BaseException:
            for request_id in request_ids:
                self.deployment.abort_request(request_id)
            raise
        return [results[r] for r in request_ids]

    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | None = None, **sampling) -> RequestOutput | list[RequestOutput]:
        """Complete one prompt (-> RequestOutput) or a list (-> list). Prompts are text or token ids.
        sampling_params: a SamplingParams or a transformers GenerationConfig; or sampling keywords: see
        SamplingParams, max_new_tokens accepted for max_tokens (default here: greedy, see _params). One prompt gives
        one output, not vLLM's list of one: HF generate's habit, and what every caller of a single prompt wants."""
        params = self._params(sampling_params, sampling)
        if params.output_kind is RequestOutputKind.CUMULATIVE:
            # only the final output is returned: the engine need not copy the output so far on every step
            params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        request_ids: list[str] = []
        try:
            for prompt in batch:
                request_ids.append(self._submit(prompt, params))
        except ValueError:
            for request_id in request_ids:
                self.deployment.abort_request(request_id)
            raise
        outputs = self._run(request_ids)
        return outputs[0] if single else outputs

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers may hand back a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             **sampling) -> RequestOutput | list[RequestOutput]:
        """One conversation (list of {"role", "content"}) or a list of them, through the model's chat template."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [self.apply_chat_template(c) for c in conversations]
        outputs = self.generate(prompts, sampling_params, **sampling) if len(prompts) > 1 else \
            [self.generate(prompts[0], sampling_params, **sampling)]
        return outputs[0] if single else outputs

    def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
               **sampling) -> Iterator[RequestOutput]:
        """Yields a RequestOutput whenever new text is ready (see delta_text); the last one has finished=True."""
        params = self._params(sampling_params, sampling)
        request_id = self._submit(prompt, params)
        finished = False
        try:
            while not finished:
                for out in self.deployment.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.deployment.abort_request(request_id)

    # ------------------------------------------------------------------ reshaping and memory
    def reshape(self, topology, weights_source: str | None = None, allow_preemption: bool = True) -> ReshapeReport:
        """Change the TP x PP layout in place, e.g. [1, 1] -> [1x2] -> [2] -> [1, 1] (a transaction: a failure
        before its commit point leaves the old layout serving). Requests in flight keep their KV cache and go on
        decoding (also inside a `stream()` loop); those whose KV the new layout cannot hold are preempted by
        recompute and listed in the report's `preempted` (allow_preemption=False refuses the reshape instead). The
        server runs it on its engine thread (POST /admin/reshape)."""
        return self.deployment.reshape(topology, weights_source, allow_preemption)

    def drop(self, demand_tokens: int = 1) -> ReshapeReport | None:
        """Parameter dropping (KunServe): merge data-parallel instances into pipeline groups that keep one copy of each
        layer, enough of them to free `demand_tokens` of KV (1: the smallest drop); the freed pages become KV blocks at
        once and running requests keep their KV (exchanged beside the steps, chunk by chunk so a member never holds the
        old and new pools whole; only when the new layout cannot hold all of it do the youngest go over without it,
        recomputed: the report's `preempted`). None when no plan exists or the transaction rolled back (the reason is in
        overload_state()["history"])."""
        return self.deployment.overload.drop(demand_tokens)

    def restore(self) -> ReshapeReport | None:
        """Undo a drop or an overload TP merge: back to the configured layout (None when already there)."""
        return self.deployment.overload.restore()

    def overload_state(self) -> dict:
        """The overload arbiter: mode, response in effect, KV demand and capacity, exchange in flight, history."""
        return self.deployment.overload.state()

    def memory_report(self) -> dict:
        """Committed bytes summed over the workers (budget, weights, KV, free; KV blocks), plus each worker's own
        ledger under "workers" (with one worker, its fields are also at the top level), and the prefix cache: blocks
        it names (in use or free) and its hit rate over the prompt tokens looked up."""
        workers = self.deployment.memory_report()
        totals = {key: sum(w[key] for w in workers) for key in _MEMORY_TOTALS}
        instances = self.deployment.instances
        single = workers[0] if len(workers) == 1 else {}  # one worker: its ledger and block size at the top
        stats = self.deployment.stats()
        return {**single, **totals, "kv_blocks_total": sum(i.engine.scheduler.kv.num_total for i in instances),
                "kv_blocks_used": sum(i.engine.scheduler.kv.num_used for i in instances),
                "kv_block_size": self.config.block_size, "topology": str(self.deployment.topology),
                "prefix_cache": {"enabled": self.config.enable_prefix_caching,
                                 **{key.removeprefix("prefix_cache_"): stats[key] for key in stats
                                    if key.startswith("prefix_cache_")}},
                "workers": workers}

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache); returns how many blocks the cache named. With a
        server running, call it on its engine thread (POST /reset_prefix_cache does)."""
        return self.deployment.reset_prefix_cache()

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the worker processes (a single in-process worker just drops its arenas with the object)."""
        self.deployment.close()

    def __enter__(self) -> "ElasticModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# transformers' from_pretrained keywords elastic-hf takes, with what they become; what it does on purpose instead
HF_STYLE_KEYWORDS = ("torch_dtype", "device_map", "token", "low_cpu_mem_usage", "use_safetensors")
_HF_REFUSED = {
    "attn_implementation": "elastic-hf runs its own paged attention, registered with transformers' "
                           "AttentionInterface; the attention implementation is not selectable",
    "quantization_config": "pre-quantized checkpoints (AWQ) are read from their own config.json, and quantizing at "
                           "run time is precision morphing (morph=...)",
}


def hf_style_options(options: dict) -> dict:
    """ElasticModel.from_pretrained's keywords as EngineConfig fields: transformers' spellings mapped (torch_dtype
    -> dtype, device_map -> device, token -> hf_token), those that ask for what elastic-hf does anyway
    (low_cpu_mem_usage, use_safetensors) accepted when true, the rest refused with what is supported."""
    options = dict(options)
    if "torch_dtype" in options:
        if "dtype" in options:
            raise ValueError("give dtype or its alias torch_dtype, not both")
        options["dtype"] = options.pop("torch_dtype")
    if "device_map" in options:
        if "device" in options:
            raise ValueError("give device or device_map, not both")
        options["device"] = _device_of_map(options.pop("device_map"))
    if "token" in options:
        options["hf_token"] = options.pop("token")
    for name in ("low_cpu_mem_usage", "use_safetensors"):
        if name in options and not options.pop(name):
            raise ValueError(f"{name}=False is not supported: elastic-hf always loads safetensors weights "
                             "straight into its weight arena")
    for name, why in _HF_REFUSED.items():
        if name in options:
            raise ValueError(f"{name} is not supported: {why}")
    unknown = sorted(set(options) - set(EngineConfig.field_names()))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; from_pretrained takes the EngineConfig fields "
                         f"({', '.join(EngineConfig.field_names())}) and transformers' "
                         f"{', '.join(HF_STYLE_KEYWORDS)}")
    return options


def _device_of_map(device_map) -> str:
    """transformers' device_map as one device: the whole model on it (a per-module map is model parallelism,
    which is workers= / topology= here)."""
    if isinstance(device_map, str) and device_map == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device_map, str) and (device_map in ("cpu", "cuda") or
                                        (device_map.startswith("cuda:") and device_map[5:].isdigit())):
        return device_map
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return f"cuda:{device_map}"
    raise ValueError(f"device_map={device_map!r} is not supported: give 'auto', 'cpu', 'cuda' or 'cuda:N' (the "
                     "whole model on one device; spread a model over devices with workers= and topology=)")
