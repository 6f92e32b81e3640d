"""`--threads N` sizes the pools `lantern serve` computes with: N compute threads and
N - 1 product helpers (the HTTP runtime's workers are bounded by N too; not counted
here, since tokio gives its on-demand blocking threads the same name)."""

import collections
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import _binary, start_server, stop_server


def thread_names(pid: int) -> collections.Counter:
    names = collections.Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        names[name.rsplit("-", 1)[0] if name[-1:].isdigit() else name] += 1
    return names


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_sizes_every_pool(threads):
    srv = start_server("--threads", str(threads))
    try:
        # A request runs products, which start the helpers.
        srv.client().completions.create(model=srv.model, prompt="Hello", max_tokens=4)
        names = thread_names(srv.process.pid)
        assert names["lantern-compute"] == threads, names
        assert names["lantern-quant"] == threads - 1, names
        assert 1 <= names["lantern-http"], names
    finally:
        stop_server(srv)


def test_the_default_is_the_physical_cores():
    srv = start_server()
    try:
        srv.client().completions.create(model=srv.model, prompt="Hello", max_tokens=2)
        names = thread_names(srv.process.pid)
        # The machine's physical cores, at most the CPUs this process may use.
        cpus = Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology")
        physical = len({((t / "physical_package_id").read_text(), (t / "core_id").read_text()) for t in cpus})
        expected = int(os.environ.get("RAYON_NUM_THREADS", 0)) or min(physical, len(os.sched_getaffinity(0)))
        assert names["lantern-compute"] == expected, (names, physical)
    finally:
        stop_server(srv)


def test_results_are_bit_identical_at_every_thread_count(tmp_path):
    """The products, element-wise passes and attention split their work by the thread
    count, never the arithmetic: a 300-token prompt (products and attention cut into
    tasks) gives the same tokens and the same attention probabilities, byte for byte,
    on 1, 2 and 3 threads."""
    prompt = " ".join(["The lantern glowed over the quiet harbour while ships came home."] * 25)
    results = []
    for threads in (1, 2, 3):
        capture = tmp_path / f"threads{threads}.safetensors"
        out = subprocess.run(
            [str(_binary()), "generate", "--threads", str(threads), "--prompt", prompt,
             "--max-tokens", "16", "--ignore-eos", "--json",
             "--capture", str(capture), "--capture-reduce", "mean_heads"],
            capture_output=True, text=True, timeout=300, check=True,
        )
        row = json.loads(out.stdout)
        assert len(row["prompt_token_ids"]) > 300
        results.append((row["token_ids"], capture.read_bytes()))
    assert len(results[0][0]) == 16
    for threads, (tokens, maps) in zip((2, 3), results[1:]):
        assert tokens == results[0][0], f"{threads} threads"
        assert maps == results[0][1], f"{threads} threads: attention maps differ"


def test_thread_speedup_pairs_one_thread_with_all_in_one_process():
    """`lantern bench --thread-speedup --json` runs every figure on one thread and on all
    (here 3, more than this machine may have: the pairing does not need the cores) and
    reports per figure both rates and their ratio."""
    out = subprocess.run(
        [str(_binary()), "bench", "--threads", "3", "--thread-speedup", "--json",
         "--repeat", "2", "--prompt-tokens", "64", "--decode-tokens", "4", "--batches", "4"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["threads"] == 3 and result["rounds"] == 2
    figures = [result["machine_multiply_adds"], result["machine_memory_gb_per_s"],
               result["prefill"], result["decode_batch_1"],
               result["decode_batch_1_after_prompt"], result["decode_batched"]["4"]]
    for f in figures:
        assert f["one_thread"] > 0 and f["all_threads"] > 0, f
        assert f["lowest"] <= f["speedup"] <= f["highest"], f
        # Medians of per-round ratios: near the ratio of the medians, not equal to it.
        assert 0.2 < f["speedup"] / (f["all_threads"] / f["one_thread"]) < 5, f
    # An empty shared pass: microseconds on either side, even with more threads than cores.
    empty = result["empty_shared_pass_us"]
    assert 0 < empty["one_thread"] < 1000 and 0 < empty["all_threads"] < 10000, empty


def test_kernel_speedup_pairs_a_lower_level_with_the_default_in_one_process():
    """`lantern bench --kernel-speedup scalar --json` runs every figure at the scalar
    kernel level and at the default one, turn about, and reports both rates and their
    ratio; a level that is the default already, or no level at all, is refused."""
    out = subprocess.run(
        [str(_binary()), "bench", "--kernel-speedup", "scalar", "--json",
         "--repeat", "2", "--prompt-tokens", "16", "--decode-tokens", "6", "--batches", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["baseline_level"] == "scalar" and result["kernel_level"] != "scalar"
    assert "machine_multiply_adds" not in result  # the thread pairing's bounds only
    assert "empty_shared_pass_us" not in result
    figures = [result["prefill"], result["decode_batch_1"],
               result["decode_batch_1_after_prompt"], result["decode_batched"]["2"]]
    for f in figures:
        assert f["baseline_level"] > 0 and f["default_level"] > 0, f
        assert f["lowest"] <= f["speedup"] <= f["highest"], f
        # The vector levels outrun scalar code many times over.
        assert f["speedup"] > 1.5, f
    for level, why in [(result["kernel_level"], "already the default"), ("sse9", "not a kernel level")]:
        bad = subprocess.run([str(_binary()), "bench", "--kernel-speedup", level],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode != 0 and why in bad.stderr, bad.stderr
