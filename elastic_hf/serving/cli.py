"""`elastic-hf` command line: one subcommand per module, each exposing add_arguments(parser) and run(args) -> int."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). Modules are imported lazily so `--help` stays fast.
SUBCOMMANDS = {
    "serve": ("elastic_hf.serving.serve_cmd", "run the OpenAI-compatible HTTP server"),
    "profile": ("elastic_hf.profiling.profile_cmd", "offline LIS layer ordering for precision morphing"),
    "profile-cost": ("elastic_hf.profiling.cost_cmd", "offline micro-batch cost model for lookahead pipelining"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-hf",
        description="Serve Hugging Face causal LMs and reshape a live deployment under load. "
                    "With no MODEL every command uses the embedded SmolLM2-135M-Instruct.")
    from elastic_hf import VERSION

    parser.add_argument("--version", action="version", version=f"elastic-hf {VERSION}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            # One broken subcommand (a missing optional package) must not take the others down.
            sub_parser = sub.add_parser(name, help=f"{help_text} (unavailable: {exc})")
            sub_parser.set_defaults(handler=lambda args, exc=exc, name=name: _unavailable(name, exc))
            continue
        sub_parser = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip(),
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(handler=module.run)
    return parser


def _unavailable(name: str, exc: ImportError) -> int:
    print(f"elastic-hf {name} is unavailable: {exc}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
