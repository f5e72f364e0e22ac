"""The one configuration of elastic-hf, validated at construction (torch-free).

`ElasticModel.from_pretrained(**options)` and `elastic-hf serve` build an `EngineConfig`; the control plane
(schedulers, router, morph controllers), every worker (in-process for one worker, its own process otherwise) and
the server are all built from it. Memory sizes are per worker: a worker's budget is what it may commit in its
arenas (weights + KV cache + the headroom precision morphing keeps free)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

from elastic_hf.topology import parse_topology
from elastic_hf.units import parse_memory_budget

log = logging.getLogger(__name__)

DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16"}   # vLLM's spellings too
GENERATION_CONFIG_MODES = ("auto", "vllm")   # or a directory holding a generation_config.json
TP_POLICIES = ("static", "elastic")
ROUTERS = ("elastic", "least_load", "round_robin")
EXECUTOR_BACKENDS = ("mp", "ray")
RAY_PLACEMENTS = ("pack", "spread")
PACKED_WEIGHTS = ("auto", "on", "off")
MORPH_MODES = ("off", "manual", "accuracy", "default", "performance")   # manual: only forced swaps
CONTROLLER_MODES = ("accuracy", "default", "performance")
MODE_PRECISION = {"accuracy": "w8", "default": "w4", "performance": "w4"}  # what a mode's morphs swap layers to
QUANT_PRECISIONS = ("w8", "w4")
W4_GROUP_SIZES = (32, 64, 128)
DEFAULT_KV_CACHE_MEMORY = 1 << 30   # KV bytes of a worker when no memory budget is given
MAX_WORKERS = 8


@dataclass(slots=True)
class MorphConfig:
    """Precision morphing (MorphServe): which variants every worker keeps in host memory and how it swaps."""
    mode: str = "off"                    # off | manual | accuracy | default | performance
    profile: str | None = None           # LIS profile JSON (`elastic-hf profile`); None: front to back
    precisions: tuple[str, ...] = QUANT_PRECISIONS   # quantized variants kept for every layer
    w4_group_size: int = 64
    calib_path: str | None = None        # calibration text: AWQ scales when given, round-to-nearest otherwise
    calib_samples: int = 4               # windows of calib_seq_len tokens used by the AWQ search
    calib_seq_len: int = 256
    use_cache: bool = True               # cache built variants under the user cache dir
    cache_dir: str | None = None         # default: <user cache>/elastic-hf/morph-variants
    controller: dict = field(default_factory=dict)   # ControllerConfig overrides on top of the mode's preset

    def __post_init__(self):
        if self.mode not in MORPH_MODES:
            raise ValueError(f"morph={self.mode!r} is unknown; allowed: {', '.join(MORPH_MODES)}")
        self.precisions = tuple(self.precisions)
        bad = [p for p in self.precisions if p not in QUANT_PRECISIONS]
        if bad or not self.precisions or len(set(self.precisions)) != len(self.precisions):
            raise ValueError(f"precisions={self.precisions!r}: give distinct names from {QUANT_PRECISIONS}")
        if self.w4_group_size not in W4_GROUP_SIZES:
            raise ValueError(f"w4_group_size={self.w4_group_size} must be one of {W4_GROUP_SIZES}")
        for name in ("profile", "calib_path"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                hint = "; create one with `elastic-hf profile`" if name == "profile" else ""
                raise ValueError(f"{name}={str(path)!r} does not exist{hint}")
        if self.calib_samples < 1 or self.calib_seq_len < 2:
            raise ValueError(f"calib_samples={self.calib_samples} must be >= 1 and calib_seq_len="
                             f"{self.calib_seq_len} >= 2")
        if not isinstance(self.controller, dict):
            raise ValueError(f"controller must be a dict of ControllerConfig overrides, got {self.controller!r}")
        if self.mode in CONTROLLER_MODES:
            precision = self.controller.get("precision", MODE_PRECISION[self.mode])
            if precision not in self.precisions:
                raise ValueError(f"morph={self.mode!r} swaps layers to {precision} but the layer store keeps only "
                                 f"{list(self.precisions)}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def method(self) -> str:
        """How the quantization scales are chosen: AWQ with calibration text, round-to-nearest without."""
        return "awq" if self.calib_path else "rtn"


OVERLOAD_RESPONSES = ("off", "morph", "tp-merge", "drop", "auto")


@dataclass(frozen=True, slots=True)
class OverloadConfig:
    """Which response to KV overload acts and with what hysteresis (engine/overload.py): off (each mechanism as
    configured elsewhere), morph, tp-merge, drop (KunServe parameter dropping) or auto. Overloaded: the KV demand
    (running + queued requests' blocks) / the attached capacity above `trigger` for `hold_steps` steps, or past
    `predict_floor` x `trigger` with the demand `lead_steps` ahead (at its recent growth) above it; a dropped
    or merged layout is restored below `restore_below` of the undropped capacity held for `restore_hold_steps`;
    nothing new starts for `cooldown_steps` after a restore. `exchange` and `lookahead` exist for ablations: a
    drop's KV moves "coordinated" (on a thread of each worker beside the steps, queued requests run meanwhile; while
    a step runs the thread takes at most `exchange_cpu_share` of a core, `exchange_cpu_share_queued` while requests
    queue) or "blocking" (inside the transaction); lookahead micro-batches need a cost profile."""
    mode: str = "off"
    trigger: float = 1.0
    hold_steps: int = 3
    # how far ahead the arbiter projects the demand's growth (about a drop's KV exchange in steps; 0: react to the
    # demand now), and from what share of the trigger on (a slope at low load predicts nothing reliable)
    lead_steps: int = 64
    predict_floor: float = 0.8
    restore_below: float = 0.5       # KunServe §4.4
    restore_hold_steps: int = 32
    cooldown_steps: int = 64
    exchange: str = "coordinated"
    exchange_cpu_share: float = 0.25   # on a 2-core CPU: steps ~1.2x during the exchange (kv_exchange.py)
    # None: exchange_cpu_share; 1 ends it sooner at the steps' cost (2-core CPU: no better, benchmarks/RESULTS.md)
    exchange_cpu_share_queued: float | None = None
    lookahead: bool = True

    def __post_init__(self):
        if self.mode not in OVERLOAD_RESPONSES:
            raise ValueError(f"overload={self.mode!r} is unknown; allowed: {', '.join(OVERLOAD_RESPONSES)}")
        if not self.trigger > 0 or not 0 < self.restore_below < self.trigger:
            raise ValueError(f"need trigger > 0 and 0 < restore_below < trigger, got trigger={self.trigger} "
                             f"restore_below={self.restore_below}")
        if not 0 < self.predict_floor <= 1:
            raise ValueError(f"predict_floor must be in (0, 1], got {self.predict_floor}")
        for name in ("hold_steps", "lead_steps", "restore_hold_steps", "cooldown_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.exchange not in ("coordinated", "blocking"):
            raise ValueError(f"exchange must be 'coordinated' or 'blocking', got {self.exchange!r}")
        queued = self.exchange_cpu_share if self.exchange_cpu_share_queued is None else self.exchange_cpu_share_queued
        for name, value in (("exchange_cpu_share", self.exchange_cpu_share), ("exchange_cpu_share_queued", queued)):
            if not (isinstance(value, (int, float)) and 0 < value <= 1):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")


PREFIX_CACHING_HASH_ALGOS = ("sha256", "builtin")   # kv/prefix_cache.py


@dataclass(slots=True)
class EngineConfig:
    # checkpoint dir, .gguf file or Hub repo id ("org/name", model/hub.py); None: the embedded SmolLM2-135M-Instruct
    model: str | None = None
    revision: str | None = None          # Hub branch, tag or commit of `model` (default: main)
    tokenizer: str | None = None         # tokenizer dir or Hub repo id; None: the model's own
    download_dir: str | None = None      # Hub cache directory; None: huggingface_hub's (HF_HOME / HF_HUB_CACHE)
    hf_token: str | bool | None = None   # Hub token; None: huggingface_hub's (HF_TOKEN or `hf auth login`)
    # Run Python code shipped in the model repo (its own config/modeling/tokenizer classes, `auto_map`). Off:
    # only transformers' own classes load; a repo that needs its code is refused with transformers' message.
    trust_remote_code: bool = False
    # Default sampling values of requests that set none (vLLM's --generation-config): auto: the model's
    # generation_config.json (temperature, top_p, top_k, repetition_penalty, max_new_tokens); vllm: the engine's
    # own; or a directory holding a generation_config.json
    generation_config: str = "auto"
    # float32 | bfloat16 | float16 (aliases fp32, float, bf16, fp16, half, torch dtypes) | auto: the checkpoint's
    # dtype (model/loader.py says what auto means for each source; resolved when the model is resolved)
    dtype: str = "auto"
    device: str = "cpu"                  # cpu | cuda (worker i of a deployment uses cuda:i)
    # CUDA: decode-only steps replay captured CUDA graphs (model/cuda_graphs.py) unless this is set (vLLM's name).
    # Graphs run for single-worker deployments; worker processes step eagerly.
    enforce_eager: bool = False
    # -- memory, per worker
    memory_budget: int | float | str | None = None   # bytes, "2GiB", or a fraction of the device ("0.5")
    kv_cache_memory: int | str | None = None         # KV bytes when memory_budget is None (default 1 GiB)
    page_size: int | None = None         # arena page; None: the backend's (OS page on CPU, 2 MiB on CUDA)
    # CPU linears on oneDNN prepacked weights (layers/packed_linear.py); on CUDA each layer's q/k/v and gate/up as
    # one GEMM over their stacked weights (layers/stacked_linear.py): auto | on | off. auto: on where it can be
    # (CUDA: one worker, no morphing; CPU shards and morphing layers: packed in their own arena bytes).
    packed_weights: str = "auto"
    # Llama-formula decoder layers (Llama, Qwen2, Mistral) run as one flat forward of ours on HF's own modules
    # (layers/fused_decoder_layer.py): auto, on the CPU; on: on every device (CUDA: eager steps and captures);
    # off: HF's forward everywhere
    fused_layers: str = "auto"
    block_size: int = 16                 # tokens per KV block
    # Automatic prefix caching (kv/prefix_cache.py, vLLM's APC): computed full blocks are found again by later
    # prompts with the same prefix. The hash: sha256 (vLLM's default) or builtin (Python's, faster, 64 bits).
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # -- scheduling, per instance
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None     # None: what the model and the largest reachable KV cache allow, <= 8192
    # Batches a pipelined instance keeps in flight (cross-step pipelining, engine/batch_queue.py): stage s runs batch
    # t+1 while stage s+1 finishes t. None: one per stage; 1: every step drains the pipe (micro-batches only)
    pipeline_batches: int | None = None
    # -- request limits: every stop string is checked at every step of its request
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_queued_requests: int = 1024      # waiting sequences beyond which new requests are refused (HTTP 503)
    max_stop_token_ids: int = 1024       # stop_token_ids one request may give
    max_request_output_cost: int = 1 << 22   # n x max_tokens x (1 + logprobs): what a request may make us produce
    # -- deployment
    num_workers: int = 1                 # 1: one worker driven in-process; more: worker processes (torch.distributed)
    # Instances over consecutive workers: a TP degree, or "TPxPP" (optionally ":16/14" layers per stage) each, e.g.
    # (2, 1), "1x2,1" or ("1x2:16/14",); None: all TP1. Normalised to Topology.sizes.
    topology: tuple | str | None = None
    tp_policy: str = "static"            # elastic: merge instances for long requests, split back (Gyges §5)
    router: str | None = None            # elastic | least_load | round_robin; None: elastic iff tp_policy elastic
    rebalance_queues: bool = True        # unstarted requests move to a queue that starts them sooner (rebalance.py)
    scale_down_load: float = 0.5         # split a merged instance once no long request remains and load is below
    threads_per_worker: int | None = None   # torch threads of a worker process; None: cores / workers
    start_timeout_s: float = 300.0       # how long worker processes may take to load
    # A worker process that has not answered a step after this many seconds (+ 50 ms a token) counts as hung: it
    # is ended and replaced, its instance's requests recomputed. None: wait forever.
    step_timeout_s: float | None = 120.0
    # "package.module.ClassName" mixed into every worker's class (vLLM's --worker-extension-cls): methods it adds
    # are RPC targets of Deployment.collective_rpc / the executor; tests use it for fault drills
    worker_extension_cls: str | None = None
    # Where worker processes run (vLLM's --distributed-executor-backend): mp, processes of this host; ray, Ray actors
    # on the nodes of a Ray cluster (parallel/ray_executor.py; pip install 'elastic-hf[ray]')
    distributed_executor_backend: str = "mp"
    ray_address: str | None = None       # Ray cluster to join ("auto", "host:6379"); None: RAY_ADDRESS or a local one
    # pack: each instance of the starting topology on one node (STRICT_PACK); spread: workers over the nodes
    ray_placement: str = "pack"
    # -- precision morphing
    morph: MorphConfig = field(default_factory=MorphConfig)
    # -- overload: which response acts when the KV demand exceeds the capacity (engine/overload.py): off (each
    # mechanism as configured above), morph, tp-merge, drop (KunServe parameter dropping) or auto
    overload: OverloadConfig = field(default_factory=OverloadConfig)   # or its mode as a string
    cost_profile: str | None = None      # `elastic-hf profile-cost` JSON: layer splits and lookahead micro-batches
    # -- serving
    seed: int | None = None              # seeds requests that bring none, in order of acceptance (vLLM's --seed)
    chat_template: str | None = None     # Jinja text or a file holding it (see load_chat_template); None: the model's
    # A JSON-lines file that gets a record per engine step and per finished request (engine/timeline.py): where a
    # request's latency went under load. None: not written.
    timeline: str | None = None

    def __post_init__(self):
        if not isinstance(self.device, str):
            self.device = str(self.device)
        self.dtype = _canonical_dtype(self.dtype, self.device)
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.memory_budget is not None:
            # Fractions need the device's size: checked when the worker starts; the syntax is checked now.
            parse_memory_budget(self.memory_budget, 1 << 62)
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_memory_budget(self.kv_cache_memory, None)
        if self.page_size is not None and (self.page_size < 1 or self.page_size & (self.page_size - 1)):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.pipeline_batches is not None and self.pipeline_batches < 1:
            raise ValueError(f"pipeline_batches must be >= 1 (or None: one per pipeline stage), got "
                             f"{self.pipeline_batches}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("max_stop_strings", "max_stop_string_chars", "max_queued_requests", "max_stop_token_ids",
                     "max_request_output_cost"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if not 1 <= self.num_workers <= MAX_WORKERS:
            raise ValueError(f"num_workers must be in [1, {MAX_WORKERS}], got {self.num_workers}")
        topology = parse_topology((1,) * self.num_workers if self.topology is None else self.topology)
        if topology.num_workers > self.num_workers:
            raise ValueError(f"topology {topology} covers {topology.num_workers} workers; it may cover at most "
                             f"num_workers={self.num_workers} (the rest wait in standby)")
        self.topology = topology.sizes
        if self.tp_policy not in TP_POLICIES:
            raise ValueError(f"tp_policy must be one of {TP_POLICIES}, got {self.tp_policy!r}")
        if self.router is None:
            self.router = "elastic" if self.tp_policy == "elastic" else "least_load"
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")
        if not 0.0 < self.scale_down_load <= 1.0:
            raise ValueError(f"scale_down_load must be in (0, 1], got {self.scale_down_load}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1, got {self.threads_per_worker}")
        if self.start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s}")
        if self.step_timeout_s is not None and not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0 seconds (or None), got {self.step_timeout_s}")
        if self.worker_extension_cls is not None and (not isinstance(self.worker_extension_cls, str)
                                                      or "." not in self.worker_extension_cls.strip(".")):
            raise ValueError(f"worker_extension_cls must name a class as 'package.module.ClassName', got "
                             f"{self.worker_extension_cls!r}")
        self._check_executor()
        if isinstance(self.morph, str):
            self.morph = MorphConfig(mode=self.morph)
        elif isinstance(self.morph, dict):
            self.morph = MorphConfig(**self.morph)
        self._check_overload()
        self._check_packed_weights()
        if self.fused_layers not in ("auto", "on", "off"):
            raise ValueError(f"fused_layers must be 'auto', 'on' or 'off', got {self.fused_layers!r}")
        if self.prefix_caching_hash_algo not in PREFIX_CACHING_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {PREFIX_CACHING_HASH_ALGOS}, got "
                             f"{self.prefix_caching_hash_algo!r}")
        if self.generation_config not in GENERATION_CONFIG_MODES and not Path(self.generation_config).is_dir():
            raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_MODES} or a directory holding "
                             f"generation_config.json, got {self.generation_config!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.chat_template is not None:
            load_chat_template(self.chat_template)   # a missing file fails here, before any model loads

    def _check_overload(self) -> None:
        if isinstance(self.overload, str):
            self.overload = OverloadConfig(mode=self.overload)
        elif isinstance(self.overload, dict):
            self.overload = OverloadConfig(**self.overload)
        mode = self.overload.mode
        if mode in ("tp-merge", "drop") and self.num_workers < 2:
            raise ValueError(f"overload={mode!r} reshapes several workers; num_workers is {self.num_workers}")
        if mode == "morph" and self.morph.mode in ("off", "manual"):
            raise ValueError(f"overload='morph' needs a morph mode with a controller (accuracy, default or "
                             f"performance), got morph={self.morph.mode!r}")
        if self.cost_profile is not None and not Path(self.cost_profile).is_file():
            raise ValueError(f"cost_profile={self.cost_profile!r} does not exist; create one with "
                             f"`elastic-hf profile-cost`")

    def _check_executor(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got "
                             f"{self.distributed_executor_backend!r}")
        if self.ray_placement not in RAY_PLACEMENTS:
            raise ValueError(f"ray_placement must be one of {RAY_PLACEMENTS}, got {self.ray_placement!r}")
        if self.distributed_executor_backend != "ray" and self.ray_address is not None:
            raise ValueError(f"ray_address={self.ray_address!r} needs distributed_executor_backend='ray'")

    def _check_packed_weights(self) -> None:
        if self.packed_weights not in PACKED_WEIGHTS:
            raise ValueError(f"packed_weights must be one of {PACKED_WEIGHTS}, got {self.packed_weights!r}")
        if self.packed_weights == "on" and self.packed_weights_blocker() is not None:
            raise ValueError(f"packed_weights='on' needs weights that never change after load: "
                             f"{self.packed_weights_blocker()}")

    def packed_weights_blocker(self) -> str | None:
        """Why this deployment cannot pack its linears' weights, or None when it can."""
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            return f"device is {self.device!r} (packing is for CPU oneDNN kernels, stacking for CUDA)"
        if self.device.split(":")[0] != "cpu" and self.num_workers != 1:   # the CPU packs shard chunks in place
            return f"num_workers is {self.num_workers} on {self.device} (reshapes re-cut TP shards and stages)"
        if self.morph.enabled and self.device.split(":")[0] != "cpu":   # the CPU packs them in the arena
            return f"morph={self.morph.mode!r} on {self.device} (precision morphing swaps the weights)"
        return None

    @property
    def packs_weights(self) -> bool:
        """Whether workers pack their linears (still subject to oneDNN being there: packing_available)."""
        return self.packed_weights != "off" and self.packed_weights_blocker() is None

    @property
    def kv_bytes_per_worker(self) -> int:
        """KV bytes of a worker as a TP1 instance when no memory budget is given."""
        return self.kv_cache_memory if self.kv_cache_memory is not None else DEFAULT_KV_CACHE_MEMORY

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _canonical_dtype(dtype, device: str) -> str:
    """A dtype's canonical name, or "auto" (resolved with the model: model/loader.resolve_model)."""
    if dtype is None or dtype == "auto":
        return "auto"
    if not isinstance(dtype, str):  # a torch.dtype, without importing torch here
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {sorted(DTYPES) + ['auto']}")
    return DTYPES[dtype]


