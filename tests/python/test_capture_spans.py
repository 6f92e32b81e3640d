"""Spans (`attn_capture_spans`) through a real `lantern serve` on SmolLM2 with the
official openai client: character spans of a completion prompt (ASCII, accents, CJK,
emoji, a span at the very start and one at the very end), chat message spans and
characters inside a message, token spans; the character-to-token mapping in the meta
checks out against the tokenizer; the span masses equal the full maps of the same
request summed over each span's keys; inline and safetensors deliveries agree; a
RAG-citation computation as the docs show it; bad spans get a 400 naming the field."""

import base64
import gzip
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import detokenize, start_server, stop_server, tokenize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "clients" / "python"))
import lantern_attn  # noqa: E402

HEADS = 9

PASSAGES = [
    "Le café de la gare ouvre à 7 h, près du musée.",
    "東京タワーの高さは333メートルです。",
    "Rockets 🚀 reach orbit at about 7.8 km/s 🌍.",
]
QUESTION = "Question: how tall is Tokyo Tower? Answer:"
PROMPT = "".join(f"[{i + 1}] {p}\n" for i, p in enumerate(PASSAGES)) + QUESTION


def char_range(text, part, start=0):
    """[start, end) of `part` in `text`, in code points (Python's str indices)."""
    i = text.index(part, start)
    return [i, i + len(part)]


@pytest.fixture(scope="module")
def srv():
    server = start_server("--enable-attention-capture")
    yield server
    stop_server(server)


def complete(srv, prompt=PROMPT, max_tokens=5, **fields):
    return srv.client().completions.create(
        model=srv.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"attn_capture": True, "ignore_eos": True, **fields},
    )


def completion_spans():
    spans = [{"label": "start", "chars": [0, 3]}]  # "[1]", the very first characters
    for i, p in enumerate(PASSAGES):
        spans.append({"label": f"doc {i + 1}", "chars": char_range(PROMPT, p)})
    spans.append({"label": "end", "chars": [len(PROMPT) - len("Answer:"), len(PROMPT)]})
    return spans


def check_mapping(srv, cap, text, ids):
    """The meta's per-token character offsets spell the text, token by token."""
    offsets = cap.meta["span_offsets"]
    assert len(offsets) == len(ids) == cap.prompt_len
    # In order and contiguous; a character split over byte tokens is in each of them.
    prev_end = 0
    for i, (start, end) in enumerate(offsets):
        assert start <= end, (i, start, end)
        assert start == prev_end or (start == prev_end - 1 and end > start), (i, start, end, prev_end)
        prev_end = end
    assert prev_end == len(text)
    # The tokens of a span hold its characters; whole tokens decode to exactly theirs.
    for s in cap.meta["spans"]:
        if "prompt_chars" not in s:
            continue
        t0, t1 = s["tokens"]
        covered = text[offsets[t0][0]:offsets[t1 - 1][1]]
        c0, c1 = s["prompt_chars"]
        assert offsets[t0][0] <= c0 < c1 <= offsets[t1 - 1][1], s
        decoded = detokenize(srv, ids[t0:t1])
        assert decoded == covered or "\ufffd" in decoded, (s, decoded, covered)
        assert s["cuts_token"] == (offsets[t0][0] != c0 or offsets[t1 - 1][1] != c1), s


def test_character_spans_map_to_their_tokens_and_masses_equal_the_maps(srv):
    spans = completion_spans()
    r = complete(srv, attn_capture_spans=spans, attn_capture_stats_heads="query", attn_capture_maps=True,
                 attn_capture_layers=[0, 13, -1])
    cap = lantern_attn.from_response(r)
    ids = tokenize(srv, prompt=PROMPT)
    assert [t["id"] for t in cap.meta["tokens"][: cap.prompt_len]] == ids
    assert cap.span_labels == [s["label"] for s in spans] + ["other"]
    meta_spans = cap.meta["spans"]
    for asked, got in zip(spans, meta_spans):
        assert got["label"] == asked["label"] and got["chars"] == asked["chars"]
        assert got["prompt_chars"] == asked["chars"]
    # The very first characters start at the first token; the very last end at the last.
    assert meta_spans[0]["tokens"][0] == 0
    assert meta_spans[-1]["tokens"][1] == cap.prompt_len
    check_mapping(srv, cap, PROMPT, ids)
    # The emoji passage: its tokens' text is the passage (a token may reach outside it,
    # which cuts_token says).
    emoji = meta_spans[3]
    t0, t1 = emoji["tokens"]
    assert PASSAGES[2] in detokenize(srv, ids[t0:t1])
    rows = len(cap.row_positions)
    for layer in (0, 13, 29):
        maps = cap.layers[layer]  # [rows, heads, keys]
        mass = cap.span_mass[layer]
        assert mass.shape == (rows, HEADS, len(spans) + 1) and mass.dtype == np.float32
        inside = np.zeros(maps.shape[2], dtype=bool)
        for k, s in enumerate(meta_spans):
            a, b = s["tokens"]
            inside[a:b] = True
            np.testing.assert_allclose(mass[:, :, k], maps[:, :, a:b].astype(np.float64).sum(-1), rtol=1e-5,
                                       atol=1e-6)
        np.testing.assert_allclose(mass[:, :, -1], maps[:, :, ~inside].astype(np.float64).sum(-1), rtol=1e-5,
                                   atol=1e-6)
        # Without sinks, every row's spans and the rest add up to 1.
        np.testing.assert_allclose(mass.sum(-1), 1.0, rtol=1e-5)


