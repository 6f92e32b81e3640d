"""Capture's edges, as a new user meets them, through a real `lantern serve` and the
official openai client: who may read a stored capture on a server without keys, what
the capture store refuses up front, when its files go, rows and layers selected as in
Python, capture fields without `attn_capture`, a too-large capture's message, the
usage chunk's place in a capturing stream, and captures finishing together past the
worker's queue limit."""

import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from conftest import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

PROMPT = "The lighthouse keeper climbed the narrow stairs and lit the lamp, because"
NUM_LAYERS = 30
CAPTURE_FILE = re.compile(r"lantern-capture-[0-9a-f]{32}\.safetensors")


def complete(client, server, max_tokens=4, stream=False, stop=None, **fields):
    return client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        stop=stop,
        extra_body={"attn_capture": True, **fields},
    )


def post(server, body, key=None):
    headers = {"Authorization": f"Bearer {key or server.api_key}"}
    body = {"model": server.model, "prompt": PROMPT, **body}
    return requests.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)


def served_tokens(server):
    return server.metrics()["vllm:prompt_tokens_total"]


@pytest.fixture(scope="module")
def cap_server():
    srv = start_server("--enable-attention-capture")
    yield srv
    stop_server(srv)


def test_a_server_without_keys_lets_whoever_holds_the_id_read_the_capture():
    srv = start_server("--enable-attention-capture", api_key=None)
    try:
        # The openai client always sends a bearer token, here a dummy one.
        client = srv.client(api_key="x")
        r = complete(client, srv, attn_capture_layers=[2], attn_capture_delivery="reference")
        capture_id = r.model_dump()["attn_capture_id"]
        url = f"{srv.base_url}/v1/captures/{capture_id}"
        for headers in ({}, {"Authorization": "Bearer x"}, {"Authorization": "Bearer other"}):
            got = requests.get(url, headers=headers, timeout=30)
            assert got.status_code == 200, (headers, got.text)
        fetched = lantern_attn.fetch(srv.base_url + "/v1", capture_id)
        assert fetched.layers[2].shape[1] == 9
        assert requests.get(url + "/view", timeout=30).status_code == 200
        assert requests.delete(url, timeout=30).status_code == 200
        assert requests.get(url, timeout=30).status_code == 404
    finally:
        stop_server(srv)


def test_a_capture_larger_than_the_whole_store_is_refused_before_any_work():
    srv = start_server("--enable-attention-capture", "--max-stored-capture-bytes", "20K")
    try:
        before = served_tokens(srv)
        r = post(
            srv,
            {"max_tokens": 8, "attn_capture": True, "attn_capture_layers": "0:4",
             "attn_capture_delivery": "reference"},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "attn_capture_delivery"
        assert "--max-stored-capture-bytes" in error["message"]
        assert "20.0 KiB" in error["message"] and "retry" not in error["message"]
        assert served_tokens(srv) == before, "the refused request ran nothing"
        # What fits is still stored: one layer, reduced over heads.
        r = complete(srv.client(), srv, attn_capture_layers=[0], attn_capture_reduce="mean_heads",
                     attn_capture_delivery="reference")
        assert r.model_dump()["attn_capture_id"].startswith("cap-")
    finally:
        stop_server(srv)


def test_capture_files_go_at_their_ttl_at_shutdown_and_at_the_next_start():
    with tempfile.TemporaryDirectory(prefix="lantern-captures-") as d:
        d = Path(d)
        leftover = d / ("lantern-capture-" + "0123456789abcdef" * 2 + ".safetensors")
        others = [d / "notes.txt", d / "lantern-capture-mine.safetensors"]
        for path in [leftover, *others]:
            path.write_bytes(b"x")
        srv = start_server("--enable-attention-capture", "--capture-dir", str(d), "--capture-ttl", "1")
        try:
            assert not leftover.exists(), "a file an earlier server left is removed at start"
            assert all(p.exists() for p in others), "files of other names are kept"
            client = srv.client()
            short = Path(complete(client, srv, attn_capture_layers=[1],
                                  attn_capture_delivery="file").model_dump()["attn_capture_path"])
            assert short.exists()
            # No request touches the store meanwhile: a timer deletes it.
            deadline = time.monotonic() + 10
            while short.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not short.exists(), "the file outlived its TTL"
        finally:
            stop_server(srv)
        srv = start_server("--enable-attention-capture", "--capture-dir", str(d))
        try:
            kept = Path(complete(srv.client(), srv, attn_capture_layers=[1],
                                 attn_capture_delivery="file").model_dump()["attn_capture_path"])
            assert kept.exists()
        finally:
            stop_server(srv)
        assert not kept.exists(), "the server's files go when it stops"
        assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in others)


def test_captures_finishing_together_past_the_queue_limit_are_all_delivered():
    """`--max-queued-captures N` refuses new capturing requests while N finished captures
    wait for the worker; captures admitted before that are finalized however many of
    their requests end in the same step, none of their work lost."""
    srv = start_server("--enable-attention-capture", "--max-queued-captures", "1")
    try:
        n = 6
        admitted = threading.Barrier(n)

        def one(i):
            admitted.wait()
            client = srv.client()
            return complete(client, srv, max_tokens=24, attn_capture_layers="all")

        with ThreadPoolExecutor(n) as pool:
            responses = list(pool.map(one, range(n)))
        for r in responses:
            fields = r.model_dump()
            assert "attn_capture_error" not in fields, fields["attn_capture_error"]
            cap = lantern_attn.from_response(r)
            assert sorted(cap.layers) == list(range(NUM_LAYERS))
        metrics = srv.wait_idle()
        assert metrics["lantern:attention_captures_total"] == n
        assert metrics["lantern:attention_capture_failures_total"] == 0
    finally:
        stop_server(srv)