def auto_dtype(device: str, cpu_flags: set[str] | None = None) -> tuple[str, str]:
    """What dtype="auto" means where the weights have no float dtype of their own (a GGUF file), and why: bfloat16
    on CUDA GPUs and on CPUs with native bf16 arithmetic
    (AVX512-BF16 or AMX-BF16), float32 elsewhere, where bf16 matmuls are emulated and slower than fp32 ones.
    cpu_flags: the CPU's feature flags (default: read from /proc/cpuinfo)."""
    if device.split(":")[0] == "cuda":
        return "bfloat16", "CUDA device"
    flags = read_cpu_flags() if cpu_flags is None else cpu_flags
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return "bfloat16", f"CPU has {' and '.join(native)}"
    return "float32", "CPU without avx512_bf16 / amx_bf16"


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The feature flags of the first CPU in a Linux cpuinfo file; empty elsewhere (fp32 is then the safe choice)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def load_chat_template(value: str) -> str:
    """vLLM's reading of --chat-template: a file that opens is read; otherwise a value with Jinja characters is the
    template itself (its backslash escapes such as \\n decoded, as vLLM does), anything else a path that failed."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as exc:   # ValueError: a NUL character, which no path holds
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"chat_template={value!r} looks like a file path but cannot be read: "
                             f"{getattr(exc, 'strerror', None) or exc}") from None
    # latin-1 + backslashreplace keeps every non-ASCII character intact through unicode_escape
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
