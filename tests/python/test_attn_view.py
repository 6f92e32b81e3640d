"""`lantern attn view` and `lantern attn export` on synthetic captures written by hand
from the wire format contract (docs/capture-format.md): the page renders in
headless Chromium without errors and shows the map; exports read back equal.

No server: these only run the binary on files."""

import base64
import gzip
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import _binary

FORMAT = "lantern.attn_capture.v1"
LAYERS = [0, 5]
HEADS = [0, 1, 2]
TOTAL, PROMPT = 24, 18
WORDS = (
    "<s> The old light house keeper climbed the narrow stairs , lit the lamp and "
    "watched ships pass . \n He smiled quietly tonight"
).split(" ")


def chromium() -> str:
    path = os.environ.get("LANTERN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        message = "no chromium (scripts/test-python installs it with apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message + "; CI must run the viewer test")
        pytest.skip(message)
    return path


def make_capture(seed=0, reduce="none", top_k=None, dtype="float32"):
    """A capture as the engine would finish it: rows 0..TOTAL-1 (the last token never
    ran), keys 0..TOTAL-1, causal maps with random values. Returns (meta, maps, indices)
    with maps {layer: float32 [rows, heads, keys]} rounded to `dtype`."""
    rng = np.random.default_rng(seed)
    rows = list(range(TOTAL - 1))
    keys = TOTAL - 1
    heads = len(HEADS) if reduce == "none" else 1
    maps, indices = {}, {}
    for layer in LAYERS:
        m = rng.random((len(rows), heads, keys), dtype=np.float32) ** 3
        m *= np.tril(np.ones((len(rows), keys), dtype=np.float32))[:, None, :]
        m /= m.sum(axis=-1, keepdims=True)
        if top_k is not None:
            k = min(top_k, keys)
            order = np.argsort(-m, axis=-1, kind="stable")[..., :k]
            m = np.take_along_axis(m, order, axis=-1)
            indices[layer] = order.astype(np.int32)
        maps[layer] = m.astype(np.float16).astype(np.float32) if dtype == "float16" else m
    meta = {
        "format": FORMAT,
        "prompt_len": PROMPT,
        "total_len": TOTAL,
        "tokens": [{"id": 100 + i, "text": (" " if i > 1 else "") + w} for i, w in enumerate(WORDS[:TOTAL])],
        "layers": LAYERS,
        "heads": HEADS,
        "reduce": reduce,
        "top_k": top_k,
        "dtype": dtype,
        "row_positions": rows,
        "key_positions": list(range(keys)),
        "absent_rows": [
            {"position": TOTAL - 1, "reason": "the last generated token was never run through the model"}
        ],
        "layer_attention": [
            {
                "layer_idx": layer,
                "scale": 0.125,
                "sliding_window": None,
                "chunk_size": None,
                "logits_soft_cap": None,
                "has_sinks": False,
                "num_heads": 9,
                "num_kv_heads": 3,
            }
            for layer in LAYERS
        ],
    }
    assert len(meta["tokens"]) == TOTAL
    return meta, maps, indices


def np_dtype(meta):
    return np.float16 if meta["dtype"] == "float16" else np.float32


def write_safetensors(path: Path, meta, maps, indices):
    """The safetensors file of the contract, by hand."""
    header = {"__metadata__": {"format": FORMAT, "lantern.capture": json.dumps(meta)}}
    blobs, offset = [], 0
    st_dtype = "F16" if meta["dtype"] == "float16" else "F32"
    for layer in LAYERS:
        tensors = [(f"layer.{layer}", st_dtype, maps[layer].astype(np_dtype(meta)))]
        if layer in indices:
            tensors.append((f"layer.{layer}.indices", "I32", indices[layer].astype("<i4")))
        for name, dt, array in tensors:
            raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
            header[name] = {"dtype": dt, "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
            blobs.append(raw)
            offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path: Path):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    metadata = header.pop("__metadata__")
    dtypes = {"F32": "<f4", "F16": "<f2", "I32": "<i4"}
    tensors = {
        name: np.frombuffer(body[t["data_offsets"][0] : t["data_offsets"][1]], dtype=dtypes[t["dtype"]]).reshape(
            t["shape"]
        )
        for name, t in header.items()
    }
    return metadata, tensors


def response_json(meta, maps, indices):
    """A completions response with the capture inline, as the contract gives it."""
    pack = lambda a: base64.b64encode(gzip.compress(a.tobytes())).decode()  # noqa: E731
    data = []
    for layer in LAYERS:
        entry = {
            "layer_idx": layer,
            "shape": list(maps[layer].shape),
            "dtype": meta["dtype"],
            "encoding": "gzip+base64",
            "data": pack(maps[layer].astype(np.dtype(np_dtype(meta)).newbyteorder("<"))),
        }
        if layer in indices:
            entry["indices"] = pack(indices[layer].astype("<i4"))
            entry["indices_dtype"] = "int32"
        data.append(entry)
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "choices": [{"index": 0, "text": " He smiled", "finish_reason": "length"}],
        "attn_capture_data": data,
        "attn_capture_meta": meta,
    }


