"""Captures in one line, through a real `lantern serve` with the default capture flags:
the README's capture examples run as written, `max_tokens: 0` captures the prompt alone
and matches transformers' attention (tests/fixtures/reference) in `to_hf()`'s shape, a
prompt-only capture's size does not depend on `max_tokens`, and the package installs with
pip from clients/python."""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import openai
import pytest

from conftest import API_KEY, ROOT, start_server, stop_server

sys.path.insert(0, str(ROOT / "clients" / "python"))
import lantern_attn  # noqa: E402

REFERENCE = ROOT / "tests" / "fixtures" / "reference" / "smollm2"
NUM_LAYERS, NUM_HEADS = 30, 9


@pytest.fixture(scope="module")
def cap_server():
    # Only what the README says: captures on, every other capture flag at its default.
    srv = start_server("--enable-attention-capture")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def cap_client(cap_server):
    return cap_server.client()


def readme_capture_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Attention capture")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_readme_capture_examples_run_as_written(cap_server):
    """Every Python block of the README's capture section, in order, in one namespace,
    with only the server's address and key put in for the README's."""
    section = readme_capture_section()
    serve = re.search(r"^lantern serve .*$", section, re.M).group(0)
    flags = [f for f in serve.split() if f.startswith("--")]
    assert flags == ["--port", "--api-key", "--enable-attention-capture"], serve
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 3
    namespace = {"__name__": "readme"}
    for block in blocks:
        code = block.replace("http://127.0.0.1:8000", cap_server.base_url).replace('"KEY"', repr(API_KEY))
        code = code.replace("#key=KEY", f"#key={API_KEY}")
        if "bertviz" in code:
            try:
                import bertviz  # noqa: F401
            except ImportError as e:
                print(f"README's bertviz block not run: {e} (test_bertviz.py covers it)")
                continue
        exec(compile(code, "README.md (capture section)", "exec"), namespace)
    # What the blocks promise.
    cap = namespace["cap"]
    assert isinstance(cap, lantern_attn.Capture)
    attentions = namespace["attentions"]
    assert len(attentions) == NUM_LAYERS
    assert all(a.shape[:2] == (1, NUM_HEADS) for a in attentions)
    cap_server.wait_idle()


def reference_prompt(name: str):
    npz = np.load(REFERENCE / f"{name}.npz")
    return npz, [int(t) for t in npz["prompt_ids"]], [int(layer) for layer in npz["layers"]]


def test_max_tokens_zero_captures_the_prompt_like_transformers(cap_server, cap_client):
    """Prefill only: no token sampled, every prompt row present, and `to_hf()` equals
    transformers' `output_attentions` over the prompt (served path: activations are
    quantized, so within the bounds of crates/lantern-engine/tests/capture_smollm2.rs)."""
    npz, prompt_ids, layers = reference_prompt("plain_story")
    n = len(prompt_ids)
    r = cap_client.completions.create(
        model=cap_server.model,
        prompt=prompt_ids,
        max_tokens=0,
        extra_body={"attn_capture": True, "attn_capture_layers": layers, "attn_capture_rows": "prompt"},
    )
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == n
    cap = lantern_attn.from_response(r)
    assert cap.total_len == cap.prompt_len == n and cap.absent_rows == []
    attentions = cap.to_hf()
    assert attentions.layers == layers and attentions.absent_rows == []
    worst, total, count = 0.0, 0.0, 0
    for layer, ours in zip(layers, attentions):
        assert ours.shape == (1, NUM_HEADS, n, n) and ours.dtype == np.float32
        theirs = npz[f"attn_L{layer}"][:n, :, :n].astype(np.float32).transpose(1, 0, 2)
        visible = np.tril(np.ones((n, n), dtype=bool))[None]
        assert not ours[0][~np.broadcast_to(visible, theirs.shape)].any(), "masked keys are exactly 0"
        np.testing.assert_allclose(ours[0].sum(axis=-1), 1.0, atol=1e-4)
        diff = np.abs(ours[0] - theirs)[np.broadcast_to(visible, theirs.shape)]
        worst, total, count = max(worst, diff.max()), total + diff.sum(), count + diff.size
    assert total / count < 2e-3 and worst < 0.2, (total / count, worst)
    cap_server.wait_idle()


def test_to_hf_of_a_generation_names_the_absent_row(cap_server, cap_client):
    r = cap_client.chat.completions.create(
        model=cap_server.model,
        messages=[{"role": "user", "content": "Name one planet."}],
        max_tokens=3,
        temperature=0,
        extra_body={"attn_capture": True, "attn_capture_layers": "0,29", "ignore_eos": True},
    )
    cap = lantern_attn.from_response(r)
    total = cap.total_len
    assert total == r.usage.prompt_tokens + 3
    attentions = cap.to_hf()
    assert attentions.absent_rows == [total - 1]
    for layer, a in zip([0, 29], attentions):
        assert a.shape == (1, NUM_HEADS, total, total)
        np.testing.assert_array_equal(a[0][:, cap.row_positions][:, :, cap.key_positions],
                                      cap.dense(layer).transpose(1, 0, 2))
        assert not a[0, :, total - 1].any() and not a[0, :, :, total - 1].any()
        np.testing.assert_allclose(a[0, :, : total - 1].sum(axis=-1), 1.0, atol=1e-4)


