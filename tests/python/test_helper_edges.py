"""Edges of the lantern_attn package (clients/python), with no server:

- `to_bertviz()` gives torch tensors, and without torch raises an ImportError that says
  so (bertviz cannot use numpy arrays); checked here without torch (torch hidden) and
  with it (this Python if it has torch, else Debian's python3 with python3-torch);
- after a head reduction, `head_labels` and the repr say what the heads dimension of 1
  holds, while `heads` keeps listing the heads reduced over;
- the viewer page of `to_html()` at 128+ tokens, in headless Chromium: token labels
  thinned so that none overlaps, and every row's, column's and cell's token in full
  under the pointer;
- docs/capture-format.md: its Python blocks, run as written, read captures with numpy
  (and safetensors) alone, and its tables name the fields the helper reads.
"""

import html
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from test_attn_view import BROWSER_FLAGS, chromium
from test_capture_helper import HEADS, LAYERS, _Handler, capture_http, inline_response, make_capture  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "clients" / "python"))
import lantern_attn  # noqa: E402


def capture(**kind) -> "lantern_attn.Capture":
    meta, maps, indices, _ = make_capture(seed=21, **kind)
    return lantern_attn.from_response(inline_response(meta, maps, indices))


# ----------------------------------------------------------------------------- torch


def test_to_bertviz_without_torch_raises_import_error(monkeypatch):
    # A None entry in sys.modules makes `import torch` raise ImportError, as when it
    # is not installed.
    monkeypatch.setitem(sys.modules, "torch", None)
    cap = capture()
    with pytest.raises(ImportError, match=r"to_bertviz\(\) needs torch") as e:
        cap.to_bertviz()
    assert "to_hf()" in str(e.value), "the error names the numpy way"
    with pytest.raises(ImportError, match="torch"):
        cap.to_bertviz(return_tensors="pt")
    with pytest.raises(ImportError, match="torch"):
        cap.to_hf(return_tensors="pt")
    # numpy on purpose still works, and to_hf() is numpy by default.
    attention, tokens = cap.to_bertviz(return_tensors="np")
    assert all(isinstance(a, np.ndarray) for a in attention) and tokens == cap.tokens
    assert all(isinstance(a, np.ndarray) for a in cap.to_hf())


WITH_TORCH = """
import sys
import numpy as np
import torch
import lantern_attn
cap = lantern_attn.load(sys.argv[1])
attention, tokens = cap.to_bertviz()
assert all(isinstance(a, torch.Tensor) for a in attention), [type(a) for a in attention]
assert tokens == cap.tokens
assert attention.layers == list(cap.layers) and attention.head_labels == cap.head_labels
for ours, theirs in zip(cap.to_hf(), attention):
    assert np.array_equal(ours, theirs.numpy())
print("torch", torch.__version__, len(attention), "layers")
"""


def torch_python():
    """A Python with torch and numpy: this one, or Debian's (python3-torch)."""
    reasons = []
    for python in (sys.executable, "/usr/bin/python3"):
        if not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import torch, numpy"], capture_output=True, text=True)
        if probe.returncode == 0:
            return python, None
        reasons.append(f"{python}: {(probe.stderr.strip().splitlines() or ['fails'])[-1]}")
    return None, "; ".join(reasons)


