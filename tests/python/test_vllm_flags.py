"""A `vllm serve` command line runs as it is: vLLM's flags that ask for what lantern does
anyway are taken with a line saying so, `--seed` makes unseeded sampling repeat against a
fresh server, and flags asking for what lantern does not do stop it with a message."""

import pytest

from conftest import start_server, stop_server

VLLM_FLAGS = [
    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--trust-remote-code",
    "--dtype", "auto", "--kv-cache-dtype", "auto", "--tensor-parallel-size", "1",
    "--enable-prefix-caching", "--enable-chunked-prefill", "--uvicorn-log-level", "warning",
]


def _samples(server, n=3):
    client = server.client()
    outputs = []
    for _ in range(n):
        r = client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=12,
                                      temperature=1.0)
        outputs.append(r.choices[0].text)
    return outputs


def test_a_vllm_command_line_runs_and_seed_repeats_sampling(tmp_path):
    runs = []
    for i in range(2):
        log = tmp_path / f"stderr{i}"
        with open(log, "w") as f:
            server = start_server(*VLLM_FLAGS, "--seed", "7", stderr=f)
        try:
            runs.append(_samples(server))
        finally:
            stop_server(server)
    assert runs[0] == runs[1]
    # Each request got its own seed from the sequence, not one seed for all.
    assert len(set(runs[0])) > 1
    text = log.read_text()
    for flag in ("--enable-auto-tool-choice", "--tool-call-parser", "--trust-remote-code", "--dtype"):
        assert f"lantern: {flag}: nothing to change" in text


def test_without_seed_unseeded_requests_draw_fresh_seeds(server):
    # The default server has no --seed: unseeded requests draw fresh seeds.
    assert len(set(_samples(server, n=4))) > 1


@pytest.mark.parametrize("flags, says", [
    (["--tensor-parallel-size", "2"], "one lantern process holds the whole model"),
    (["--tool-call-parser", "mistral"], "lantern parses hermes and llama3_json calls"),
    (["--dtype", "bfloat16"], "keeps weights as the model stores them"),
])
def test_flags_asking_for_what_lantern_does_not_do_stop_it(tmp_path, flags, says):
    log = tmp_path / "stderr"
    with open(log, "w") as f, pytest.raises(RuntimeError, match="exited early"):
        start_server(*flags, stderr=f)
    assert says in log.read_text()