def test_prompt_rows_cost_the_same_whatever_max_tokens(cap_server, cap_client):
    """A capture of prompt rows is sized by the prompt: with every layer and the whole
    remaining context as max_tokens (or none given) it is accepted, and its key columns
    end at the prompt. All rows over the whole context are refused, naming the estimate."""
    prompt = "The lighthouse keeper climbed the narrow stairs and lit the lamp."
    room = 4000  # what the test server's KV cache can hold, far more than the cap allows
    # Chat has no default max_tokens (completions' is 16, as OpenAI's).
    for max_tokens in (room, None):
        kwargs = {} if max_tokens is None else {"max_tokens": max_tokens}
        r = cap_client.chat.completions.create(
            model=cap_server.model, messages=[{"role": "user", "content": prompt}], stop=".", temperature=0,
            extra_body={"attn_capture": True, "attn_capture_rows": "prompt"}, **kwargs,
        )
        cap = lantern_attn.from_response(r)
        assert list(cap.row_positions) == list(range(cap.prompt_len))
        assert list(cap.key_positions) == list(range(cap.prompt_len))
    with pytest.raises(openai.BadRequestError) as e:
        cap_client.completions.create(
            model=cap_server.model, prompt=prompt, max_tokens=room, extra_body={"attn_capture": True}
        )
    body = e.value.response.json()["error"]
    assert body["code"] == "capture_too_large" and body["param"] == "attn_capture"
    assert re.search(r"\d{9,}", body["message"]), body["message"]
    cap_server.wait_idle()


def admission_bytes(n):
    """What the server compares with its cap for a capture of every row, head and layer
    of a sequence of n tokens in float32: the maps delivered, plus what computing them
    holds (docs/attention-capture.md): the query rows, the keys (3 kv heads of 64), the
    maps in f32, two rows of every head with their scratch and each kv head's keys
    transposed for scoring two rows at a time, positions and tokens; plus the encoder's
    copy of the maps."""
    kv_heads, head_dim = 3, 64
    maps = NUM_LAYERS * NUM_HEADS * n * n * 4
    queries = NUM_LAYERS * n * NUM_HEADS * head_dim * 4
    keys = NUM_LAYERS * n * kv_heads * head_dim * 4
    transposed = kv_heads * (-(-n // 16) * 16 * head_dim + 2 * (n + 16)) * 4
    scratch = n * (2 * NUM_HEADS * 4 + 12) + transposed
    metadata = 2 * n * 8 + 2 * n * 64
    return 3 * maps + queries + keys + scratch + metadata


def test_max_tokens_omitted_generates_within_the_cap():
    """All rows and no max_tokens: generation stops where the capture reaches the cap,
    rather than the request being refused (a server with a 16 MiB cap keeps it short)."""
    srv = start_server("--enable-attention-capture", "--max-capture-bytes", "16M")
    try:
        r = srv.client().chat.completions.create(
            model=srv.model,
            messages=[{"role": "user", "content": "Count from one to a hundred."}],
            temperature=0,
            extra_body={"attn_capture": True, "ignore_eos": True},
        )
        cap = lantern_attn.from_response(r)
        n = cap.total_len
        assert r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == n - cap.prompt_len > 0
        # The admission figure of n rows, up to 16 MiB.
        assert admission_bytes(n) <= 16 << 20 < admission_bytes(n + 1)
        # On completions the default of 16 tokens is a ceiling the cap lowers too.
        prompt = " ".join(["word"] * (n - 4))
        c = srv.client().completions.create(
            model=srv.model, prompt=prompt, temperature=0, extra_body={"attn_capture": True, "ignore_eos": True}
        )
        assert 0 < c.usage.completion_tokens < 16
        assert admission_bytes(c.usage.prompt_tokens + c.usage.completion_tokens) <= 16 << 20
        short = srv.client().completions.create(model=srv.model, prompt="Hi", temperature=0,
                                                extra_body={"attn_capture": True, "ignore_eos": True})
        assert short.usage.completion_tokens == 16
        srv.wait_idle()
    finally:
        stop_server(srv)


def test_max_tokens_zero_without_capture(cap_server, cap_client):
    """Without a capture, 0 is refused on chat (as vLLM does); completions' echo with
    max_tokens 0 returns the prompt and its logprobs (vLLM's prompt-scoring idiom)."""
    with pytest.raises(openai.BadRequestError) as e:
        cap_client.chat.completions.create(
            model=cap_server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=0
        )
    assert e.value.response.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        cap_client.completions.create(model=cap_server.model, prompt="Hi there", max_tokens=0)
    prompt = "The capital of France is Paris"
    r = cap_client.completions.create(
        model=cap_server.model, prompt=prompt, max_tokens=0, echo=True, logprobs=1
    )
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 0
    assert "".join(choice.logprobs.tokens) == prompt
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    cap_server.wait_idle()


def test_the_package_installs_with_pip(tmp_path):
    """`pip install ./clients/python` gives the package with its viewer page, needing
    numpy only (torch is an extra)."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
         str(ROOT / "clients" / "python")],
        check=True,
    )
    script = """
import importlib.metadata as md, json, lantern_attn, numpy as np
from lantern_attn import view
print(json.dumps({"file": lantern_attn.__file__, "requires": md.requires("lantern-attn"),
                  "page": view.template()[:15], "version": lantern_attn.__version__}))
"""
    env = dict(os.environ, PYTHONPATH=str(target))
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True)
    info = json.loads(out.stdout)
    assert info["file"].startswith(str(target)), info
    assert info["page"] == "<!doctype html>"
    plain = [r for r in info["requires"] if "extra ==" not in r]
    assert len(plain) == 1 and plain[0].startswith("numpy"), info["requires"]
    assert any(r.startswith("torch") and "extra ==" in r for r in info["requires"]), info["requires"]
