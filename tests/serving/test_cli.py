"""`elastic-hf --help` and `elastic-hf serve --help` explain every flag; `elastic-hf serve` really serves,
on loopback by default, with the API key enforced, and exits cleanly on SIGINT."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import httpx

from serving_helpers import free_port, wait_until_healthy

SERVE_FLAGS = ["--host", "--port", "--memory-budget", "--max-model-len", "--dtype", "--api-key", "--max-num-seqs",
               "--max-num-batched-tokens", "--log-level", "--served-model-name", "--max-body-bytes", "--admin-key",
               "--workers", "--tp", "--tp-policy", "--router", "--kv-cache-memory", "--morph", "--morph-profile",
               "--topology", "--tensor-parallel-size", "--kv-cache-memory-bytes", "--gpu-memory-utilization",
               "--block-size", "--max-stop-strings", "--max-stop-string-chars", "--seed", "--chat-template",
               "--shutdown-timeout", "--request-timeout", "--device", "--enforce-eager", "--enable-prefix-caching",
               "--no-enable-prefix-caching", "--prefix-caching-hash-algo", "--enable-auto-tool-choice",
               "--tool-call-parser", "--reasoning-parser", "--distributed-executor-backend", "--ray-address",
               "--ray-placement", "--pipeline-batches", "--timeline", "--fused-layers", "--no-rebalance-queues"]


def _cli() -> list[str]:
    script = shutil.which("elastic-hf", path=os.path.dirname(sys.executable))
    return [script] if script else [sys.executable, "-m", "elastic_hf.serving.cli"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(_cli() + list(args), capture_output=True, text=True, timeout=120)


def test_top_level_help_lists_subcommands():
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert "serve" in result.stdout and "SmolLM2-135M-Instruct" in result.stdout


def test_serve_help_explains_every_flag():
    result = _run("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for flag in SERVE_FLAGS:
        assert flag in text, flag
    assert "MODEL" in text and "127.0.0.1" in text
    assert "(default: None)" not in text, "a flag's help does not say what its default means"
    # every option line carries help text (argparse prints a bare flag when help is missing)
    from elastic_hf.serving import serve_cmd
    import argparse
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            address = sock.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def start_cli_server(args: list[str], env: dict, timeout_s: float = 180) -> tuple[subprocess.Popen, str]:
    """`elastic-hf serve ARGS --port P` as a subprocess, returned once /health answers."""
    port = free_port()
    proc = subprocess.Popen(_cli() + ["serve", *args, "--port", str(port)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    # the output is read only once the server has exited (a live pipe's read would block)
    wait_until_healthy(proc, base, timeout_s, output=lambda: proc.stdout.read() if proc.poll() is not None else "")
    return proc, base


def stop_cli_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_serve_runs_on_loopback_with_api_key(serving_checkpoint):
    env = {**os.environ, "ELASTIC_HF_API_KEY": "cli-key"}
    proc, base = start_cli_server([serving_checkpoint, "--memory-budget", "96MiB", "--max-model-len", "256",
                                   "--max-num-seqs", "8", "--log-level", "warning"], env)
    port = int(base.rsplit(":", 1)[1])
    try:
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        models = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer cli-key"}, timeout=10).json()
        assert models["data"][0]["max_model_len"] == 256
        resp = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer cli-key"}, timeout=60,
                          json={"model": models["data"][0]["id"], "prompt": "Hello", "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
        other = _non_loopback_address()
        if other is not None:  # default --host must not listen on the machine's other interfaces
            try:
                with socket.create_connection((other, port), timeout=2):
                    raise AssertionError(f"server reachable on {other}: it must bind 127.0.0.1 by default")
            except OSError:
                pass
    finally:
        stop_cli_server(proc)
    assert proc.returncode == 0, proc.stdout.read()


def test_serve_bad_flag_value_is_a_message_not_a_traceback(serving_checkpoint):
    result = _run("serve", serving_checkpoint, "--max-model-len", "99999999", "--memory-budget", "96MiB")
    assert result.returncode != 0
    assert "max_model_len" in result.stderr and "Traceback" not in result.stderr
