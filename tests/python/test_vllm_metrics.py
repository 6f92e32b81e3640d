"""`/metrics` under vLLM's names: what the Kubernetes Gateway API Inference Extension's
endpoint picker reads by default and what vLLM's Grafana dashboard plots are all there,
labelled with the served model's name, and they move when requests run."""

import re
import threading
import time

import requests

from conftest import SERVED_MODEL_NAME

SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# The endpoint picker's default metric names (its flags --total-queued-requests-metric,
# --total-running-requests-metric, --kv-cache-usage-percentage-metric and the cache
# info it reads block_size and num_gpu_blocks from).
GATEWAY_NAMES = [
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
]

# Every series vLLM's example Grafana dashboard queries.
DASHBOARD_NAMES = [
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]

# vLLM's other request histograms (the list).
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
]


def scrape(server):
    """[(name, labels, value)] of every series of `/metrics`."""
    r = requests.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200
    # OpenMetrics text (prometheus-client writes it), which ends in `# EOF`.
    assert r.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
    assert r.text.endswith("# EOF\n")
    out = []
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SERIES.match(line)
        assert m, f"not a Prometheus series: {line!r}"
        labels = dict(LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def value(series, name, **labels):
    """The one series `name` whose labels include `labels`."""
    found = [
        v for n, l, v in series if n == name and all(l.get(k) == x for k, x in labels.items())
    ]
    assert len(found) == 1, f"{name}{labels}: {len(found)} series"
    return found[0]


def test_gateway_and_dashboard_names_are_present(server):
    series = scrape(server)
    names = {n for n, _, _ in series}
    for name in GATEWAY_NAMES + DASHBOARD_NAMES:
        assert name in names, f"{name} missing from /metrics"
    for name in HISTOGRAMS:
        for suffix in ("_bucket", "_sum", "_count"):
            assert name + suffix in names, name + suffix
    # Every vLLM series carries the served model's name, as vLLM's dashboards filter on.
    for n, labels, _ in series:
        if n.startswith("vllm:"):
            assert labels.get("model_name") == SERVED_MODEL_NAME, (n, labels)
    # The capture metrics are lantern's own.
    assert "lantern:attention_captures_total" in names
    assert not any(n.startswith("lantern:num_requests") for n in names)


def test_cache_config_info_describes_the_kv_cache(server):
    series = scrape(server)
    info = [l for n, l, v in series if n == "vllm:cache_config_info" and v == 1.0]
    assert len(info) == 1
    info = info[0]
    assert int(info["block_size"]) == 16
    total = value(series, "lantern:kv_cache_total_blocks")
    assert int(info["num_gpu_blocks"]) == total > 0
    assert info["enable_prefix_caching"] == "True"
    assert info["cache_dtype"] == "float16"  # the default KV cache type
    usage = value(series, "vllm:kv_cache_usage_perc")
    assert 0.0 <= usage <= 1.0


def test_counters_and_histograms_move_after_a_request(server):
    client = server.client()
    server.wait_idle()
    before = scrape(server)
    r = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Count from one to twenty."}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "length"
    after = server.wait_idle()
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens == 6
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    for name in HISTOGRAMS:
        if name == "vllm:iteration_tokens_total":
            # One step per token, the prefill included.
            assert delta(name + "_count") >= 6, name
        elif name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
            assert delta(name + "_count") == 5, name
        else:
            assert delta(name + "_count") == 1, name
    assert delta("vllm:request_prompt_tokens_sum") == r.usage.prompt_tokens
    assert delta("vllm:request_generation_tokens_sum") == 6
    # Prompt tokens served from the prefix cache are not computed again.
    assert delta("vllm:iteration_tokens_total_sum") >= 6
    # Phases add up: queue + prefill + decode is the end-to-end time.
    phases = sum(
        delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode")
    )
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    assert e2e > 0
    assert abs(phases - e2e) < 0.05 * e2e + 0.01, (phases, e2e)
    # The +Inf bucket of a histogram counts every observation.
    assert value(after, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == value(
        after, "vllm:e2e_request_latency_seconds_count"
    )


def test_gauges_show_requests_in_flight(server):
    """While streams run, running > 0 and the KV cache is in use; afterwards both fall
    back to 0."""
    client = server.client()
    server.wait_idle()
    started = threading.Event()
    stop = threading.Event()
    errors = []

    def stream(i):
        try:
            s = client.completions.create(
                model=server.model,
                prompt=f"Story number {i}:",
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in s:
                started.set()
                if stop.is_set():
                    break
            s.close()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        assert started.wait(60), "no stream started"
        running = usage = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (running > 0 and usage > 0):
            series = scrape(server)
            running = value(series, "vllm:num_requests_running")
            usage = value(series, "vllm:kv_cache_usage_perc")
        assert running > 0, "num_requests_running stayed 0 while streams ran"
        assert 0 < usage <= 1.0, usage
        assert value(series, "vllm:num_requests_waiting") >= 0
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    idle = server.wait_idle()
    assert idle["vllm:num_requests_running"] == 0
    assert idle["vllm:kv_cache_usage_perc"] == 0
