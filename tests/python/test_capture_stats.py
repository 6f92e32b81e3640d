"""Key statistics (`attn_capture_stats`) through a real `lantern serve` on SmolLM2 with
the official openai client: each equals the reduction of the full maps of the same
request, statistics alone are the same numbers in kilobytes, inline and safetensors
deliveries agree, and bad fields get a 400 naming them."""

import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

PROMPT = "The lighthouse keeper climbed the narrow stairs and lit the lamp, because"
HEADS, KV_HEADS, BLOCK = 9, 3, 16


@pytest.fixture(scope="module")
def srv():
    server = start_server("--enable-attention-capture")
    yield server
    stop_server(server)


def capture(srv, **fields):
    r = srv.client().completions.create(
        model=srv.model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"attn_capture": True, "ignore_eos": True, **fields},
    )
    return r


def test_per_query_head_statistics_equal_the_reductions_of_the_maps(srv):
    r = capture(srv, attn_capture_layers=[0, 13, -1], attn_capture_stats=["key_mass", "key_max", "block_mass"],
                attn_capture_stats_heads="query", attn_capture_maps=True)
    cap = lantern_attn.from_response(r)
    assert cap.meta["stats"] == ["key_mass", "key_max", "block_mass"]
    assert cap.meta["block_size"] == BLOCK and cap.meta["stats_heads"] == "query"
    rows = len(cap.row_positions)
    for layer in (0, 13, 29):
        maps = cap.layers[layer].astype(np.float64)  # [rows, heads, keys]
        stats = cap.stats[layer]
        assert cap.meta["stats_groups"][cap.meta["layers"].index(layer)] == [[h] for h in range(HEADS)]
        np.testing.assert_allclose(stats["key_mass"], maps.sum(axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(stats["key_max"], cap.layers[layer].max(axis=0))
        keys = maps.shape[2]
        blocks = -(-keys // BLOCK)
        assert stats["block_mass"].shape == (HEADS, blocks)
        padded = np.zeros((HEADS, blocks * BLOCK))
        padded[:, :keys] = stats["key_mass"]
        np.testing.assert_allclose(stats["block_mass"], padded.reshape(HEADS, blocks, BLOCK).sum(-1), rtol=1e-5)
        # Every row sums to 1, so every head's masses sum to the number of rows.
        np.testing.assert_allclose(stats["key_mass"].sum(axis=1), rows, rtol=1e-5)


def test_statistics_alone_are_the_same_numbers_per_kv_head_in_kilobytes(srv):
    both = lantern_attn.from_response(capture(srv, attn_capture_stats="key_mass,key_max", attn_capture_maps=True))
    r = capture(srv, attn_capture_stats=["key_mass", "key_max"])
    alone = lantern_attn.from_response(r)
    assert alone.layers == {} and alone.meta["maps"] is False
    assert r.model_dump()["attn_capture_data"] == []
    # Per KV head (the default): the mean over its three query heads.
    assert alone.meta["stats_heads"] == "kv"
    assert alone.meta["stats_groups"][0] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    for layer in range(30):
        for stat in ("key_mass", "key_max"):
            np.testing.assert_array_equal(alone.stats[layer][stat], both.stats[layer][stat])
        grouped = both.layers[layer].astype(np.float64).reshape(len(both.row_positions), KV_HEADS, 3, -1).mean(2)
        np.testing.assert_allclose(alone.stats[layer]["key_mass"], grouped.sum(0), rtol=1e-5, atol=1e-6)
    assert len(r.model_dump_json()) < 64 << 10, "every layer's statistics fit in kilobytes"


def test_reference_delivery_carries_the_same_statistics(srv):
    fields = dict(attn_capture_stats=["block_mass", "key_mass"], attn_capture_stats_heads="mean",
                  attn_capture_layers="0:3")
    inline = lantern_attn.from_response(capture(srv, **fields))
    r = capture(srv, attn_capture_delivery="reference", **fields).model_dump()
    fetched = lantern_attn.fetch(srv.base_url + "/v1", r["attn_capture_id"], api_key=srv.api_key)
    assert fetched.meta["stats"] == ["key_mass", "block_mass"], "in the canonical order"
    for layer in (0, 1, 2):
        assert fetched.stats[layer]["key_mass"].shape == (1, len(inline.key_positions))
        for stat in ("key_mass", "block_mass"):
            np.testing.assert_array_equal(fetched.stats[layer][stat], inline.stats[layer][stat])
    requests.delete(f"{srv.base_url}/v1/captures/{r['attn_capture_id']}", headers=srv.headers(), timeout=30)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"attn_capture_stats": ["mass"]}, "attn_capture_stats"),
        ({"attn_capture_stats": 3}, "attn_capture_stats"),
        ({"attn_capture_stats": ["key_mass"], "attn_capture_stats_heads": "all"}, "attn_capture_stats_heads"),
        ({"attn_capture_maps": False}, "attn_capture_maps"),
        ({"attn_capture_maps": "no"}, "attn_capture_maps"),
    ],
)
def test_bad_statistics_fields_get_a_400_naming_them(srv, fields, param):
    body = {"model": srv.model, "prompt": PROMPT, "max_tokens": 2, "attn_capture": True, **fields}
    r = requests.post(srv.base_url + "/v1/completions", json=body, headers=srv.headers(), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_capture_of_statistics_alone_saves_and_loads_back(srv, tmp_path):
    r = capture(srv, attn_capture_stats=["key_mass", "block_mass"], attn_capture_layers="0:2",
                attn_capture_dtype="float16", attn_capture_spans=[{"label": "keeper", "chars": [4, 21]}])
    cap = lantern_attn.from_response(r)
    assert cap.layers == {} and cap.stats and cap.span_mass
    path = tmp_path / "stats.safetensors"
    lantern_attn.save_safetensors(cap, path)
    again = lantern_attn.load(path)
    assert again.meta == cap.meta and again.layers == {}
    for layer in (0, 1):
        for stat in ("key_mass", "block_mass"):
            np.testing.assert_array_equal(again.stats[layer][stat], cap.stats[layer][stat])
        np.testing.assert_array_equal(again.span_mass[layer], cap.span_mass[layer])
