"""Load with faults: 64 concurrent streams on a KV cache small enough to force
preemption, some capturing their attention, some dropped by their client part-way
(seeded), malformed requests mixed in. Afterwards nothing runs, every KV block is free,
and every stream that was not dropped produced the greedy text it produces alone."""

import random
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SMOLLM2_BLOCK_BYTES, start_server, stop_server

SEED = 20261123
NUM_STREAMS = 64
NUM_PROMPTS = 16
MAX_TOKENS = 12
# 20 blocks of 16 tokens hold about six of these requests at once, so 64 of them preempt
# each other.
KV_BLOCKS = 20
TIME_LIMIT_S = 90


def prompt(i):
    subjects = ["lighthouse", "river", "market", "mountain", "library", "garden", "harbor", "forest"]
    return f"Story {i}: the {subjects[i % len(subjects)]} was quiet that morning, and " * (1 + i % 2)


# Malformed requests and the field each 400 must name.
MALFORMED = [
    (dict(temperature=-1.0), "temperature"),
    (dict(n=0), "n"),
    (dict(top_p=1.5), "top_p"),
    (dict(extra_body={"attn_capture": True, "attn_capture_layers": [999]}), "attn_capture_layers"),
    (dict(prompt=[10**9]), "prompt"),
    (dict(max_tokens=10**9), "max_tokens"),
    (dict(stop=[3]), "stop"),
    (dict(extra_body={"repetition_penalty": 1e300}), "repetition_penalty"),
]


@pytest.fixture(scope="module")
def load_server():
    srv = start_server("--enable-attention-capture", kv_cache_memory=str(KV_BLOCKS * SMOLLM2_BLOCK_BYTES))
    yield srv
    stop_server(srv)


def stream_text(client, srv, i, capture=False, drop_after=None):
    """Streams prompt `i % NUM_PROMPTS`; returns its text and whether the capture came,
    or None when the client dropped it after `drop_after` chunks."""
    extra = {"ignore_eos": True}
    if capture:
        extra.update(attn_capture=True, attn_capture_layers="0,29", attn_capture_reduce="mean_heads")
    stream = client.completions.create(
        model=srv.model,
        prompt=prompt(i % NUM_PROMPTS),
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    text, captured = [], False
    for n, chunk in enumerate(stream):
        if drop_after is not None and n >= drop_after:
            stream.close()
            return None
        if chunk.choices:
            text.append(chunk.choices[0].text)
        captured = captured or bool(chunk.model_dump().get("attn_capture_data"))
    return "".join(text), captured


def malformed(client, srv, fields):
    body = {**dict(model=srv.model, prompt=prompt(0), max_tokens=4), **fields}
    try:
        client.completions.create(**body)
    except openai.BadRequestError as e:
        return e.status_code, e.body.get("param")
    return 200, None


def test_concurrent_streams_with_drops_captures_preemption_and_bad_requests(load_server):
    srv = load_server
    started = time.monotonic()
    client = srv.client(timeout=TIME_LIMIT_S)
    # Each prompt alone first: the text every undropped stream must reproduce.
    alone = {p: stream_text(client, srv, p)[0] for p in range(NUM_PROMPTS)}
    srv.wait_idle()
    before = srv.metrics()

    rng = random.Random(SEED)
    plan = []
    for i in range(NUM_STREAMS):
        capture = i % 8 == 3
        drop_after = rng.randint(1, MAX_TOKENS - 2) if not capture and rng.random() < 0.25 else None
        plan.append((i, capture, drop_after))
    assert any(d is not None for _, _, d in plan) and any(c for _, c, _ in plan)

    with ThreadPoolExecutor(max_workers=NUM_STREAMS + len(MALFORMED)) as pool:
        streams = [
            pool.submit(stream_text, client, srv, i, capture, drop_after)
            for i, capture, drop_after in plan
        ]
        bad = [pool.submit(malformed, client, srv, fields) for fields, _ in MALFORMED]
        results = [f.result(timeout=TIME_LIMIT_S) for f in streams]
        refusals = [f.result(timeout=TIME_LIMIT_S) for f in bad]

    for (fields, field), (status, param) in zip(MALFORMED, refusals):
        assert (status, param) == (400, field), fields
    for (i, capture, drop_after), result in zip(plan, results):
        if drop_after is not None:
            assert result is None
            continue
        text, captured = result
        assert text == alone[i % NUM_PROMPTS], (i, capture)
        assert captured == capture, i

    after = srv.wait_idle()
    assert after["vllm:num_requests_running"] == 0
    assert after["lantern:kv_cache_free_blocks"] == after["lantern:kv_cache_total_blocks"]
    assert after["vllm:num_preemptions_total"] > before["vllm:num_preemptions_total"]
    assert time.monotonic() - started < TIME_LIMIT_S
