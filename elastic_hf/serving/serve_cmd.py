"""Run the OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions with SSE streaming,
/health, /metrics) on one elastic-hf engine. With no MODEL it serves the embedded SmolLM2-135M-Instruct.
It binds 127.0.0.1 unless --host says otherwise; use --api-key before exposing it to a network."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from elastic_hf.config import PREFIX_CACHING_HASH_ALGOS
from elastic_hf.serving.drain import DEFAULT_SHUTDOWN_TIMEOUT_S, Drain, DrainingServer
from elastic_hf.serving.reasoning_parsers import REASONING_PARSERS
from elastic_hf.serving.tool_parsers import TOOL_PARSERS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
# Appended to help texts that explain their own default: the empty format keeps argparse's
# ArgumentDefaultsHelpFormatter from adding a misleading "(default: None)".
_OWN_DEFAULT = "%(default).0s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="Hugging Face Hub repo id ('org/name': from the HF cache, downloaded when missing and "
                             "the Hub is reachable), local checkpoint directory or .gguf file; omit for the "
                             "embedded SmolLM2-135M-Instruct" + _OWN_DEFAULT)
    parser.add_argument("--revision", default=None,
                        help="Hub branch, tag or commit of MODEL (default: main)" + _OWN_DEFAULT)
    parser.add_argument("--download-dir", default=None,
                        help="Hub cache directory to read and download into (default: huggingface_hub's, "
                             "$HF_HUB_CACHE or $HF_HOME/hub)" + _OWN_DEFAULT)
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer directory or Hub repo id (default: MODEL's own)" + _OWN_DEFAULT)
    parser.add_argument("--hf-token", default=None,
                        help="Hub token for gated or private repos (default: $HF_TOKEN or `hf auth login`'s)"
                        + _OWN_DEFAULT)
    parser.add_argument("--trust-remote-code", action="store_true", default=None,
                        help="run Python code shipped in the model repo (its own config, modeling and tokenizer "
                             "classes); off: only transformers' own classes load, and a repo that needs its code is "
                             "refused (default: off)" + _OWN_DEFAULT)
    parser.add_argument("--generation-config", default=None,
                        help="default sampling values of requests that set none: auto = the model's "
                             "generation_config.json, vllm = the engine's own, or a directory holding a "
                             "generation_config.json (default: auto)" + _OWN_DEFAULT)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind; the loopback default keeps the server private to this machine")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="model name(s) clients send in 'model' and see in /v1/models; the first one in "
                             "/health and the metrics (default: the repo id or directory name)" + _OWN_DEFAULT)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vLLM's name for a --memory-budget given as a fraction of the device, e.g. 0.9 "
                             "(default: unset)" + _OWN_DEFAULT)
    parser.add_argument("--memory-budget", default=None,
                        help="cap on committed bytes per worker for weights + KV cache: bytes, a size like '2GiB', "
                             "or a fraction of the device like '0.5' (default: weights + --kv-cache-memory)"
                        + _OWN_DEFAULT)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion in tokens (default: what the model and KV cache allow, "
                             "at most 8192)" + _OWN_DEFAULT)
    parser.add_argument("--dtype", default=None,
                        choices=("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"),
                        help="weight and KV dtype; auto: the checkpoint's (float16 runs as bfloat16 on a CPU), for "
                             "a .gguf file bfloat16 on CUDA and on CPUs with avx512_bf16 or amx_bf16, float32 "
                             "otherwise (default: auto)" + _OWN_DEFAULT)
    parser.add_argument("--device", default=None, choices=("cpu", "cuda"),
                        help="where the model runs; cuda: worker i on GPU i (default: cpu)" + _OWN_DEFAULT)
    parser.add_argument("--enforce-eager", action="store_true", default=None,
                        help="on CUDA, run every step eagerly instead of replaying captured decode graphs "
                             "(default: off)" + _OWN_DEFAULT)
    parser.add_argument("--fused-layers", default=None, choices=("auto", "on", "off"),
                        help="auto: Llama/Qwen2/Mistral decoder layers run one flat forward of ours on HF's modules "
                             "(CPU); on: on every device (CUDA too); off: HF's own forward (default: auto)" + _OWN_DEFAULT)
    parser.add_argument("--packed-weights", default=None, choices=("auto", "on", "off"),
                        help="CPU linears on oneDNN prepacked weights (same memory, bf16 bit-identical, ~1.2x "
                             "throughput on the default model); on CUDA, q/k/v and gate/up as one GEMM each over "
                             "their stacked weights (no copy); auto: on wherever it can be (CUDA: one worker "
                             "without --morph; CPU: morphing layers and multi-worker shards are packed in their own "
                             "arena bytes) (default: auto)" + _OWN_DEFAULT)
    parser.add_argument("--seed", type=int, default=None,
                        help="seed the requests that bring no 'seed' of their own, in the order they are accepted, so "
                             "the same requests to a restarted server sample the same outputs (default: random)"
                        + _OWN_DEFAULT)
    parser.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                        help="Jinja chat template, as a file path or inline, replacing the model's for "
                             "/v1/chat/completions (default: the tokenizer's)" + _OWN_DEFAULT)
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='serve tool_choice "auto": the model decides whether to call a tool, and its output is '
                             'read with --tool-call-parser (required and named tool choices work without it)')
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how the model writes tool calls: hermes (<tool_call> JSON: Qwen, Hermes), llama3_json, "
                             "pythonic (default: none, auto tool choice off)" + _OWN_DEFAULT)
    parser.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="move a thinking model's <think>...</think> part to reasoning_content: deepseek_r1 (the "
                             "template opens <think>), qwen3 (the model opens it, or skips it) (default: none, the "
                             "output stays content)" + _OWN_DEFAULT)
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="most sequences in one running batch (default: engine default, 64)" + _OWN_DEFAULT)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="token budget of one step; longer prompts are prefilled in chunks "
                             "(default: engine default, 512)" + _OWN_DEFAULT)
    parser.add_argument("--pipeline-batches", type=int, default=None,
                        help="batches a pipelined instance keeps in flight: stage s runs batch t+1 while stage s+1 "
                             "finishes t (cross-step pipelining); 1 drains the pipe at every step (default: one "
                             "per pipeline stage)" + _OWN_DEFAULT)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer <key>' on every /v1 route "
                             "(default: $ELASTIC_HF_API_KEY; unset = no auth)" + _OWN_DEFAULT)
    parser.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                        help="Host header values the server answers, e.g. localhost 127.0.0.1 (others get 400: "
                             "against DNS rebinding from a browser; default: any)" + _OWN_DEFAULT)
    parser.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="browser origins allowed to read responses (CORS), e.g. https://app.example.com "
                             "(default: none)" + _OWN_DEFAULT)
    parser.add_argument("--enable-docs", action="store_true",
                        help="serve /docs, /redoc and /openapi.json (the OpenAPI document describes every request "
                             "body)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="largest accepted request body in bytes; larger bodies get HTTP 413")
    parser.add_argument("--morph", default="off", choices=("off", "manual", "accuracy", "default", "performance"),
                        help="precision morphing: swap decoder layers to INT8/INT4 under KV pressure and give the "
                             "freed memory to the KV cache, back to full precision when load falls (MorphServe); "
                             "every TP-1 instance's worker morphs its own layers; manual = only through "
                             "POST /admin/morph")
    parser.add_argument("--morph-profile", dest="profile", default=None,
                        help="LIS profile JSON from `elastic-hf profile` giving the swap order "
                             "(default: front to back)" + _OWN_DEFAULT)
    parser.add_argument("--profile", dest="deprecated_profile", default=None, metavar="MORPH_PROFILE",
                        help="deprecated alias of --morph-profile (vLLM's --profile means the torch profiler)"
                        + _OWN_DEFAULT)
    parser.add_argument("--admin-key", default=None,
                        help="bearer key of the /admin routes (/admin/morph, /admin/reshape, /admin/drop); without it they answer "
                             "403 "
                             "(default: $ELASTIC_HF_ADMIN_KEY)" + _OWN_DEFAULT)
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes; more than 1 starts a torch.distributed deployment whose instances "
                             "can change tensor-parallel degree at runtime (POST /admin/reshape)")
    parser.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="initial tensor-parallel degree of each instance (workers / tp instances)")
    parser.add_argument("--topology", default=None,
                        help="initial layout instead of --tp: instances over consecutive workers, each a TP degree or "
                             "TPxPP with optional layers per stage, e.g. '1x2,1' or '1x2:16/14' (see /admin/topology; "
                             "default: workers / --tp instances of TP --tp)" + _OWN_DEFAULT)
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray"), default=None,
                        help="where the workers run: mp, processes of this host; ray, Ray actors on the nodes of a "
                             "Ray cluster (pip install 'elastic-hf[ray]'; see README 'Across machines') (default: "
                             "mp)" + _OWN_DEFAULT)
    parser.add_argument("--ray-address", default=None,
                        help="Ray cluster to join with --distributed-executor-backend ray, e.g. 'auto' or "
                             "'10.0.0.1:6379' (default: RAY_ADDRESS, else a local Ray started for this server)"
                        + _OWN_DEFAULT)
    parser.add_argument("--ray-placement", choices=("pack", "spread"), default=None,
                        help="pack: the workers of each starting instance on one node (STRICT_PACK placement "
                             "group); spread: the workers over the nodes (default: pack)" + _OWN_DEFAULT)
    parser.add_argument("--tp-policy", default="static", choices=("static", "elastic"),
                        help="elastic: merge instances x2 when a request needs more KV than one holds, split "
                             "back when no long request remains and load < 50%% (Gyges); static: never reshape "
                             "on its own")
    parser.add_argument("--router", default=None, choices=("elastic", "least_load", "round_robin"),
                        help="how requests pick an instance (default: elastic with --tp-policy elastic, "
                             "least_load otherwise)" + _OWN_DEFAULT)
    parser.add_argument("--no-rebalance-queues", dest="rebalance_queues", action="store_false",
                        help="keep every request on the instance routing picked on arrival (default: a request "
                             "that has not started moves to an instance that would start it more than a step "
                             "sooner)")
    parser.add_argument("--overload", default="off", choices=("off", "morph", "tp-merge", "drop", "auto"),
                        help="the one response to KV overload (demand above capacity): morph (precision "
                             "morphing, needs --morph), tp-merge (merge instances into TP2), drop (KunServe: "
                             "drop replicated layers and serve as a pipeline), auto (morph when it covers the "
                             "deficit, else drop, else merge); off: each mechanism as configured by its own flags")
    parser.add_argument("--cost-profile", default=None,
                        help="cost model JSON from `elastic-hf profile-cost`: layer splits of drop groups and "
                             "lookahead micro-batches while overloaded (without it: weight bytes split the layers, "
                             "token counts split micro-batches)")
    parser.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory", default=None,
                        help="KV bytes per worker when --memory-budget is not given, e.g. '256MiB' "
                             "(default: 1 GiB)" + _OWN_DEFAULT)
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per KV block, a power of two (default: engine default, 16)" + _OWN_DEFAULT)
    parser.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None,
                        help="reuse the KV of prompt prefixes computed before (vLLM's automatic prefix caching; on "
                             "unless --no-enable-prefix-caching)" + _OWN_DEFAULT)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        default=None, help="compute every prompt in full (no prefix cache)" + _OWN_DEFAULT)
    parser.add_argument("--prefix-caching-hash-algo", default=None, choices=PREFIX_CACHING_HASH_ALGOS,
                        help="hash naming a cached KV block: sha256 (default, as vLLM) or builtin (Python's hash: "
                             "faster, 64 bits)" + _OWN_DEFAULT)
    parser.add_argument("--max-stop-strings", type=int, default=None,
                        help="most stop strings one request may give; more is a 400 (default: engine default, 64)"
                        + _OWN_DEFAULT)
    parser.add_argument("--max-stop-string-chars", type=int, default=None,
                        help="longest stop string in characters; longer is a 400 (default: engine default, 1024)"
                        + _OWN_DEFAULT)
    parser.add_argument("--max-stop-token-ids", type=int, default=None,
                        help="most stop_token_ids one request may give; more is a 400 (default: engine default, "
                             "1024)" + _OWN_DEFAULT)
    parser.add_argument("--max-request-output-cost", type=int, default=None,
                        help="largest n x max_tokens x (1 + logprobs) of one request; more is a 400 (default: "
                             "engine default, 4194304)" + _OWN_DEFAULT)
    parser.add_argument("--step-timeout", dest="step_timeout_s", type=float, default=None,
                        help="seconds (+ 50 ms a token) after which a worker process that has not answered a step "
                             "counts as hung: it is ended and replaced and its instance's requests recomputed "
                             "(default: engine default, 120)" + _OWN_DEFAULT)
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="queued sequences beyond which new requests get HTTP 503 with Retry-After, so an "
                             "overload never exhausts memory (default: engine default, 1024)" + _OWN_DEFAULT)
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds the requests in flight get to finish after SIGTERM/SIGINT; meanwhile new "
                             "requests get HTTP 503 with Retry-After and /health answers 503 'draining', afterwards "
                             "the rest end with an error; a second signal exits at once")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds after its arrival at which a request still running is aborted and its KV "
                             "cache freed: HTTP 504 with code 'request_timeout', or an SSE error event for a stream "
                             "(default: no limit)" + _OWN_DEFAULT)
    parser.add_argument("--timeline", default=None, metavar="PATH",
                        help="append a JSON line per engine step and per finished request to PATH (arrival, "
                             "admission, first token, finish; each step's prefill/decode mix and duration): where "
                             "latency goes under load, read by benchmarks/serving_timeline.py (default: off)"
                             + _OWN_DEFAULT)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="log level of server and engine")


def engine_config(args: argparse.Namespace):
    """The one EngineConfig of the server from its flags (unset flags keep the config's defaults)."""
    from elastic_hf.config import EngineConfig, MorphConfig

    if args.topology is not None and args.tp != 1:
        raise ValueError("give either --tp or --topology, not both")
    if args.tp < 1 or args.workers % args.tp:
        raise ValueError(f"--tp must divide --workers: {args.tp} does not divide {args.workers}")
    topology = args.topology if args.topology is not None else (args.tp,) * (args.workers // args.tp)
    if args.gpu_memory_utilization is not None:
        if args.memory_budget is not None:
            raise ValueError("give either --memory-budget or --gpu-memory-utilization, not both")
        if not 0.0 < args.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}")
        args.memory_budget = str(args.gpu_memory_utilization)
    if args.deprecated_profile is not None:
        if args.profile is not None:
            raise ValueError("give --morph-profile alone: --profile is its deprecated alias")
        # printed, not logged: it must show whatever --log-level says
        print(f"elastic-hf serve: warning: --profile is deprecated (vLLM's --profile is the torch profiler); use "
              f"--morph-profile {args.deprecated_profile}", file=sys.stderr)
        args.profile = args.deprecated_profile
    options = {name: getattr(args, name) for name in ("dtype", "seed", "chat_template", "max_num_seqs",
                                                       "max_num_batched_tokens", "pipeline_batches", "memory_budget",
                                                       "kv_cache_memory",
                                                       "max_model_len", "router", "rebalance_queues", "block_size",
                                                       "max_stop_strings",
                                                       "max_stop_string_chars", "max_queued_requests",
                                                       "overload", "cost_profile", "packed_weights", "device",
                                                       "enforce_eager", "enable_prefix_caching",
                                                       "prefix_caching_hash_algo", "revision", "download_dir",
                                                       "tokenizer", "hf_token", "trust_remote_code",
                                                       "generation_config", "max_stop_token_ids",
                                                       "max_request_output_cost", "step_timeout_s",
                                                       "distributed_executor_backend", "ray_address",
                                                       "ray_placement", "timeline", "fused_layers")
               if getattr(args, name) is not None}
    return EngineConfig(model=args.model, num_workers=args.workers, topology=topology,
                        tp_policy=args.tp_policy, morph=MorphConfig(mode=args.morph, profile=args.profile), **options)


def run(args: argparse.Namespace) -> int:
    """Serve until a signal: 0 after a drain, 1 after a forced exit (a second signal), 2 for bad flag values."""
    import uvicorn

    from elastic_hf.elastic_model import ElasticModel
    from elastic_hf.engine.async_engine import AsyncEngine
    from elastic_hf.serving.admin_morph import admin_morph_router
    from elastic_hf.serving.admin_cache import admin_cache_router
    from elastic_hf.serving.admin_drop import admin_drop_router
    from elastic_hf.serving.admin_reshape import admin_reshape_router
    from elastic_hf.serving.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Keys from the environment stay out of `ps`.
    api_key = args.api_key or os.environ.get("ELASTIC_HF_API_KEY") or None
    admin_key = args.admin_key or os.environ.get("ELASTIC_HF_ADMIN_KEY") or None
    try:
        if args.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout:g}")
        if args.request_timeout is not None and not args.request_timeout > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {args.request_timeout:g}")
        if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
            raise ValueError("--enable-auto-tool-choice and --tool-call-parser go together: give both or neither")
        config = engine_config(args)
        async_engine = AsyncEngine(request_timeout=args.request_timeout)
        # built on the engine thread: the thread that steps the model is the only one with an OpenMP pool
        model = async_engine.start(build=lambda: ElasticModel.from_config(config))
    except (ValueError, OSError) as exc:  # bad flag values or a missing model: a message, not a traceback
        print(f"elastic-hf serve: error: {exc}", file=sys.stderr)
        return 2
    app = build_app(async_engine, api_key=api_key, model_id=args.served_model_name or model.model_id,
                    max_body_bytes=args.max_body_bytes, allowed_hosts=args.allowed_hosts,
                    allowed_origins=args.allowed_origins, enable_docs=args.enable_docs,
                    tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    app.include_router(admin_morph_router(model, async_engine, admin_key))
    app.include_router(admin_reshape_router(model, async_engine, admin_key))
    app.include_router(admin_drop_router(model, async_engine, admin_key))
    app.include_router(admin_cache_router(model, async_engine, admin_key))
    logging.getLogger(__name__).info("serving %s (%s) on http://%s:%d with %d worker(s), topology %s (auth %s, "
                                     "admin %s)", model.model_id, model.config.dtype, args.host, args.port,
                                     args.workers, model.deployment.topology,
                                     "on" if api_key else "off", "on" if admin_key else "off")
    # After the drain only responses that already have their last event are open: a few seconds cover a slow reader.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    server = DrainingServer(config, Drain(async_engine, args.shutdown_timeout))
    try:
        server.run()
    finally:
        async_engine.shutdown()
        model.close()  # stops the worker processes of a deployment
    return 1 if server.forced else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m elastic_hf.serving.serve_cmd ...`: the serve subcommand alone (used by benchmarks/replay.py)."""
    parser = argparse.ArgumentParser(prog="elastic-hf serve", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