def test_unicode_boundaries_and_a_span_that_cuts_a_token(srv):
    prompt = "😀 naïve 東京 🚀x"
    ids = tokenize(srv, prompt=prompt)
    spans = [
        {"label": "grin", "chars": [0, 1]},  # an emoji at the very start
        {"label": "naive", "chars": char_range(prompt, "naïve")},
        {"label": "kyo", "chars": char_range(prompt, "京")},  # one character of a word
        {"label": "x", "chars": [len(prompt) - 1, len(prompt)]},  # the very end
    ]
    cap = lantern_attn.from_response(complete(srv, prompt=prompt, max_tokens=2, attn_capture_spans=spans,
                                              attn_capture_layers=-1))
    check_mapping(srv, cap, prompt, ids)
    got = {s["label"]: s for s in cap.meta["spans"]}
    assert got["grin"]["tokens"][0] == 0
    assert got["x"]["tokens"][1] == len(ids)
    # Every emoji's bytes: the tokens holding them all belong to the span.
    t0, t1 = got["grin"]["tokens"]
    assert detokenize(srv, ids[t0:t1]).startswith("😀")
    assert cap.layers == {} and cap.meta["maps"] is False
    assert cap.span_mass[29].shape == (len(cap.row_positions), 3, 5)


def test_chat_message_spans_and_characters_inside_a_message(srv):
    question = "Which passage mentions the rocket 🚀? Answer with its number."
    context = "\n".join(f"[{i + 1}] {p}" for i, p in enumerate(PASSAGES))
    messages = [
        {"role": "system", "content": "Answer only from the passages."},
        {"role": "user", "content": context + "\n\n" + question},
    ]
    spans = [{"label": "system", "message": 0}]
    for i, p in enumerate(PASSAGES):
        spans.append({"label": f"doc {i + 1}", "message": 1, "chars": char_range(messages[1]["content"], p)})
    spans.append({"label": "question", "message": 1, "chars": char_range(messages[1]["content"], question)})
    r = srv.client().chat.completions.create(
        model=srv.model, messages=messages, max_tokens=4, temperature=0,
        extra_body={"attn_capture": True, "attn_capture_spans": spans, "attn_capture_stats_heads": "mean",
                    "attn_capture_rows": "generated", "attn_capture_maps": True,
                    "attn_capture_reduce": "mean_heads", "attn_capture_layers": [5, -1]})
    cap = lantern_attn.from_response(r)
    rendered = cap.meta["span_prompt"]
    ids = tokenize(srv, messages=messages)
    assert [t["id"] for t in cap.meta["tokens"][: cap.prompt_len]] == ids
    check_mapping(srv, cap, rendered, ids)
    where = cap.meta["span_messages"]
    assert len(where) == 2
    for m, (a, b) in zip(messages, where):
        assert rendered[a:b] == m["content"]
    got = cap.meta["spans"]
    assert got[0]["message"] == 0 and "chars" not in got[0]
    assert rendered[slice(*got[0]["prompt_chars"])] == messages[0]["content"]
    for s, p in zip(got[1:4], PASSAGES):
        assert s["message"] == 1 and rendered[slice(*s["prompt_chars"])] == p
    # The template's own tokens (<|im_start|>, roles) are outside every span: in "other".
    assert got[0]["tokens"][0] > 0
    for layer in (5, 29):
        maps = cap.layers[layer][:, 0, :].astype(np.float64)  # mean over heads, [rows, keys]
        mass = cap.span_mass[layer][:, 0, :]
        inside = np.zeros(maps.shape[1], dtype=bool)
        for k, s in enumerate(got):
            a, b = s["tokens"]
            inside[a:b] = True
            np.testing.assert_allclose(mass[:, k], maps[:, a:b].sum(-1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mass[:, -1], maps[:, ~inside].sum(-1), rtol=1e-5, atol=1e-6)
        assert (mass[:, -1] > 0).all()


def test_token_spans_on_chat_and_token_prompts(srv):
    messages = [{"role": "user", "content": "Say hello."}]
    ids = tokenize(srv, messages=messages)
    spans = [{"label": "head", "tokens": [0, 3]}, {"label": "tail", "tokens": [len(ids) - 2, len(ids)]}]
    r = srv.client().chat.completions.create(
        model=srv.model, messages=messages, max_tokens=2, temperature=0,
        extra_body={"attn_capture": True, "attn_capture_spans": spans, "attn_capture_layers": 0,
                    "ignore_eos": True})
    cap = lantern_attn.from_response(r)
    assert [s["tokens"] for s in cap.meta["spans"]] == [[0, 3], [len(ids) - 2, len(ids)]]
    assert "span_offsets" not in cap.meta and "cuts_token" not in cap.meta["spans"][0]
    # A prompt of token ids takes token spans (not characters).
    r = complete(srv, prompt=ids, max_tokens=2, attn_capture_spans=spans, attn_capture_layers=0)
    np.testing.assert_array_equal(lantern_attn.from_response(r).span_mass[0], cap.span_mass[0])


def test_reference_delivery_carries_the_same_span_masses(srv):
    fields = dict(attn_capture_spans=completion_spans(), attn_capture_layers="0:2",
                  attn_capture_stats=["key_mass"])
    inline = lantern_attn.from_response(complete(srv, **fields))
    r = complete(srv, attn_capture_delivery="reference", **fields).model_dump()
    assert r["attn_capture_meta"]["spans"] == inline.meta["spans"]
    fetched = lantern_attn.fetch(srv.base_url + "/v1", r["attn_capture_id"], api_key=srv.api_key)
    for layer in (0, 1):
        np.testing.assert_array_equal(fetched.span_mass[layer], inline.span_mass[layer])
        np.testing.assert_array_equal(fetched.stats[layer]["key_mass"], inline.stats[layer]["key_mass"])
    assert fetched.meta["span_offsets"] == inline.meta["span_offsets"]
    requests.delete(f"{srv.base_url}/v1/captures/{r['attn_capture_id']}", headers=srv.headers(), timeout=30)


def test_rag_citation_as_the_docs_show_it(srv):
    spans = [{"label": f"doc {i + 1}", "chars": char_range(PROMPT, p)} for i, p in enumerate(PASSAGES)]
    r = complete(srv, max_tokens=8, attn_capture_spans=spans, attn_capture_rows="generated",
                 attn_capture_stats_heads="mean")
    cap = lantern_attn.from_response(r)
    layers = cap.meta["layers"]
    mass = np.mean([cap.span_mass[layer][:, 0, :] for layer in layers], axis=0)  # [rows, spans + 1]
    assert mass.shape == (len(cap.row_positions), len(spans) + 1)
    cited = mass[:, :-1].argmax(axis=1)
    assert set(cited) <= {0, 1, 2}
    np.testing.assert_allclose(mass.sum(-1), 1.0, rtol=1e-5)
    assert len(r.model_dump_json()) < 64 << 10


def test_the_format_docs_reader_reads_span_masses(srv):
    doc = (Path(__file__).resolve().parents[2] / "docs" / "capture-format.md").read_text(encoding="utf-8")
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "attn_capture_span_data" in b]
    body = complete(srv, attn_capture_spans=completion_spans(), attn_capture_layers=[0, -1]).model_dump()
    namespace = {"body": body, "gzip": gzip, "base64": base64, "np": np}
    exec(compile(block, "capture-format.md (spans)", "exec"), namespace)
    cap = lantern_attn.from_response(body)
    assert namespace["labels"] == cap.span_labels
    assert sorted(namespace["span_mass"]) == [0, 29]
    for layer, values in namespace["span_mass"].items():
        np.testing.assert_array_equal(values, cap.span_mass[layer])


