"""Starts a real `lantern serve` on 127.0.0.1 (a free port) for the whole session.

The binary is $LANTERN_BIN (default: target/release/lantern, built with cargo when
missing). Extra server flags can be given in $LANTERN_SERVE_ARGS. `start_server` starts
more servers with other flags (a small KV cache for the preemption test).
"""

import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "lantern-python-test-key"
START_TIMEOUT_S = 300
LISTENING = re.compile(r"lantern: listening on (http://\S+)")


@dataclass
class Server:
    base_url: str
    api_key: str
    model: str
    context_length: int
    process: subprocess.Popen
    # What the server printed on stdout up to its `listening on` line.
    startup_lines: list = field(default_factory=list)

    def client(self, **kwargs) -> OpenAI:
        kwargs.setdefault("timeout", 120)
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("api_key", self.api_key)
        return OpenAI(base_url=self.base_url + "/v1", **kwargs)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    def metrics(self) -> dict:
        """`/metrics` as {name: value}, labels dropped (one model, so one series each)."""
        text = requests.get(self.base_url + "/metrics", timeout=30).text
        values = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if name.endswith("_bucket"):
                continue
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Waits until no request runs or waits and every KV block is free."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if (
                m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0
                and m["lantern:kv_cache_free_blocks"] == m["lantern:kv_cache_total_blocks"]
            ):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine did not become idle: {m}")
            time.sleep(0.05)


def _binary() -> Path:
    path = Path(os.environ.get("LANTERN_BIN", ROOT / "target" / "release" / "lantern"))
    if not path.exists():
        subprocess.run(
            # The whole workspace, as the other commands build it: `-p` would resolve
            # dependency features differently and rebuild them.
            ["cargo", "build", "--release", "--workspace"], cwd=ROOT, check=True
        )
    if not path.exists():
        raise RuntimeError(f"no lantern binary at {path}; set LANTERN_BIN")
    return path


SERVED_MODEL_NAME = "lantern-test-model"

# One 16-token block of SmolLM2-135M's KV cache in the default f16: 30 layers x (K, V) x
# 3 KV heads x 64 dims x 16 tokens x 2 bytes (360 KiB). Tests that size a pool in blocks
# use it.
SMOLLM2_BLOCK_BYTES = 30 * 2 * 3 * 64 * 16 * 2


def start_server(
    *extra_args: str,
    kv_cache_memory: str = "256M",
    stderr=None,
    served_model_name: "str | None" = SERVED_MODEL_NAME,
    api_key: "str | None" = API_KEY,
) -> Server:
    """Starts `lantern serve` on a free port and waits until it listens. `stderr` (a
    file) receives the server's log, for tests that read it. `served_model_name=None`
    leaves the flag out, so the server names the model itself; `api_key=None` starts it
    without API keys."""
    names = ["--served-model-name", served_model_name] if served_model_name else []
    args = [
        str(_binary()),
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *(["--api-key", api_key] if api_key else []),
        *names,
        "--kv-cache-memory",
        kv_cache_memory,
        *shlex.split(os.environ.get("LANTERN_SERVE_ARGS", "")),
        *extra_args,
    ]
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=ROOT
    )
    lines: "queue.Queue[str | None]" = queue.Queue()

    def pump():
        # Keeps reading stdout so the server never blocks on a full pipe.
        for line in process.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    base_url = None
    startup_lines = []
    deadline = time.monotonic() + START_TIMEOUT_S
    while base_url is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            process.kill()
            raise RuntimeError("lantern serve did not print where it listens in time")
        try:
            line = lines.get(timeout=remaining)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"lantern serve exited early with {process.wait()}")
        startup_lines.append(line)
        match = LISTENING.search(line)
        if match:
            base_url = match.group(1)
    assert base_url.startswith("http://127.0.0.1:"), base_url
    models = requests.get(
        base_url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    ).json()
    card = models["data"][0]
    return Server(
        base_url=base_url,
        # The openai client needs some key; a server without keys ignores it.
        api_key=api_key or "no-key",
        model=card["id"],
        context_length=card["max_model_len"],
        process=process,
        startup_lines=startup_lines,
    )


def stop_server(server: Server) -> None:
    """SIGTERM stops it cleanly: exit code 0 within a few seconds."""
    if server.process.poll() is not None:
        return
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise AssertionError("lantern serve did not stop on SIGTERM")
    assert code == 0, f"lantern serve exited with {code} on SIGTERM"


def tokenize(server, **body):
    """Token ids of `/tokenize` (a `prompt` or chat `messages` with their fields)."""
    r = requests.post(server.base_url + "/tokenize", json=body, headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def detokenize(server, tokens):
    r = requests.post(
        server.base_url + "/detokenize", json={"tokens": tokens}, headers=server.headers(), timeout=30
    )
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def one_token(server, text):
    tokens = tokenize(server, prompt=text, add_special_tokens=False)
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


@pytest.fixture(scope="session")
def server():
    srv = start_server()
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def client(server):
    return server.client()
