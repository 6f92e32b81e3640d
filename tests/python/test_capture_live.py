"""Streamed captures' live figures: with `stream: true`, each captured row's span masses
and top-k keys arrive in the SSE chunk of the token it samples (`attn_capture_row`,
beside `choices`), and equal that row of the finished capture, which still arrives at
the end. A real `lantern serve`, the official openai client."""

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

PROMPT = "[1] The Eiffel Tower is 330 metres tall.\n[2] Tokyo Tower is 333 metres tall.\nHow tall is Tokyo Tower?"
SPANS = [{"label": "[1]", "chars": [4, 40]}, {"label": "[2]", "chars": [45, 79]}]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def srv():
    server = start_server("--enable-attention-capture")
    yield server
    stop_server(server)


def stream(srv, **fields):
    chunks = list(srv.client().completions.create(
        model=srv.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"attn_capture": True, "ignore_eos": True, "attn_capture_layers": [0, -1], **fields},
    ))
    rows = [c.model_dump()["attn_capture_row"] for c in chunks if c.model_dump().get("attn_capture_row")]
    return chunks, rows, lantern_attn.from_response(chunks)


def test_span_masses_of_each_row_arrive_with_its_token_and_equal_the_final_ones(srv):
    chunks, rows, cap = stream(srv, attn_capture_spans=SPANS, attn_capture_stats_heads="mean")
    # Every token's row is captured ("all" rows): one live row per token, in order, each
    # in the chunk that carries its token.
    assert [r["position"] for r in rows] == list(range(cap.prompt_len - 1, cap.prompt_len - 1 + MAX_TOKENS))
    with_rows = [c for c in chunks if c.model_dump().get("attn_capture_row")]
    assert all(c.choices and c.choices[0].text is not None for c in with_rows)
    positions = list(cap.row_positions)
    for row in rows:
        assert [layer["layer_idx"] for layer in row["layers"]] == [0, 29]
        for layer in row["layers"]:
            final = cap.span_mass[layer["layer_idx"]][positions.index(row["position"])]  # [groups, spans + 1]
            live = np.array(layer["span_mass"], dtype=np.float32)
            assert live.shape == final.shape == (1, len(SPANS) + 1)
            np.testing.assert_array_equal(live, final)
            assert "top_k" not in layer


def test_top_k_keys_of_each_row_equal_the_final_maps(srv):
    chunks, rows, cap = stream(srv, attn_capture_top_k=3, attn_capture_reduce="mean_heads",
                               attn_capture_stats_heads="mean")
    assert len(rows) == MAX_TOKENS
    positions = list(cap.row_positions)
    for row in rows:
        for layer in row["layers"]:
            r = positions.index(row["position"])
            [top] = layer["top_k"]  # one group: the mean of the heads, as the maps' reduction
            np.testing.assert_array_equal(np.array(top["values"], dtype=np.float32),
                                          cap.layers[layer["layer_idx"]][r, 0])
            assert top["positions"] == cap.indices[layer["layer_idx"]][r, 0].tolist()
            assert "span_mass" not in layer


def test_no_live_rows_without_spans_or_top_k_or_without_streaming(srv):
    _, rows, _ = stream(srv, attn_capture_reduce="mean_heads")
    assert rows == []
    r = srv.client().completions.create(
        model=srv.model, prompt=PROMPT, max_tokens=3, temperature=0,
        extra_body={"attn_capture": True, "attn_capture_top_k": 2, "attn_capture_layers": [0]})
    assert "attn_capture_row" not in r.model_dump()


@pytest.mark.parametrize("parsed", ["tools", "reasoning"])
def test_chats_whose_text_is_parsed_stream_every_live_row(srv, parsed):
    # Tools and a reasoning parser hold text back over several tokens; each token's row
    # still goes out, in order, with whichever chunk comes next.
    server = srv
    extra = {}
    if parsed == "tools":
        extra["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    else:
        server = start_server("--enable-attention-capture", "--reasoning-parser", "deepseek_r1")
    try:
        chunks = list(server.client().chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
            temperature=0, stream=True, **extra,
            extra_body={"attn_capture": True, "ignore_eos": True, "attn_capture_layers": [0],
                        "attn_capture_top_k": 2},
        ))
    finally:
        if server is not srv:
            stop_server(server)
    rows = [c.model_dump()["attn_capture_row"] for c in chunks if c.model_dump().get("attn_capture_row")]
    cap = lantern_attn.from_response(chunks)
    assert [r["position"] for r in rows] == list(range(cap.prompt_len - 1, cap.prompt_len - 1 + MAX_TOKENS))
