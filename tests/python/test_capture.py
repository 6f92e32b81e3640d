"""Attention capture through a real `lantern serve`, driven by the official openai client
with `extra_body`, decoded with the repository's helper (clients/python, the lantern_attn package):
every delivery (inline JSON, reference, file, streamed) round-trips, and bad requests get
a 400 naming the field before any work."""

import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import requests

from conftest import API_KEY, start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

OTHER_KEY = "lantern-python-test-other-key"
PROMPT = "The lighthouse keeper climbed the narrow stairs and lit the lamp, because"
NUM_LAYERS, NUM_HEADS = 30, 9


@pytest.fixture(scope="module")
def capture_dir():
    with tempfile.TemporaryDirectory(prefix="lantern-captures-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def cap_server(capture_dir):
    srv = start_server(
        "--enable-attention-capture",
        "--capture-dir",
        str(capture_dir),
        "--api-key",
        OTHER_KEY,
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def cap_client(cap_server):
    return cap_server.client()


def complete(client, server, stream=False, max_tokens=6, **capture):
    body = {"attn_capture": True, "ignore_eos": True, **capture}
    return client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
        extra_body=body,
    )


def check_rows(cap: "lantern_attn.Capture", atol=1e-5):
    """Rows sum to 1 over the keys they see; keys after the row's position are 0."""
    keys = np.asarray(cap.key_positions)
    for layer, _ in cap.layers.items():
        dense = cap.dense(layer)
        for r, pos in enumerate(cap.row_positions):
            row = dense[r]
            assert np.all(row[:, keys > pos] == 0), (layer, pos)
            np.testing.assert_allclose(row.sum(axis=-1), 1.0, atol=atol)


@pytest.mark.skipif(not hasattr(openai.OpenAI, "responses"), reason="no Responses API in this client")
def test_a_response_captures_as_its_chat_does(cap_server, cap_client):
    """The Responses API takes the capture fields in `extra_body` too: its maps are the
    chat completion's of the same conversation, whole and at the end of a stream."""
    body = {"attn_capture": True, "attn_capture_layers": [3], "ignore_eos": True}
    ask = dict(model=cap_server.model, max_output_tokens=4, temperature=0, extra_body=body)
    whole = cap_client.responses.create(input="Hi", **ask).model_dump()
    chat = cap_client.chat.completions.create(
        model=cap_server.model, messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4, temperature=0, extra_body=body,
    )
    events = list(cap_client.responses.create(input="Hi", stream=True, **ask))
    streamed = events[-1].response.model_dump()
    want = lantern_attn.from_response(chat)
    for response in (whole, streamed):
        got = lantern_attn.from_response(response)
        assert got.total_len == want.total_len == response["usage"]["total_tokens"]
        np.testing.assert_array_equal(got.dense(3), want.dense(3))
    cap_server.wait_idle()


def test_capture_is_refused_when_disabled(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=server.model, prompt=PROMPT, max_tokens=2, extra_body={"attn_capture": True}
        )
    assert "--enable-attention-capture" in str(e.value)


def test_inline_chat_capture(cap_server, cap_client):
    messages = [{"role": "user", "content": "Name one planet."}]
    r = cap_client.chat.completions.create(
        model=cap_server.model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        extra_body={"attn_capture": True, "attn_capture_layers": "0,15,29", "ignore_eos": True},
    )
    cap = lantern_attn.from_response(r)
    assert sorted(cap.layers) == [0, 15, 29]
    prompt_ids = requests.post(
        cap_server.base_url + "/tokenize",
        json={"model": cap_server.model, "messages": messages},
        headers=cap_server.headers(),
        timeout=30,
    ).json()["tokens"]
    assert cap.prompt_len == len(prompt_ids) == r.usage.prompt_tokens
    assert list(cap.token_ids[: cap.prompt_len]) == prompt_ids
    assert cap.total_len == cap.prompt_len + r.usage.completion_tokens
    # Every position but the last generated one has a row; it is named absent.
    assert list(cap.row_positions) == list(range(cap.total_len - 1))
    assert [a["position"] for a in cap.absent_rows] == [cap.total_len - 1]
    for m in cap.layers.values():
        assert m.shape == (cap.total_len - 1, NUM_HEADS, cap.total_len - 1)
        assert m.dtype == np.float32
    check_rows(cap)
    cap_server.wait_idle()


def test_streamed_capture_equals_the_whole_response(cap_server, cap_client):
    whole = lantern_attn.from_response(
        complete(cap_client, cap_server, attn_capture_layers=[3, 20])
    )
    chunks = list(complete(cap_client, cap_server, stream=True, attn_capture_layers=[3, 20]))
    last = chunks[-1].model_dump()
    assert last.get("attn_capture_data"), "the last chunk carries the capture"
    assert all(not c.model_dump().get("attn_capture_data") for c in chunks[:-1])
    streamed = lantern_attn.from_response(last)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed.total_len == whole.total_len
    assert text.strip()
    for layer in (3, 20):
        np.testing.assert_array_equal(streamed.layers[layer], whole.layers[layer])
    cap_server.wait_idle()


def test_reference_delivery_is_per_key_and_deletable(cap_server, cap_client):
    opts = dict(
        attn_capture_layers="5",
        attn_capture_dtype="float16",
        attn_capture_reduce="mean_heads",
        attn_capture_rows="prompt",
    )
    inline = lantern_attn.from_response(complete(cap_client, cap_server, **opts))
    r = complete(cap_client, cap_server, attn_capture_delivery="reference", **opts).model_dump()
    capture_id = r["attn_capture_id"]
    assert capture_id.startswith("cap-") and "attn_capture_data" not in r
    fetched = lantern_attn.fetch(cap_server.base_url + "/v1", capture_id, api_key=API_KEY)
    assert fetched.layers[5].dtype == np.float16
    # Prompt rows see the prompt's keys only: the columns end there.
    assert fetched.layers[5].shape == (inline.prompt_len, 1, inline.prompt_len)
    np.testing.assert_array_equal(fetched.layers[5], inline.layers[5])
    assert fetched.meta["tokens"] == inline.meta["tokens"]
    url = f"{cap_server.base_url}/v1/captures/{capture_id}"
    other = requests.get(url, headers={"Authorization": f"Bearer {OTHER_KEY}"}, timeout=30)
    assert other.status_code == 404, "another API key cannot read it"
    assert requests.get(url, timeout=30).status_code == 401
    deleted = requests.delete(url, headers=cap_server.headers(), timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert requests.get(url, headers=cap_server.headers(), timeout=30).status_code == 404


def test_file_delivery_writes_a_private_safetensors_file(cap_server, cap_client, capture_dir):
    opts = dict(attn_capture_layers=[0, 29], attn_capture_top_k=4, attn_capture_heads=[0, 6])
    inline = lantern_attn.from_response(complete(cap_client, cap_server, **opts))
    r = complete(cap_client, cap_server, attn_capture_delivery="file", **opts).model_dump()
    path = Path(r["attn_capture_path"])
    assert path.parent == capture_dir and path.suffix == ".safetensors"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    from_file = lantern_attn.from_response(r)
    for layer in (0, 29):
        assert from_file.layers[layer].shape == (inline.total_len - 1, 2, 4)
        np.testing.assert_array_equal(from_file.layers[layer], inline.layers[layer])
        np.testing.assert_array_equal(from_file.indices[layer], inline.indices[layer])
        # Top-k values are the largest of the full map's row.
        assert np.all(np.diff(from_file.layers[layer], axis=-1) <= 0)


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"attn_capture": "yes"}, "attn_capture"),
        ({"attn_capture_layers": [NUM_LAYERS]}, "attn_capture_layers"),
        ({"attn_capture_layers": "0,x"}, "attn_capture_layers"),
        ({"attn_capture_heads": [NUM_HEADS]}, "attn_capture_heads"),
        ({"attn_capture_rows": "middle"}, "attn_capture_rows"),
        ({"attn_capture_reduce": "sum"}, "attn_capture_reduce"),
        ({"attn_capture_top_k": 0}, "attn_capture_top_k"),
        ({"attn_capture_dtype": "int8"}, "attn_capture_dtype"),
        ({"attn_capture_delivery": "email"}, "attn_capture_delivery"),
        ({"n": 2}, "attn_capture"),
    ],
)
def test_malformed_capture_fields_get_a_400_naming_them(cap_server, cap_client, extra, field):
    body = {"model": cap_server.model, "prompt": PROMPT, "max_tokens": 2, "attn_capture": True}
    body.update(extra)
    r = requests.post(
        cap_server.base_url + "/v1/completions", json=body, headers=cap_server.headers(), timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_oversized_capture_is_refused_with_the_estimate(cap_server, cap_client):
    with pytest.raises(openai.BadRequestError) as e:
        complete(cap_client, cap_server, max_tokens=2000)
    message = str(e.value)
    assert "capture_too_large" in message or "bytes" in message
    assert any(ch.isdigit() for ch in message)
    cap_server.wait_idle()


def test_metrics_count_captures(cap_server, cap_client):
    before = cap_server.metrics()["lantern:attention_captures_total"]
    complete(cap_client, cap_server, attn_capture_layers="0")
    after = cap_server.metrics()
    assert after["lantern:attention_captures_total"] == before + 1
    assert after["lantern:attention_capture_failures_total"] == 0
    assert after["lantern:attention_captures_stored"] >= 0


def test_references_expire_after_the_ttl():
    srv = start_server("--enable-attention-capture", "--capture-ttl", "1")
    try:
        r = complete(srv.client(), srv, attn_capture_layers="0", attn_capture_delivery="reference")
        capture_id = r.model_dump()["attn_capture_id"]
        url = f"{srv.base_url}/v1/captures/{capture_id}"
        assert requests.get(url, headers=srv.headers(), timeout=30).status_code == 200
        time.sleep(1.5)
        assert requests.get(url, headers=srv.headers(), timeout=30).status_code == 404
    finally:
        stop_server(srv)
