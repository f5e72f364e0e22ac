"""Talk to elastic-hf's OpenAI-compatible server with the official `openai` Python client: a completion, a chat
completion and a streamed chat completion.

By default it starts `elastic-hf serve MODEL --port <free port> --api-key <key>` as a subprocess, waits for
/health, and stops it (SIGINT) at the end. With --base-url it uses a server that is already running:

    .venv/bin/python examples/openai_client.py
    .venv/bin/elastic-hf serve --api-key secret &   # in another shell
    .venv/bin/python examples/openai_client.py --base-url http://127.0.0.1:8000 --api-key secret
"""
import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, port: int, api_key: str, kv_cache_memory: str) -> subprocess.Popen:
    """`elastic-hf serve` in a subprocess (the console script next to this Python, or `python -m`)."""
    script = shutil.which("elastic-hf", path=os.path.dirname(sys.executable))
    cmd = [script] if script else [sys.executable, "-m", "elastic_hf.serving.cli"]
    # --api-key=KEY in one argument: a random url-safe key may start with "-", which argparse would take for a flag
    cmd += ["serve", *([model] if model else []), "--port", str(port), f"--api-key={api_key}",
            "--kv-cache-memory", kv_cache_memory, "--log-level", "warning"]
    print(f"starting: elastic-hf serve {model or '(default model)'} on port {port}")
    return subprocess.Popen(cmd)


class ServerExited(RuntimeError):
    pass


def wait_healthy(base_url: str, server: subprocess.Popen | None, api_key: str | None = None,
                 timeout: float = 300.0) -> None:
    """Poll GET /health (no API key needed) until the model is loaded. With api_key, also wait until
    GET /v1/models accepts it: another program may have taken the port between free_port() and the server's bind,
    and then /health answers but it is not our server (ours exits when its bind fails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise ServerExited(f"the server exited with code {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2):
                pass
            if api_key is not None:
                request = urllib.request.Request(f"{base_url}/v1/models",
                                                 headers={"Authorization": f"Bearer {api_key}"})
                with urllib.request.urlopen(request, timeout=2):
                    pass
            return
        except OSError:        # not listening yet, or an HTTP error (urllib.error.HTTPError is an OSError)
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{base_url} was not ready within {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    server.send_signal(signal.SIGINT)      # like Ctrl-C: uvicorn shuts down cleanly
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    print(f"server stopped (exit code {server.returncode})")


def run_client(base_url: str, api_key: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    model = client.models.list().data[0].id          # the served model name
    print(f"served model: {model}")

    # Completion (greedy: temperature=0; the server otherwise uses OpenAI's default temperature 1.0)
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=max_tokens,
                                           temperature=0)
    print(f"completion: {completion.choices[0].text!r} (finish_reason={completion.choices[0].finish_reason}, "
          f"usage: {completion.usage.prompt_tokens} prompt + {completion.usage.completion_tokens} completion tokens)")

    # Chat completion: the server applies the model's chat template.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    reply = chat.choices[0].message.content
    print(f"chat: {reply!r}")

    # Streamed chat completion: server-sent events, one delta per chunk.
    print("stream: ", end="", flush=True)
    pieces = []
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
    print(f"streamed chat equals chat: {''.join(pieces) == reply} ({len(pieces)} chunks, "
          f"{chunk.usage.completion_tokens} tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="checkpoint dir or .gguf file to serve (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--base-url", default=None,
                        help="use this running server (e.g. http://127.0.0.1:8000) instead of starting one")
    parser.add_argument("--api-key", default=None,
                        help="API key (default: a random one for the server started here; 'none' with --base-url)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per completion")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="KV cache bytes of the server started here")
    args = parser.parse_args()

    if args.base_url:
        base_url = args.base_url.rstrip("/").removesuffix("/v1")
        wait_healthy(base_url, None, timeout=60)
        run_client(base_url, args.api_key or "none", args.max_tokens)
        return

    api_key = args.api_key or secrets.token_urlsafe(16)
    for attempt in range(3):       # a new port if another program took ours before the server could bind it
        port = free_port()
        server = start_server(args.model, port, api_key, args.kv_cache_memory)
        base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(base_url, server, api_key)
            break
        except ServerExited:
            if attempt == 2:
                raise
        except BaseException:
            stop_server(server)
            raise
    try:
        run_client(base_url, api_key, args.max_tokens)
    finally:
        stop_server(server)


if __name__ == "__main__":
    main()