def test_to_bertviz_with_torch_gives_tensors(tmp_path):
    python, why = torch_python()
    if python is None:
        message = f"no Python here has torch ({why}); apt-get install python3-torch"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    path = tmp_path / "cap.safetensors"
    lantern_attn.save_safetensors(capture(reduce="mean_heads"), path)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "clients" / "python"))
    out = subprocess.run([python, "-c", WITH_TORCH, str(path)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{len(LAYERS)} layers" in out.stdout, out.stdout


# ----------------------------------------------------------------------------- heads


@pytest.mark.parametrize("reduce", ["none", "mean_heads", "max_heads"])
@pytest.mark.parametrize("top_k", [None, 2])
def test_head_labels_say_what_the_heads_dimension_holds(reduce, top_k):
    cap = capture(reduce=reduce, top_k=top_k)
    # `heads` is the request's heads either way (the meta's), reduced over or not.
    assert cap.heads == HEADS
    for layer in LAYERS:
        assert len(cap.head_labels) == cap.layers[layer].shape[1] == cap.dense(layer).shape[1]
    hf = cap.to_hf()
    assert hf.heads == HEADS and hf.head_labels == cap.head_labels
    assert all(len(hf.head_labels) == a.shape[1] for a in hf)
    text = repr(cap)
    if reduce == "none":
        assert cap.head_labels == ["head 0", "head 2", "head 5"]
        assert "(rows × heads 0, 2, 5 × keys)" in text, text
    else:
        how = {"mean_heads": "mean", "max_heads": "max"}[reduce]
        assert cap.head_labels == [f"{how} of heads 0, 2, 5"]
        assert f"shape={cap.layers[0].shape} (rows × {how} of heads 0, 2, 5 × keys)" in text, text


def test_head_labels_shorten_runs_of_heads():
    meta, maps, indices, _ = make_capture(reduce="mean_heads")
    meta["heads"] = list(range(9))
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    assert cap.heads == list(range(9)) and cap.head_labels == ["mean of heads 0-8"]
    assert "mean of heads 0-8" in repr(cap)
    meta["heads"] = [0, 2, 3, 5, 6, 7, 9]
    cap = lantern_attn.from_response(inline_response(meta, maps, indices))
    assert cap.head_labels == ["mean of heads 0, 2, 3, 5-7, 9"]


# ----------------------------------------------------------------------------- viewer

WORDS = "The old light house keeper climbed the narrow stairs , lit the lamp and watched ships pass".split()
LONG_TOKEN = " supercalifragilisticexpialidocious"


def long_capture(total: int, top_k=None) -> "lantern_attn.Capture":
    """One layer, the mean of 9 heads, `total` tokens whose texts name their position
    (" lamp12"), one of them too long for a label and one a newline."""
    rows = total - 1
    rng = np.random.default_rng(total)
    m = rng.random((rows, 1, rows), dtype=np.float32) * np.tri(rows, dtype=np.float32)[:, None, :]
    m /= m.sum(axis=-1, keepdims=True)
    indices = {}
    if top_k:
        order = np.argsort(-m, axis=-1, kind="stable")[..., :top_k]
        m = np.take_along_axis(m, order, axis=-1)
        indices[0] = order.astype(np.int32)
    tokens = [{"id": i, "text": f" {WORDS[i % len(WORDS)]}{i}"} for i in range(total)]
    tokens[40]["text"] = LONG_TOKEN
    tokens[41]["text"] = "\n"
    meta = {
        "format": lantern_attn.FORMAT,
        "prompt_len": total - 10,
        "total_len": total,
        "tokens": tokens,
        "layers": [0],
        "heads": list(range(9)),
        "reduce": "mean_heads",
        "top_k": top_k,
        "dtype": "float32",
        "row_positions": list(range(rows)),
        "key_positions": list(range(rows)),
        "absent_rows": [{"position": rows, "reason": "the last generated token was never run through the model"}],
        "layer_attention": [{"layer_idx": 0, "scale": 0.125, "sliding_window": None, "chunk_size": None,
                             "logits_soft_cap": None, "has_sinks": False, "num_heads": 9, "num_kv_heads": 3}],
    }
    return lantern_attn.Capture(meta, {0: m}, indices)


# Runs before the page's script: records every text drawn on the map with where it went.
RECORDER = """<script>
window.__drawn = [];
const __fillText = CanvasRenderingContext2D.prototype.fillText;
CanvasRenderingContext2D.prototype.fillText = function (text, x, y) {
  if (this.canvas.id === "map") {
    const m = this.getTransform();
    window.__drawn.push({ text: String(text), x: m.a * x + m.c * y + m.e, y: m.b * x + m.d * y + m.f,
                          rotated: Math.abs(m.b) > 0.5, scale: Math.hypot(m.a, m.b), font: this.font });
  }
  return __fillText.apply(this, arguments);
};
</script>"""

# Runs once the page shows the capture: redraws it with the recorder empty, then moves
# the pointer down the row labels (x = 2), along the column labels (y = 2) and across
# the map's diagonal, noting the tip at every pixel; the result goes in data-probe.
PROBE = """<script>
(function probe() {
  const status = document.body.dataset.status;
  if (status === "loading") { setTimeout(probe, 20); return; }
  if (status !== "ok") return;
  window.__drawn.length = 0;
  document.getElementById("scale").dispatchEvent(new Event("change"));
  const overlay = document.getElementById("overlay"), tip = document.getElementById("tip");
  const box = overlay.getBoundingClientRect();
  const at = (x, y) => {
    overlay.dispatchEvent(new MouseEvent("mousemove", { clientX: box.left + x, clientY: box.top + y, bubbles: true }));
    return tip.style.display === "block" ? tip.textContent : null;
  };
  const rows = [], columns = [], diagonal = [];
  for (let y = 0; y < box.height; y++) rows.push(at(2, y));
  for (let x = 0; x < box.width; x++) columns.push(at(x, 2));
  const n = Math.ceil(Math.max(box.width, box.height));
  for (let i = 0; i < n; i++) diagonal.push(at((i * box.width) / n, (i * box.height) / n));
  document.body.dataset.probe = JSON.stringify({ drawn: window.__drawn, rows, columns, diagonal,
                                                 dpr: window.devicePixelRatio || 1 });
})();
</script>"""


def probe_page(cap, workdir: Path) -> dict:
    page = cap.to_html(title="long")
    assert page.count("<head>") == 1 and page.count("</body>") == 1
    page = page.replace("<head>", "<head>" + RECORDER).replace("</body>", PROBE + "</body>")
    path = workdir / "view.html"
    path.write_text(page, encoding="utf-8")
    with tempfile.TemporaryDirectory(prefix="lantern-chromium-") as profile:
        proc = subprocess.run(
            [chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}", "--window-size=1200,900", "--dump-dom",
             path.resolve().as_uri()],
            capture_output=True, text=True, timeout=180,
        )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    status = re.search(r'<body[^>]*\sdata-status="([^"]*)"', proc.stdout)
    assert status and status.group(1) == "ok", status and html.unescape(status.group(1))
    found = re.search(r'<body[^>]*\sdata-probe="([^"]*)"', proc.stdout)
    assert found, "the probe did not run"
    return json.loads(html.unescape(found.group(1)))


LABEL = re.compile(r"^(\d+) (.+)$")
TIP = re.compile(r'^(query|key) +(".*")  position (\d+)')


def labels(result: dict, rotated: bool) -> list:
    """(position, text, anchor along the axis, font height) of each token label drawn
    on one axis, in the map canvas's pixels."""
    out = []
    for d in result["drawn"]:
        if d["rotated"] != rotated or d["text"].startswith(("query ", "key ")):
            continue
        match = LABEL.match(d["text"])
        assert match, f"a label that names no token: {d['text']!r} (positions alone, not token text)"
        font = float(re.match(r"([\d.]+)px", d["font"]).group(1)) * d["scale"]
        out.append((int(match.group(1)), match.group(2), d["x"] if rotated else d["y"], font))
    return out


def tip_token(tip: str, kind: str) -> tuple:
    """(position, full text) of the `kind` line ("query" or "key") of a tip."""
    for line in tip.splitlines():
        match = TIP.match(line)
        if match and match.group(1) == kind:
            return int(match.group(3)), json.loads(match.group(2))
    raise AssertionError(f"no {kind} line in the tip {tip!r}")


def check_labels(cap, result: dict, count: int):
    """Every axis: token labels, at least a dozen, every stride-th one from the first,
    none overlapping the next."""
    strides = set()
    for rotated in (False, True):
        drawn = sorted(labels(result, rotated), key=lambda label: label[0])
        assert len(drawn) >= 12, f"only {len(drawn)} labels"
        positions = [p for p, _, _, _ in drawn]
        stride = positions[1] - positions[0]
        assert positions == list(range(0, count, stride)), positions
        strides.add(stride)
        for p, text, _, _ in drawn:
            token = cap.tokens[p]
            shown = "\u00b7" + token[1:] if token.startswith(" ") else token.replace("\n", "\u21b5")
            assert text == shown or (text.endswith("\u2026") and shown.startswith(text[:-1])), (p, text, token)
        anchors = sorted(anchor for _, _, anchor, _ in drawn)
        font = max(f for _, _, _, f in drawn)
        gaps = np.diff(anchors)
        assert gaps.min() >= font, f"labels {gaps.min():.1f} px apart, their font is {font:.1f} px tall"
    assert len(strides) == 1 and strides.pop() > 1, "both axes thinned alike"


def test_viewer_thins_labels_and_names_every_token_on_hover(tmp_path):
    total = 160
    cap = long_capture(total)
    count = total - 1  # rows and keys
    result = probe_page(cap, tmp_path)
    check_labels(cap, result, count)

    # The pointer on the row labels names every row's token in full; on the column
    # labels, every column's.
    for sweep, kind in ((result["rows"], "query"), (result["columns"], "key")):
        seen = {}
        for tip in filter(None, sweep):
            position, text = tip_token(tip, kind)
            seen[position] = text
        assert sorted(seen) == list(range(count)), f"{kind}: no tip for {set(range(count)) - set(seen)}"
        assert all(text == cap.tokens[p] for p, text in seen.items())
    assert result["rows"][0] is None, "nothing above the map's corner"
    # Each row label is where its row is: the tip at the label's height names it.
    scale = result["dpr"]
    for p, _, y, _ in labels(result, rotated=False):
        assert tip_token(result["rows"][int(y / scale)], "query")[0] == p
    for p, _, x, _ in labels(result, rotated=True):
        assert tip_token(result["columns"][int(x / scale)], "key")[0] == p

    # Cells: both tokens in full, the long one and the newline included.
    cells = [t for t in result["diagonal"] if t and "p = " in t]
    assert len(cells) >= count
    named = {tip_token(t, "query")[1] for t in cells} | {tip_token(t, "key")[1] for t in cells}
    assert LONG_TOKEN in named and "\n" in named


def test_viewer_labels_a_long_pooled_capture_without_overlap(tmp_path):
    total = 1500
    cap = long_capture(total, top_k=4)  # small to embed; the page scatters it
    result = probe_page(cap, tmp_path)
    check_labels(cap, result, total - 1)


# ----------------------------------------------------------------------------- the format doc

FORMAT_DOC = ROOT / "docs" / "capture-format.md"


def format_doc_tables() -> dict:
    """{section heading: [[first-column names of one table], ...]} of docs/capture-format.md."""
    sections, heading, table, code = {}, None, None, False
    for line in FORMAT_DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            code = not code
        if code:
            continue
        if line.startswith("#"):
            heading, table = line.lstrip("#").strip(), None
            continue
        name = re.match(r"^\| `([^`]+)`", line)
        if line.startswith("|"):
            if table is None:
                table = []
                sections.setdefault(heading, []).append(table)
            if name:
                table.append(name.group(1))
        else:
            table = None
    return sections


def run_format_doc(workdir: Path, monkeypatch, meta, maps, indices, base_url=None, api_key=None, response=None,
                   kinds=None):
    """Runs the Python blocks of docs/capture-format.md as written, in order, in
    `workdir`, which holds response.json (inline) and capture.safetensors; checks that
    each reader gives `meta`, `maps` and `indices`. The download block runs first,
    against `base_url` (for `response`), and writes capture.safetensors; the safetensors
    package's block runs when it is installed. `kinds` picks the blocks (default: all).
    Returns the kinds of block run."""
    monkeypatch.chdir(workdir)
    blocks = re.findall(r"```python\n(.*?)```", FORMAT_DOC.read_text(encoding="utf-8"), re.S)
    # The download first: the file readers then read what it wrote.
    blocks.sort(key=lambda block: "urllib.request" not in block)
    namespace, ran = {}, []
    for block in blocks:
        if "urllib.request" in block:
            if base_url is None:
                continue
            block = block.replace("http://127.0.0.1:8000/v1", base_url).replace("Bearer KEY", f"Bearer {api_key}")
            namespace["response"] = response
            kind = "download"
        elif "safe_open" in block:
            try:
                import safetensors  # noqa: F401
            except ImportError:
                print("docs/capture-format.md: the safetensors block needs `pip install safetensors`")
                continue
            kind = "safetensors"
        elif "struct.unpack" in block:
            kind = "numpy-safetensors"
        elif "attn_capture_stats_data" in block:
            kind = "stats"
        elif "attn_capture_span_data" in block:
            kind = "spans"
        elif "attn_capture_data" in block:
            kind = "inline"
        else:
            kind = "use"
        if kinds is not None and kind not in kinds:
            continue
        exec(compile(block, f"{FORMAT_DOC.name} ({kind})", "exec"), namespace)
        ran.append(kind)
        if kind in ("inline", "safetensors", "numpy-safetensors"):
            assert namespace["meta"] == meta, kind
            assert sorted(namespace["maps"]) == sorted(maps), kind
            for layer, want in maps.items():
                got = namespace["maps"][layer]
                assert got.dtype == want.dtype and np.array_equal(got, want), (kind, layer)
            assert sorted(namespace["indices"]) == sorted(indices), kind
            for layer, want in indices.items():
                assert np.array_equal(namespace["indices"][layer], want), (kind, layer)
        if kind == "use":
            assert 0 <= namespace["strongest"] < len(meta["key_positions"])
    return ran


def test_format_doc_reads_captures_with_numpy_alone(tmp_path, monkeypatch, capture_http):
    for kind in (dict(), dict(top_k=3, dtype="float16", reduce="max_heads")):
        meta, maps, indices, _ = make_capture(seed=31, **kind)
        (tmp_path / "response.json").write_text(json.dumps(inline_response(meta, maps, indices)))
        cap = lantern_attn.from_response(inline_response(meta, maps, indices))
        lantern_attn.save_safetensors(cap, tmp_path / "capture.safetensors")
        cid = "cap-" + "cd" * 16
        _Handler.store[cid] = (tmp_path / "capture.safetensors").read_bytes()
        ran = run_format_doc(tmp_path, monkeypatch, meta, maps, indices, base_url=capture_http,
                             api_key=_Handler.key, response={"attn_capture_id": cid})
        assert {"inline", "use", "download", "numpy-safetensors"} <= set(ran), ran


def test_format_doc_names_the_fields_lantern_attn_reads():
    """The meta's table lists exactly the fields the helper requires."""
    from lantern_attn.capture import _META_FIELDS

    tables = format_doc_tables()
    assert set(tables["The meta"][0]) == set(_META_FIELDS)
    meta, _, _, _ = make_capture()
    assert set(tables["The meta"][1]) == set(meta["layer_attention"][0])