@pytest.mark.parametrize(
    "rows, max_tokens",
    [("100:200", 16), ("generated", 0), ("generated", 1)],
)
def test_rows_that_can_never_exist_get_a_400(cap_server, rows, max_tokens):
    before = served_tokens(cap_server)
    r = post(cap_server, {"max_tokens": max_tokens, "attn_capture": True,
                          "attn_capture_layers": [0], "attn_capture_rows": rows})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "attn_capture_rows"
    assert served_tokens(cap_server) == before


def test_rows_the_sequence_did_not_reach_are_listed_absent(cap_server):
    client = cap_server.client()
    # A first run tells where greedy decoding goes; the second stops at its third token.
    first = client.completions.create(model=cap_server.model, prompt=PROMPT, max_tokens=8,
                                      temperature=0, logprobs=0)
    tokens = first.choices[0].logprobs.tokens
    stop_at = next(i for i in range(2, 8) if tokens[i].strip() and tokens[i] not in "".join(tokens[:i]))
    r = complete(client, cap_server, max_tokens=8, stop=[tokens[stop_at]],
                 attn_capture_layers=[0], attn_capture_rows="0:40")
    cap = lantern_attn.from_response(r)
    assert r.choices[0].finish_reason == "stop"
    total, possible = cap.total_len, cap.prompt_len + 8
    assert cap.total_len < possible
    assert list(cap.row_positions) == list(range(total - 1))
    absent = {a["position"]: a["reason"] for a in cap.absent_rows}
    # The last token (never run), then every position the request could have reached.
    assert sorted(absent) == list(range(total - 1, possible))
    assert "never run" in absent[total - 1]
    assert all(f"ended at {total} tokens" in absent[p] for p in range(total, possible))


def test_layers_from_the_end_and_ranges(cap_server):
    client = cap_server.client()
    last = lantern_attn.from_response(complete(client, cap_server, attn_capture_layers=[-1],
                                               attn_capture_reduce="mean_heads"))
    assert list(last.layers) == [NUM_LAYERS - 1]
    explicit = lantern_attn.from_response(complete(client, cap_server, attn_capture_layers=[29],
                                                   attn_capture_reduce="mean_heads"))
    np.testing.assert_array_equal(last.layers[29], explicit.layers[29])
    ranged = lantern_attn.from_response(complete(client, cap_server, attn_capture_layers="0:4, -2:",
                                                 attn_capture_reduce="mean_heads"))
    assert list(ranged.layers) == [0, 1, 2, 3, 28, 29]
    for layers in ([30], [-31], "30:"):
        r = post(cap_server, {"max_tokens": 2, "attn_capture": True, "attn_capture_layers": layers})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "attn_capture_layers"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"attn_capture_layers": [0]}, "attn_capture_layers"),
        ({"attn_capture_rows": "prompt"}, "attn_capture_rows"),
        ({"attn_capture_delivery": "reference"}, "attn_capture_delivery"),
        ({"attn_capture": True, "attn_capture_layer": [0]}, "attn_capture"),
    ],
)
def test_capture_fields_without_attn_capture_get_a_400(cap_server, body, field):
    r = post(cap_server, {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    # Switched off by the flag itself, they are ignored.
    if "attn_capture" not in body:
        r = post(cap_server, {"max_tokens": 2, "attn_capture": False, **body})
        assert r.status_code == 200, r.text
        assert "attn_capture_data" not in r.json()


def test_a_too_large_capture_says_why_in_binary_units_and_what_fits(cap_server):
    r = post(cap_server, {"max_tokens": 2000, "attn_capture": True})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "capture_too_large"
    message = error["message"]
    assert re.search(r"about \d+\.\d GiB", message), message
    assert "limit of 256.0 MiB (--max-capture-bytes)" in message
    assert "most of it is the maps delivered" in message
    fits = int(re.search(r"fits with max_tokens (\d+) or fewer", message).group(1))
    assert 0 < fits < 2000
    ok = post(cap_server, {"max_tokens": fits, "attn_capture": True, "ignore_eos": True,
                           "attn_capture_delivery": "reference"})
    assert ok.status_code == 200, ok.text
    requests.delete(f"{cap_server.base_url}/v1/captures/{ok.json()['attn_capture_id']}",
                    headers=cap_server.headers(), timeout=30)
    cap_server.wait_idle()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_usage_is_the_last_chunk_of_a_capturing_stream(cap_server, api):
    client = cap_server.client()
    fields = {"attn_capture": True, "attn_capture_layers": [0], "ignore_eos": True}
    common = dict(model=cap_server.model, max_tokens=3, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=fields)
    if api == "chat":
        stream = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **common)
    else:
        stream = client.completions.create(prompt=PROMPT, **common)
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    assert not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].model_dump().get("attn_capture_data"), "the capture comes just before"
