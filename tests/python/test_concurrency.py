"""Many concurrent clients: every request completes, greedy outputs equal the same
requests served one at a time, and afterwards the engine is idle with every KV block
free. A client that disconnects mid-stream has its request aborted."""

import time
from concurrent.futures import ThreadPoolExecutor

import requests

NUM_CLIENTS = 32
REQUESTS_PER_CLIENT = 4

TOPICS = [
    "the moon", "a cat", "rivers", "bread", "winter", "a lighthouse", "trains", "bees",
    "the desert", "music", "a library", "volcanoes", "coffee", "the ocean", "robots", "tea",
]


def _spec(i):
    """Distinct requests of mixed prompt lengths and output lengths."""
    topic = TOPICS[i % len(TOPICS)]
    detail = " Please be specific and vivid." * ((i * 5) % 7) * 2
    prompt = f"Write a short paragraph about {topic}.{detail}"
    max_tokens = (8, 16, 32, 48)[(i // 2) % 4]
    if i % 2:
        return "chat", {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    return "completion", {"prompt": prompt + "\n", "max_tokens": max_tokens}


NUM_SPECS = 16


def _run(client, model, spec):
    kind, fields = spec
    if kind == "chat":
        r = client.chat.completions.create(model=model, temperature=0, **fields)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
    r = client.completions.create(model=model, temperature=0, **fields)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens


def test_concurrent_clients_match_sequential(server):
    client = server.client()
    specs = [_spec(i) for i in range(NUM_SPECS)]
    started = time.monotonic()
    alone = [_run(client, server.model, s) for s in specs]
    sequential_s = time.monotonic() - started
    before = server.metrics()

    def one_client(c):
        own = server.client()
        results = []
        for j in range(REQUESTS_PER_CLIENT):
            k = (c * REQUESTS_PER_CLIENT + j * 7) % NUM_SPECS
            results.append((k, _run(own, server.model, specs[k])))
        return results

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool:
        per_client = list(pool.map(one_client, range(NUM_CLIENTS)))
    concurrent_s = time.monotonic() - started
    results = [r for rs in per_client for r in rs]
    assert len(results) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    mismatches = [(k, got, alone[k]) for k, got in results if got != alone[k]]
    assert not mismatches, f"{len(mismatches)} differ, e.g. {mismatches[:3]}"
    after = server.wait_idle()
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated == sum(r[2] for _, r in results)
    print(
        f"\n{len(specs)} requests one at a time: {sequential_s:.1f}s; "
        f"{len(results)} requests from {NUM_CLIENTS} clients: {concurrent_s:.1f}s"
    )


def test_disconnect_mid_stream_frees_the_request(server):
    before = server.metrics()
    r = requests.post(
        server.base_url + "/v1/completions",
        json={
            "model": server.model,
            "prompt": "Tell me a very long story about a dragon.",
            "max_tokens": 3000,
            "stream": True,
            "ignore_eos": True,
        },
        headers=server.headers(),
        stream=True,
        timeout=60,
    )
    assert r.status_code == 200
    seen = 0
    for line in r.iter_lines():
        if line.startswith(b"data: "):
            seen += 1
            if seen == 5:
                break
    r.close()
    after = server.wait_idle(timeout_s=30)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 5 <= generated < 3000
    assert after["vllm:request_success_total"] > before["vllm:request_success_total"]


def test_metrics_names(server):
    text = requests.get(server.base_url + "/metrics", timeout=10).text
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "lantern:kv_cache_free_blocks",
        "lantern:kv_cache_total_blocks",
    ]:
        assert f"\n{name}{{" in text, name
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