def lantern(*args, check=True):
    proc = subprocess.run([str(_binary()), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"lantern {' '.join(map(str, args))} failed:\n{proc.stderr}"
    return proc


BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
]


def browse(html: Path, *flags) -> str:
    with tempfile.TemporaryDirectory(prefix="lantern-chromium-") as profile:
        proc = subprocess.run(
            [chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}", *flags, html.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.stdout


def page_status(html: Path) -> str:
    dom = browse(html, "--dump-dom")
    match = re.search(r'<body[^>]*\sdata-status="([^"]*)"', dom)
    assert match, "no data-status on <body> in the dumped DOM"
    error_box = re.search(r'<div id="error"[^>]*>(.*?)</div>', dom, re.S)
    assert error_box is not None and error_box.group(1).strip() == "", error_box and error_box.group(1)
    return match.group(1)


def screenshot(html: Path, png: Path) -> np.ndarray:
    browse(html, f"--screenshot={png}", "--window-size=1200,900")
    assert png.exists(), "chromium wrote no screenshot"
    return np.asarray(Image.open(png).convert("RGB"))


@pytest.fixture
def workdir():
    with tempfile.TemporaryDirectory(prefix="lantern-attn-view-") as d:
        yield Path(d)


def test_view_renders_the_map(workdir):
    meta, maps, indices = make_capture(seed=1)
    capture = workdir / "capture.safetensors"
    write_safetensors(capture, meta, maps, indices)
    out = lantern("attn", "view", capture)
    html = workdir / "capture.html"
    assert html.exists(), out.stdout
    page = html.read_text()
    assert "<script src" not in page and "http://" not in page and "https://" not in page
    assert page_status(html) == "ok"

    png = Path(os.environ.get("LANTERN_ATTN_SCREENSHOT", workdir / "view.png"))
    pixels = screenshot(html, png)
    # The heatmap: saturated (viridis) pixels, many colours, over a large area.
    rgb = pixels.astype(int)
    saturated = (rgb.max(axis=-1) - rgb.min(axis=-1)) > 40
    colours = {tuple(p) for p in pixels[saturated]}
    assert len(colours) > 60, f"only {len(colours)} distinct heatmap colours"
    ys, xs = np.nonzero(saturated)
    assert xs.max() - xs.min() > 400 and ys.max() - ys.min() > 400, (xs.min(), xs.max(), ys.min(), ys.max())
    # The upper triangle is masked: light grey cells, not colours.
    masked = (np.abs(rgb - np.array([0xE4, 0xE4, 0xEA])).max(axis=-1) <= 2).sum()
    assert masked > 20_000, f"{masked} masked-grey pixels"


def test_view_of_a_top_k_json_response(workdir):
    meta, maps, indices = make_capture(seed=2, reduce="mean_heads", top_k=5, dtype="float16")
    response = workdir / "response.json"
    response.write_text(json.dumps(response_json(meta, maps, indices)))
    html = workdir / "page.html"
    lantern("attn", "view", response, "-o", html)
    assert page_status(html) == "ok"
    pixels = screenshot(html, workdir / "topk.png")
    dropped = (np.abs(pixels.astype(int) - np.array([0xF5, 0xEE, 0xDC])).max(axis=-1) <= 2).sum()
    assert dropped > 20_000, f"{dropped} not-in-top-k pixels"


def test_view_escapes_token_text(workdir):
    meta, maps, indices = make_capture(seed=3)
    meta["tokens"][3]["text"] = "</script><script>window.hacked=1</script>"
    capture = workdir / "x.safetensors"
    write_safetensors(capture, meta, maps, indices)
    lantern("attn", "view", capture)
    page = (workdir / "x.html").read_text()
    assert "window.hacked" in page and "</script><script>window.hacked" not in page
    assert page_status(workdir / "x.html") == "ok"


@pytest.mark.parametrize(
    "kind", [dict(), dict(reduce="max_heads", top_k=4), dict(dtype="float16"), dict(top_k=3, dtype="float16")]
)
def test_export_npy(workdir, kind):
    meta, maps, indices = make_capture(seed=4, **kind)
    capture = workdir / "capture.json"
    capture.write_text(json.dumps(response_json(meta, maps, indices)))
    out = workdir / "npy"
    lantern("attn", "export", capture, "--format", "npy", "-o", out)
    assert json.loads((out / "meta.json").read_text()) == meta
    for layer in LAYERS:
        values = np.load(out / f"layer_{layer}.npy")
        assert values.dtype == np_dtype(meta)
        np.testing.assert_array_equal(values.astype(np.float32), maps[layer])
        if indices:
            got = np.load(out / f"layer_{layer}.indices.npy")
            assert got.dtype == np.int32
            np.testing.assert_array_equal(got, indices[layer])
        else:
            assert not (out / f"layer_{layer}.indices.npy").exists()


@pytest.mark.parametrize("kind", [dict(), dict(top_k=6, dtype="float16")])
def test_export_safetensors(workdir, kind):
    meta, maps, indices = make_capture(seed=5, **kind)
    source = workdir / "in.safetensors"
    write_safetensors(source, meta, maps, indices)
    out = workdir / "out.safetensors"
    lantern("attn", "export", source, "--format", "safetensors", "-o", out)
    metadata, tensors = read_safetensors(out)
    assert metadata["format"] == FORMAT
    assert json.loads(metadata["lantern.capture"]) == meta
    expected = {f"layer.{layer}" for layer in LAYERS} | {f"layer.{layer}.indices" for layer in indices}
    assert set(tensors) == expected
    for layer in LAYERS:
        assert tensors[f"layer.{layer}"].dtype == np_dtype(meta)
        np.testing.assert_array_equal(tensors[f"layer.{layer}"].astype(np.float32), maps[layer])
        if indices:
            np.testing.assert_array_equal(tensors[f"layer.{layer}.indices"], indices[layer])


def test_errors_name_the_problem(workdir):
    missing = lantern("attn", "view", workdir / "nope.safetensors", check=False)
    assert missing.returncode != 0 and "nope.safetensors" in missing.stderr, missing.stderr
    assert "panicked" not in missing.stderr

    junk = workdir / "junk.bin"
    junk.write_bytes(b"\x00\x01 not a capture")
    out = lantern("attn", "view", junk, check=False)
    assert out.returncode != 0 and "not a lantern attention capture" in out.stderr, out.stderr

    meta, maps, indices = make_capture(seed=6)
    response = response_json(meta, maps, indices)
    del response["attn_capture_data"]
    response["attn_capture_id"] = "cap-" + "0" * 32
    ref = workdir / "ref.json"
    ref.write_text(json.dumps(response))
    out = lantern("attn", "export", ref, "--format", "npy", "-o", workdir / "o", check=False)
    assert out.returncode != 0 and "by reference" in out.stderr, out.stderr

    response = response_json(meta, maps, indices)
    response["attn_capture_data"][1]["shape"] = [23, 3, 22]
    bad = workdir / "bad.json"
    bad.write_text(json.dumps(response))
    out = lantern("attn", "view", bad, check=False)
    assert out.returncode != 0 and "layer 5" in out.stderr, out.stderr
    for proc in (out,):
        assert "panicked" not in proc.stderr
