"""A capture job through Ray Data (lantern.ray_data): a local Ray cluster of 2 CPUs, one
`lantern.LLM` per actor, prompts in and Parquet out; the texts and the statistics read
back equal a direct `LLM.generate` of the same prompts. The same code runs on a real
cluster (`ray.init(address=...)`). Without Ray Data installed only the test of the error
that says to install it runs."""

import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import lantern

try:
    import pyarrow.parquet as pq
    import ray
    import ray.data
    from lantern.ray_data import CaptureBatches, prompt_statistics
except ImportError:
    ray = None
needs_ray = pytest.mark.skipif(ray is None, reason='Ray Data is not installed: pip install "ray[data]"')

PROMPTS = [
    "The lighthouse keeper climbed the narrow stairs and",
    "def fibonacci(n):",
    "The capital of France is",
    "Water boils at",
    "Once upon a time, in a village by the sea,",
    "The three primary colours are",
]
SAMPLING = dict(temperature=0.0, max_tokens=10)
LAYERS = [0, -1]
TOP_K = 4


@pytest.fixture(scope="module")
def cluster():
    # Ray's sockets live in its temp dir, whose path must stay short: /tmp, not pytest's.
    temp_dir = tempfile.mkdtemp(prefix="lantern-ray-", dir="/tmp")
    # A throwaway cluster on the loopback address: no token written into ~/.ray.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        num_cpus=2,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        object_store_memory=100 * 1024 * 1024,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@needs_ray
def test_a_capture_job_writes_the_direct_generations_and_statistics_to_parquet(cluster, tmp_path):
    ds = ray.data.from_items([{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    ds = ds.map_batches(
        CaptureBatches,
        fn_constructor_kwargs=dict(sampling=SAMPLING, layers=LAYERS, top_k=TOP_K, kv_cache_memory="128M"),
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1,
        batch_size=3,
    )
    ds.write_parquet(str(tmp_path / "captures"))

    table = pq.read_table(tmp_path / "captures")
    assert table.num_rows == len(PROMPTS)
    rows = sorted(table.to_pylist(), key=lambda r: r["id"])
    assert [r["prompt"] for r in rows] == PROMPTS

    llm = lantern.LLM(kv_cache_memory="128M")
    last = llm.model_info["num_layers"] - 1
    outs = llm.generate(
        PROMPTS,
        lantern.SamplingParams(**SAMPLING),
        capture={"layers": LAYERS, "rows": "generated", "stats": ["key_mass"], "stats_heads": "mean"},
        use_tqdm=False,
    )
    llm.close()
    for row, out in zip(rows, outs):
        assert row["text"] == out.outputs[0].text
        assert row["token_ids"] == list(out.outputs[0].token_ids)
        assert row["finish_reason"] == out.outputs[0].finish_reason == "length"
        assert row["prompt_token_ids"] == list(out.prompt_token_ids)
        # Every generated token but the last (never run through the model) is a row.
        assert row["captured_rows"] == SAMPLING["max_tokens"] - 1
        want = prompt_statistics(out.attention, TOP_K)
        for layer in (0, last):
            mass = np.array(row[f"prompt_mass_L{layer}"], dtype=np.float32)
            assert len(mass) == len(out.prompt_token_ids)
            # The engine's own key_mass over the prompt, divided by the rows: bit for bit
            # through Ray and Parquet.
            direct = out.attention.stats[layer]["key_mass"][0, : len(mass)]
            np.testing.assert_array_equal(mass, direct / np.float32(row["captured_rows"]))
            np.testing.assert_array_equal(mass, want["prompt_mass"][layer])
            assert row[f"prompt_share_L{layer}"] == pytest.approx(want["prompt_share"][layer], abs=0)
            # Rows sum to 1 over every key, so the prompt's share is at most 1.
            assert 0 < row[f"prompt_share_L{layer}"] <= 1 + 1e-5
            top = row[f"top_keys_L{layer}"]
            assert top == want["top_keys"][layer].tolist() and len(top) == min(TOP_K, len(mass))
            assert all(mass[a] >= mass[b] for a, b in zip(top, top[1:]))
            assert mass[top[0]] == mass.max()


@needs_ray
def test_each_engine_takes_the_cpus_ray_gave_its_worker(cluster):
    # Engines sharing a machine must not each take every core.
    from lantern import ray_data

    @ray.remote(num_cpus=2)
    def threads():
        return ray_data._ray_cpus()

    assert ray.get(threads.remote()) == 2
    assert ray_data._ray_cpus() is None  # the driver reserved nothing


@needs_ray
def test_bad_options_raise_before_any_work():
    with pytest.raises(ValueError, match="n must be 1"):
        CaptureBatches(sampling={"n": 2})
    with pytest.raises(ValueError, match="out of range"):
        CaptureBatches(layers=[99], kv_cache_memory="64M")


def test_without_ray_the_import_error_says_what_to_install():
    # ray hidden from the import system, as where it is not installed.
    code = "import sys; sys.modules['ray'] = None; import lantern.ray_data"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0
    assert 'ImportError: lantern.ray_data needs Ray Data: pip install "ray[data]"' in run.stderr
    # lantern itself does not need ray.
    run = subprocess.run([sys.executable, "-c", "import sys; sys.modules['ray'] = None; import lantern"])
    assert run.returncode == 0
