"""Captures under concurrent serving: greedy capturing requests of many kinds (every
layer or a few, top-k, head reductions, key statistics, spans, prompt or generated rows,
float16, streamed or whole) run one at a time, then all at once beside uncapturing
traffic, through a real `lantern serve` and the official openai client. The texts and
every array of every capture (maps, top-k indices, statistics, span masses) must be the
same bits, and so must the live rows of the streams: a row's probabilities do not depend
on what else ran in its steps."""

import random
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from conftest import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

NUM_REQUESTS = 16
NOISE_CLIENTS = 3
WORDS = "alpha beta gamma delta the cat sat on a mat while river moon bread tea".split()


def specs():
    """Distinct capturing requests, the same every run."""
    rng = random.Random(3)
    out = []
    for _ in range(NUM_REQUESTS):
        fields = {
            "attn_capture": True,
            "attn_capture_layers": rng.choice(["all", [0, -1], "2:5", -1]),
        }
        pick = rng.random()
        if pick < 0.2:
            fields["attn_capture_top_k"] = rng.choice([1, 5])
        elif pick < 0.4:
            fields["attn_capture_reduce"] = rng.choice(["mean_heads", "max_heads"])
        if rng.random() < 0.3:
            fields["attn_capture_stats"] = ["key_mass", "key_max", "block_mass"]
        if rng.random() < 0.3:
            fields["attn_capture_spans"] = [
                {"label": "a", "tokens": [0, 4]},
                {"label": "b", "tokens": [4, 9]},
            ]
        if rng.random() < 0.3:
            fields["attn_capture_rows"] = rng.choice(["prompt", "generated"])
        if rng.random() < 0.3:
            fields["attn_capture_heads"] = "0:3"
        if rng.random() < 0.2:
            fields["attn_capture_dtype"] = "float16"
        out.append(
            {
                "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(9, 300))),
                "max_tokens": rng.randint(2, 32),
                "stream": rng.random() < 0.4,
                "fields": fields,
            }
        )
    return out


def run(client, model, spec):
    """(text, the response's capture as one JSON object, the stream's live rows)."""
    args = dict(model=model, prompt=spec["prompt"], max_tokens=spec["max_tokens"],
                temperature=0, extra_body=spec["fields"])
    if not spec["stream"]:
        r = client.completions.create(**args)
        return r.choices[0].text, r.model_dump(), []
    text, capture, live = [], {}, []
    for chunk in client.completions.create(stream=True, **args):
        body = chunk.model_dump()
        if body["choices"]:
            text.append(body["choices"][0].get("text") or "")
        if body.get("attn_capture_row") is not None:
            live.append(body["attn_capture_row"])
        # The capture comes whole on a chunk of its own after the last token's.
        capture.update(
            (k, v) for k, v in body.items() if k.startswith("attn_capture") and k != "attn_capture_row"
        )
    return "".join(text), capture, live


def arrays(response):
    assert "attn_capture_error" not in response, response["attn_capture_error"]
    cap = lantern_attn.from_response(response)
    out = {f"map {layer}": v for layer, v in cap.layers.items()}
    out.update((f"indices {layer}", v) for layer, v in cap.indices.items())
    for layer, stats in cap.stats.items():
        out.update((f"{name} {layer}", v) for name, v in stats.items())
    out.update((f"span mass {layer}", v) for layer, v in cap.span_mass.items())
    assert out, "the capture holds no arrays"
    return out


@pytest.fixture(scope="module")
def cap_server():
    srv = start_server("--enable-attention-capture")
    yield srv
    stop_server(srv)


def test_concurrent_captures_equal_the_same_requests_alone(cap_server):
    srv = cap_server
    client = srv.client()
    requests = specs()
    alone = [run(client, srv.model, s) for s in requests]

    stop = threading.Event()

    def noise(c):
        own, k = srv.client(), 0
        while not stop.is_set():
            own.completions.create(model=srv.model, prompt="noise " * (k % 40 + c + 1),
                                   max_tokens=6 + k % 16, temperature=0.9)
            k += 1

    noisers = [threading.Thread(target=noise, args=(c,)) for c in range(NOISE_CLIENTS)]
    for t in noisers:
        t.start()
    try:
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            together = list(pool.map(lambda s: run(srv.client(), srv.model, s), requests))
    finally:
        stop.set()
        for t in noisers:
            t.join()

    compared = live_rows = 0
    for i, ((text_a, cap_a, live_a), (text_b, cap_b, live_b)) in enumerate(zip(alone, together)):
        assert text_a == text_b, (i, requests[i])
        # Live rows (streams with spans or top-k) are JSON numbers: equal as parsed.
        assert live_a == live_b, (i, requests[i])
        live_rows += len(live_a)
        a, b = arrays(cap_a), arrays(cap_b)
        assert a.keys() == b.keys(), (i, sorted(a), sorted(b))
        for name in a:
            assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, (i, name)
            assert np.array_equal(a[name], b[name]), (i, name, requests[i])
            compared += 1
    assert compared >= 3 * NUM_REQUESTS
    assert live_rows > 0, "no stream with spans or top-k among the requests"
    metrics = srv.wait_idle()
    assert metrics["lantern:attention_capture_failures_total"] == 0
