"""`lantern generate --capture FILE` captures without a server: the file is the one the
server delivers by reference for the same request, byte for byte, and `lantern attn
view` and `export` read it."""

import json
import subprocess

import numpy as np
import pytest
import requests

from conftest import _binary, start_server, stop_server

PROMPT = "The lighthouse keeper climbed the narrow stairs and"
MAX_TOKENS = 5
# The options as the HTTP fields name them (`attn_capture_<name>`); the command line's
# are `--capture-<name>`.
CASES = {
    "everything": {},
    "options": {
        "layers": "0,-1",
        "heads": "0:3",
        "rows": "prompt",
        "reduce": "mean_heads",
        "top_k": 4,
        "dtype": "float16",
    },
    "statistics": {"layers": "-2:", "stats": "key_mass,block_mass", "stats_heads": "query"},
    "statistics and maps": {"stats": "key_max", "maps": True, "rows": "generated"},
}


@pytest.fixture(scope="module")
def cap_server():
    srv = start_server("--enable-attention-capture")
    yield srv
    stop_server(srv)


def lantern(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(_binary()), *map(str, args)], capture_output=True, text=True, timeout=300, check=check
    )


def cli_capture(path, options, *prompts) -> list:
    """Runs `lantern generate --capture path` on `prompts`; returns its --json lines."""
    flags = []
    for name, value in options.items():
        value = str(value).lower() if isinstance(value, bool) else value
        flags += [f"--capture-{name.replace('_', '-')}", value]
    prompt_flags = [a for p in prompts for a in ("--prompt", p)]
    out = lantern("generate", *prompt_flags, "--max-tokens", MAX_TOKENS, "--json",
                  "--capture", path, *flags)
    return [json.loads(line) for line in out.stdout.splitlines()]


def server_capture(srv, options):
    """The server's capture of the same request (delivery "reference"): the completion
    and the file's bytes."""
    fields = {f"attn_capture_{name}": value for name, value in options.items()}
    r = srv.client().completions.create(
        model=srv.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"attn_capture": True, "attn_capture_delivery": "reference", **fields},
    )
    got = requests.get(
        f"{srv.base_url}/v1/captures/{r.attn_capture_id}", headers=srv.headers(), timeout=60
    )
    assert got.status_code == 200, got.text
    return r, got.content


@pytest.mark.parametrize("case", CASES)
def test_the_file_equals_the_servers_capture(cap_server, tmp_path, case):
    options = CASES[case]
    path = tmp_path / "cap.safetensors"
    (line,) = cli_capture(path, options, PROMPT)
    response, served = server_capture(cap_server, options)
    assert line["text"] == response.choices[0].text
    assert path.read_bytes() == served


def test_attn_view_and_export_read_it(tmp_path):
    path = tmp_path / "cap.safetensors"
    (line,) = cli_capture(path, {}, PROMPT)
    page = tmp_path / "cap.html"
    lantern("attn", "view", path, "-o", page)
    assert "<html" in page.read_text().lower()
    npy = tmp_path / "npy"
    lantern("attn", "export", path, "--format", "npy", "-o", npy)
    meta = json.loads((npy / "meta.json").read_text())
    total = len(line["prompt_token_ids"]) + len(line["token_ids"])
    assert meta["total_len"] == total
    assert meta["layers"] == list(range(30))
    first = np.load(npy / "layer_0.npy")
    # Every row the model ran, every head, keys up to the last token that ran.
    assert first.shape == (total - 1, 9, total - 1)
    np.testing.assert_allclose(first.sum(axis=-1), 1.0, atol=1e-5)
    copy = tmp_path / "copy.safetensors"
    lantern("attn", "export", path, "--format", "safetensors", "-o", copy)
    assert copy.read_bytes() == path.read_bytes()


def test_attn_export_writes_statistics_and_span_masses_as_npy(tmp_path):
    path = tmp_path / "stats.safetensors"
    cli_capture(path, {"layers": "-1", "stats": "key_mass,block_mass"}, PROMPT)
    npy = tmp_path / "npy"
    lantern("attn", "export", path, "--format", "npy", "-o", npy)
    meta = json.loads((npy / "meta.json").read_text())
    layer = meta["layers"][0]
    # Statistics alone: no maps, each statistic a [groups, keys] array; rows sum to 1, so
    # each group's key masses add up to the number of rows.
    assert not (npy / f"layer_{layer}.npy").exists()
    mass = np.load(npy / f"layer_{layer}.key_mass.npy")
    blocks = np.load(npy / f"layer_{layer}.block_mass.npy")
    assert mass.dtype == np.float32 and mass.shape[0] == len(meta["stats_groups"][0])
    rows = meta["total_len"] - 1
    np.testing.assert_allclose(mass.sum(axis=1), rows, rtol=1e-4)
    np.testing.assert_allclose(blocks.sum(axis=1), mass.sum(axis=1), rtol=1e-5)


def test_several_prompts_write_one_numbered_file_each(tmp_path):
    other = "Once upon a time"
    lines = cli_capture(tmp_path / "cap.safetensors", {"layers": "-1"}, PROMPT, other)
    assert len(lines) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap.1.safetensors", "cap.2.safetensors"]
    # Batched with another prompt, a capture is the one of that prompt alone.
    cli_capture(tmp_path / "alone.safetensors", {"layers": "-1"}, other)
    assert (tmp_path / "cap.2.safetensors").read_bytes() == (tmp_path / "alone.safetensors").read_bytes()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--capture-top-k", "0"], "--capture-top-k"),
        (["--capture-layers", "99"], "--capture-layers"),
        (["--capture-dtype", "int8"], "--capture-dtype"),
        (["--max-capture-bytes", "1K"], "--max-capture-bytes"),
    ],
)
def test_bad_options_are_refused_naming_them(tmp_path, flags, named):
    path = tmp_path / "cap.safetensors"
    out = lantern("generate", "--prompt", PROMPT, "--max-tokens", 2, "--capture", path, *flags,
                  check=False)
    assert out.returncode == 1, out
    assert named in out.stderr, out.stderr
    assert not path.exists()


def test_a_capture_path_that_cannot_be_written_is_refused_before_generating(tmp_path):
    for path, why in [(tmp_path, "is a directory"), (tmp_path / "missing" / "cap.safetensors", "does not exist")]:
        out = lantern("generate", "--prompt", PROMPT, "--max-tokens", 2, "--capture", path, check=False)
        assert out.returncode == 1 and why in out.stderr, out.stderr
        # Refused up front: nothing was generated.
        assert out.stdout == "", out.stdout
