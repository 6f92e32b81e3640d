"""`--device`: a device that cannot be used stops the command with an error naming it
and what is missing, never a panic; a misspelt one names the flag. (On a machine with
an NVIDIA driver and a binary built with the cuda feature, `--device cuda` runs instead:
scripts/test-gpu covers that.)"""

import subprocess

from conftest import _binary


def lantern(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_binary()), *args], capture_output=True, text=True, timeout=120
    )


def test_a_gpu_where_none_answers_is_a_clear_error():
    done = lantern("generate", "--device", "cuda:0", "--prompt", "Hi", "--max-tokens", "2")
    if done.returncode == 0:
        return  # a GPU answered: the engine ran there
    assert "device cuda:0" in done.stderr, done.stderr
    assert "built without CUDA" in done.stderr or "libcuda" in done.stderr, done.stderr
    assert "panicked" not in done.stderr, done.stderr


def test_a_misspelt_device_names_the_flag():
    done = lantern("generate", "--device", "gpu", "--prompt", "Hi")
    assert done.returncode != 0
    assert "--device" in done.stderr and '"gpu"' in done.stderr, done.stderr


def test_gpu_memory_utilization_is_refused_on_the_cpu():
    done = lantern("generate", "--gpu-memory-utilization", "0.5", "--prompt", "Hi")
    assert done.returncode != 0
    assert "--gpu-memory-utilization" in done.stderr, done.stderr


def test_a_gpu_backend_on_the_cpu_says_to_ask_for_the_gpu():
    done = lantern("generate", "--attention-backend", "cuda", "--prompt", "Hi")
    assert done.returncode != 0
    assert "--device cuda" in done.stderr, done.stderr
