"""The paged KV cache under a server: prefix-cache hits give identical tokens, and a pool
too small for all requests at once preempts and recomputes without changing results."""

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from conftest import SMOLLM2_BLOCK_BYTES, start_server, stop_server

LONG_PREFIX = (
    "You are a careful assistant. Here is a list of facts to keep in mind: "
    + " ".join(f"Fact {i}: the number {i} comes after {i - 1}." for i in range(1, 30))
)


def test_prefix_cache_hit_gives_identical_tokens(server, client):
    before = server.metrics()
    prompt = LONG_PREFIX + "\nQuestion: what comes after 7?\nAnswer:"
    kwargs = dict(
        model=server.model, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    first = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens >= 256 + 16, first.usage
    second = client.completions.create(**kwargs)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256, second.usage
    # Another question after the same prefix shares its full blocks.
    other = client.completions.create(
        **{**kwargs, "prompt": LONG_PREFIX + "\nQuestion: what comes after 3?\nAnswer:"}
    )
    assert other.usage.prompt_tokens_details.cached_tokens >= 256
    after = server.metrics()
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits >= 2 * 256
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]


def test_a_cache_salt_shares_blocks_only_with_the_same_salt(server, client):
    prompt = "Tenant notes. " + LONG_PREFIX + "\nQuestion: what comes after 5?\nAnswer:"

    def cached(**salt):
        r = client.completions.create(model=server.model, prompt=prompt, max_tokens=2, temperature=0,
                                      extra_body=salt)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

    unsalted, text = cached()
    assert unsalted == 0  # a prompt not seen before
    assert cached(cache_salt="tenant a") == (0, text)  # the unsalted blocks are not a's
    hit, again = cached(cache_salt="tenant a")
    assert hit >= 256 and again == text
    assert cached(cache_salt="tenant b")[0] == 0
    assert cached()[0] >= 256
    # Prompt logprobs' kept rows are salted too.
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=1,
                                  extra_body={"cache_salt": "tenant c", "prompt_logprobs": 1})
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.model, prompt="x", max_tokens=1, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


@pytest.fixture(scope="module")
def small_server():
    # 40 blocks of 16 tokens: room for about three of the requests below at once.
    srv = start_server(kv_cache_memory=str(40 * SMOLLM2_BLOCK_BYTES))
    yield srv
    stop_server(srv)


def _requests():
    return [
        dict(
            prompt=f"Story number {i}: "
            + "Once upon a time in a land far away, " * (6 + i % 3)
            + "there lived",
            max_tokens=64,
        )
        for i in range(8)
    ]


def _complete(srv, fields):
    r = srv.client(timeout=90).completions.create(
        model=srv.model, temperature=0, extra_body={"ignore_eos": True}, **fields
    )
    return r.choices[0].text, r.usage.completion_tokens


def test_preemption_gives_the_same_results(server, small_server):
    reqs = _requests()
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        reference = list(pool.map(lambda f: _complete(server, f), reqs))
        before = small_server.metrics()
        futures = [pool.submit(_complete, small_server, f) for f in reqs]
        # Fail fast if the engine stalls: requests wait, none runs, for seconds on end.
        stalled_since = None
        while not all(f.done() for f in futures):
            m = small_server.metrics()
            if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] > 0:
                stalled_since = stalled_since or time.monotonic()
                if time.monotonic() - stalled_since > 5:
                    stop_server(small_server)
                    raise AssertionError(f"the engine stalled with requests waiting: {m}")
            else:
                stalled_since = None
            time.sleep(0.2)
        constrained = [f.result() for f in futures]
    after = small_server.wait_idle()
    assert after["vllm:num_preemptions_total"] > before["vllm:num_preemptions_total"]
    assert constrained == reference
