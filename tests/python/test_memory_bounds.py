"""Per-request memory stays bounded (measured as the server's peak resident memory):
the samples of one request share its prompt and stop list instead of copying them,
prompt logprobs keep only the top-k per position, never a prompt x vocabulary table;
256 samples of a long prompt cost no more than 256 of a short one; a top-k capture
is finalized row by row, never as a rows x heads x keys table."""

import sys
from pathlib import Path

import pytest

from conftest import SMOLLM2_BLOCK_BYTES, start_server, stop_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

MIB = 1 << 20
# About 1,100 tokens, and about 80.
LONG_PROMPT = " ".join(f"word{i}" for i in range(300))
SHORT_PROMPT = " ".join(f"word{i}" for i in range(40))


@pytest.fixture()
def fresh_server():
    # A server of its own, so its peak memory is this test's.
    srv = start_server()
    yield srv
    stop_server(srv)


def peak_rss(srv) -> int:
    """The server's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{srv.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_samples_share_one_prompt_and_stop_list(fresh_server):
    srv = fresh_server
    client = srv.client()
    body = dict(model=srv.model, prompt="Once upon a time", max_tokens=2, n=128, seed=1)
    # The same request without stops first (twice, as the allocator settles): a batch of
    # 128 samples has costs of its own (logits, sampling), which then are in the peak.
    for _ in range(2):
        assert len(client.completions.create(**body).choices) == 128
    before = peak_rss(srv)
    # 2 MiB of stop strings that never match, 128 samples: copied per sample this took
    # 128 x 2 MiB at least twice over (the request's copy and the matcher's).
    stops = ["\x01" + "z" * (512 * 1024) + str(i) for i in range(4)]
    assert len(client.completions.create(**body, stop=stops).choices) == 128
    growth = peak_rss(srv) - before
    # Copies would take 512 MiB and more; shared, the list costs a few copies of 2 MiB
    # while the body is parsed, plus the allocator's noise over a batch of 128.
    assert growth < 160 * MIB, f"the server's peak memory grew {growth / MIB:.0f} MiB"
    srv.wait_idle()


def server_with_kv_blocks(blocks: int):
    srv = start_server(kv_cache_memory=str(blocks * SMOLLM2_BLOCK_BYTES))
    yield srv
    stop_server(srv)


def warm_up_long_prompt(client, srv, prefix=""):
    """Runs the long prompt once, so the KV cache's pages it touches are in the peak."""
    warm = client.completions.create(model=srv.model, prompt=prefix + LONG_PROMPT, max_tokens=1)
    assert warm.usage.prompt_tokens >= 1000
    return warm


@pytest.fixture()
def snug_server():
    # A KV cache just larger than the long prompt: the warm-up touches nearly all of
    # it, so the cache's own pages do not count as growth.
    yield from server_with_kv_blocks(100)


def test_prompt_logprobs_keep_only_the_top_k_per_position(snug_server):
    srv = snug_server
    client = srv.client()
    # The long prompt: a prompt x vocabulary (49,152) table in f32 is 220 MB, and the
    # step's logits rows for the whole prompt as much again. Warm up on the same paths:
    # the long prompt (the KV cache's pages), then the short one with prompt logprobs
    # (a step's worth of logits rows).
    warm_up_long_prompt(client, srv, prefix="x ")
    client.completions.create(
        model=srv.model, prompt=SHORT_PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    srv.wait_idle()
    before = peak_rss(srv)
    r = client.completions.create(
        model=srv.model,
        prompt=LONG_PROMPT,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 2},
    )
    entries = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(entries) == r.usage.prompt_tokens >= 1000
    assert entries[0] is None
    # Each later entry holds the token itself and at most two alternatives.
    assert all(1 <= len(e) <= 3 for e in entries[1:])
    growth = peak_rss(srv) - before
    assert growth < 48 * MIB, f"the server's peak memory grew {growth / MIB:.0f} MiB"
    srv.wait_idle()


@pytest.fixture()
def roomy_server():
    # Room for the long prompt shared by 256 samples: its full blocks once, plus each
    # sample's own last block.
    yield from server_with_kv_blocks(400)


def test_many_samples_of_a_long_prompt_stay_bounded(roomy_server):
    # The engine's samples hold one copy of the prompt ids (engine_tiny.rs asserts the
    # sharing exactly). End to end: 256 samples of the long prompt take no more memory
    # at their peak than 256 samples of the short one, beyond a little noise; what
    # each sample holds does not grow with the prompt.
    srv = roomy_server
    client = srv.client()
    # Warm up: the long prompt once, then the short one with 256 samples, twice as the
    # allocator settles (a batch of 256, its logits rows, each sample's own blocks).
    warm = warm_up_long_prompt(client, srv)
    n256 = dict(model=srv.model, max_tokens=2, n=256, seed=1)
    for _ in range(2):
        client.completions.create(prompt=SHORT_PROMPT, **n256)
    srv.wait_idle()
    before = peak_rss(srv)
    r = client.completions.create(prompt=LONG_PROMPT, **n256)
    assert len(r.choices) == 256 and r.usage.prompt_tokens == warm.usage.prompt_tokens
    growth = peak_rss(srv) - before
    assert growth < 32 * MIB, f"the server's peak memory grew {growth / MIB:.0f} MiB"
    srv.wait_idle()


@pytest.fixture()
def capture_server():
    # A KV cache just larger than the capture's prompt (4,360 tokens), as above.
    srv = start_server("--enable-attention-capture", kv_cache_memory=str(290 * SMOLLM2_BLOCK_BYTES))
    yield srv
    stop_server(srv)


def test_a_top_k_capture_is_finalized_row_by_row(capture_server):
    srv = capture_server
    client = srv.client()
    prompt = " ".join([LONG_PROMPT] * 4)
    capture = {
        "attn_capture": True,
        "attn_capture_layers": [3],
        "attn_capture_reduce": "mean_heads",
        "attn_capture_top_k": 1,
        "attn_capture_rows": "prompt",
    }
    # Warm up on the same paths: the long prompt without capture (the KV cache's pages,
    # the prefill's activations), then a short prompt with the capture.
    warm = client.completions.create(model=srv.model, prompt=prompt, max_tokens=1)
    assert warm.usage.prompt_tokens >= 4000
    client.completions.create(model=srv.model, prompt=SHORT_PROMPT, max_tokens=1, extra_body=capture)
    srv.wait_idle()
    before = peak_rss(srv)
    r = client.completions.create(model=srv.model, prompt=prompt, max_tokens=1, extra_body=capture)
    body = r.model_dump()
    assert "attn_capture_error" not in body, body.get("attn_capture_error")
    assert body["attn_capture_data"]
    growth = peak_rss(srv) - before
    # The maps are 4,360 rows x 1 value and index (35 KB); the queries and keys copied
    # for finalizing about 14 MB (34 MiB of growth measured with the allocator's
    # noise). A rows x heads x keys table of probabilities (9 heads) would be 684 MB,
    # half of it written (attention is causal).
    assert growth < 96 * MIB, f"the server's peak memory grew {growth / MIB:.0f} MiB"
    srv.wait_idle()