@pytest.mark.parametrize(
    "prompt, spans, message",
    [
        (PROMPT, [{"label": "a", "chars": [0, 10]}, {"label": "b", "chars": [5, 20]}], "overlap"),
        (PROMPT, [{"label": "a", "chars": [0, len(PROMPT) + 1]}], "out of range"),
        (PROMPT, [{"label": "a", "tokens": [0, 10_000]}], "out of range"),
        (PROMPT, [{"label": "a", "tokens": [4, 4]}], "empty"),
        (PROMPT, [{"label": str(i), "tokens": [i, i + 1]} for i in range(257)], "at most 256"),
        (PROMPT, [{"label": "a", "message": 0}], "chat message"),
        (PROMPT, [{"label": "a", "words": [0, 3]}], "unknown key"),
        (PROMPT, [{"label": "a"}], "names no range"),
        (PROMPT, {"label": "a", "tokens": [0, 3]}, "list"),
        ([1, 2, 3, 4], [{"label": "a", "chars": [0, 2]}], "token ids"),
    ],
)
def test_bad_completion_spans_get_a_400_naming_the_field(srv, prompt, spans, message):
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 2, "attn_capture": True,
            "attn_capture_spans": spans}
    r = requests.post(srv.base_url + "/v1/completions", json=body, headers=srv.headers(), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "attn_capture_spans"
    assert message in error["message"], error["message"]


@pytest.mark.parametrize(
    "spans, message",
    [
        ([{"label": "a", "chars": [0, 3]}], "name the message"),
        ([{"label": "a", "message": 2}], "out of range"),
        ([{"label": "a", "message": 0, "chars": [0, 99]}], "out of range"),
        ([{"label": "a", "message": 0}, {"label": "b", "message": 0, "chars": [0, 2]}], "overlap"),
    ],
)
def test_bad_chat_spans_get_a_400_naming_the_field(srv, spans, message):
    body = {"model": srv.model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 2,
            "attn_capture": True, "attn_capture_spans": spans}
    r = requests.post(srv.base_url + "/v1/chat/completions", json=body, headers=srv.headers(), timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "attn_capture_spans"
    assert message in error["message"], error["message"]
