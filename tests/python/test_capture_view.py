"""The capture viewer of a real `lantern serve`: `GET /v1/captures/{id}/view` renders the
stored capture in headless Chromium (fetching it with the key after `#key=`), a notebook's
`cap.to_html()` renders the same page offline, and bertviz (PyPI) draws a head view of a
real capture from `cap.to_bertviz()`. docs/capture-format.md describes exactly what this
server sends, and its Python blocks read it."""

import html
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import API_KEY, ROOT, start_server, stop_server
from test_attn_view import BROWSER_FLAGS, chromium
from test_helper_edges import FORMAT_DOC, format_doc_tables, run_format_doc

sys.path.insert(0, str(ROOT / "clients" / "python"))
import lantern_attn  # noqa: E402

PROMPT = "The lighthouse keeper climbed the stairs"
LAYERS = [0, 15, 29]


@pytest.fixture(scope="module")
def view_server():
    with tempfile.TemporaryDirectory(prefix="lantern-captures-") as capture_dir:
        srv = start_server("--enable-attention-capture", "--capture-dir", capture_dir)
        yield srv
        stop_server(srv)


@pytest.fixture(scope="module")
def stored(view_server):
    """A capture kept on the server (delivery "reference"), and its request's response."""
    r = view_server.client().completions.create(
        model=view_server.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        extra_body={"attn_capture": True, "attn_capture_layers": LAYERS, "attn_capture_delivery": "reference",
                    "ignore_eos": True},
    )
    return r


def dump_dom(url: str) -> str:
    with tempfile.TemporaryDirectory(prefix="lantern-chromium-") as profile:
        proc = subprocess.run(
            [chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
            capture_output=True, text=True, timeout=180,
        )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc.stdout


def page_state(dom: str) -> dict:
    status = re.search(r'<body[^>]*\sdata-status="([^"]*)"', dom)
    label = re.search(r'<canvas id="map"[^>]*aria-label="([^"]*)"', dom)
    return {
        "status": status and html.unescape(status.group(1)),
        "label": label and html.unescape(label.group(1)),
        "layers": re.findall(r"<option value=\"\d+\">layer (\d+)</option>", dom),
        "heads": re.findall(r"<option value=\"\d+\">head (\d+)</option>", dom),
    }


def check_shows(state: dict, cap: "lantern_attn.Capture"):
    assert state["status"] == "ok", state
    assert [int(x) for x in state["layers"]] == LAYERS
    assert [int(x) for x in state["heads"]] == list(range(9))
    # The map's description names its tokens: the prompt and what was generated.
    label = state["label"]
    assert f"{len(cap.row_positions)} queries" in label, label
    for text in cap.tokens:
        assert json.dumps(text, ensure_ascii=False) in label, (text, label)


def test_view_endpoint(view_server, stored):
    url = f"{view_server.base_url}/v1/captures/{stored.attn_capture_id}/view"
    page = requests.get(url, timeout=30)  # no key: the page itself holds no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<!doctype html>" in page.text and f'"url":"../{stored.attn_capture_id}"' in page.text
    unknown = requests.get(f"{view_server.base_url}/v1/captures/cap-{'0' * 32}/view", timeout=30)
    assert unknown.status_code == 404 and "no capture" in unknown.json()["error"]["message"]

    cap = lantern_attn.from_response(stored, client=view_server.client())
    check_shows(page_state(dump_dom(f"{url}#key={API_KEY}")), cap)
    # Without the key, the fetch is refused and the page says what to do.
    state = page_state(dump_dom(url))
    assert state["status"].startswith("error") and "#key=" in state["status"], state


def test_notebook_html_renders_offline(view_server, stored, tmp_path):
    cap = lantern_attn.from_response(stored, client=view_server.client())
    page = tmp_path / "capture.html"
    page.write_text(cap.to_html(title="notebook"))
    check_shows(page_state(dump_dom(page.resolve().as_uri())), cap)


# bertviz's page loads require.js, d3 and jQuery from a CDN; offline they come from
# Debian's packages (scripts/test-python installs them).
LOCAL_JS = {
    "require": "/usr/share/javascript/requirejs/require.min.js",
    "d3": "/usr/share/javascript/d3/d3.min.js",
    "jquery": "/usr/share/javascript/jquery/jquery.min.js",
}

RENDER_HEAD_VIEW = """
import sys
import lantern_attn
from bertviz import head_view
cap = lantern_attn.load(sys.argv[1])
attention, tokens = cap.to_bertviz()
assert type(attention[0]).__module__.startswith("torch"), type(attention[0])
sys.stdout.write(head_view(attention, tokens, html_action="return").data)
"""


def bertviz_python():
    """A Python that has torch and bertviz: this one, or Debian's with its python3-torch
    and the bertviz that scripts/test-python puts in target/bertviz-site. None, and why
    not, when there is none."""
    site = ROOT / "target" / "bertviz-site"
    candidates = [(sys.executable, {}), ("/usr/bin/python3", {"PYTHONPATH": str(site)})]
    reasons = []
    for python, env in candidates:
        if not Path(python).exists():
            continue
        probe = subprocess.run([python, "-c", "import torch, bertviz, IPython"], capture_output=True, text=True,
                               env=dict(os.environ, **env))
        if probe.returncode == 0:
            return python, env
        reasons.append(f"{python}: {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'fails'}")
    return None, "; ".join(reasons)


def test_bertviz_head_view_of_a_real_capture(view_server, tmp_path):
    python, env = bertviz_python()
    if python is None:
        message = f"bertviz needs torch, and no Python here has torch and bertviz ({env}); " \
                  "scripts/test-python installs them with LANTERN_TEST_BERTVIZ=1"
        print(message)
        pytest.skip(message)
    missing = [path for path in LOCAL_JS.values() if not Path(path).exists()]
    if missing:
        pytest.skip(f"no {missing} (apt-get install libjs-requirejs libjs-d3 libjs-jquery)")
    r = view_server.client().completions.create(
        model=view_server.model, prompt=PROMPT, max_tokens=3, temperature=0,
        extra_body={"attn_capture": True, "attn_capture_layers": LAYERS, "ignore_eos": True},
    )
    cap = lantern_attn.from_response(r)
    saved = tmp_path / "capture.safetensors"
    lantern_attn.save_safetensors(cap, saved)
    env = dict(os.environ, **env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "clients" / "python"), env.get("PYTHONPATH")]))
    out = subprocess.run([python, "-c", RENDER_HEAD_VIEW, str(saved)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    view = out.stdout
    view = re.sub(r'<script src="[^"]*require[^"]*"', f'<script src="file://{LOCAL_JS["require"]}"', view)
    view = re.sub(r"d3: '[^']*'", f"d3: 'file://{LOCAL_JS['d3'][:-3]}'", view)
    view = re.sub(r"jquery: '[^']*'", f"jquery: 'file://{LOCAL_JS['jquery'][:-3]}'", view)
    config = view[view.index("require.config"):view.index("requirejs(")]
    assert "https://" not in config and "https://" not in view[: view.index("<div")], "a script left online"
    page = tmp_path / "head_view.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'></head><body>{view}</body></html>")
    dom = dump_dom(page.resolve().as_uri())
    # The head view: one layer option per captured layer, a token box per position on
    # each side, and the attention lines between them.
    layers = re.findall(r'<option value="(\d+)">\d+</option>', dom)
    assert len(layers) == len(LAYERS), layers
    texts = [html.unescape(t) for t in re.findall(r'<text[^>]*>([^<]*)</text>', dom)]
    for token in cap.tokens:
        assert texts.count(token) >= 2 or not token.strip(), (token, texts)
    assert len(re.findall(r"<line ", dom)) >= cap.total_len, "no attention lines drawn"


def test_capture_format_doc_is_what_the_server_sends(view_server, tmp_path, monkeypatch):
    """docs/capture-format.md lists exactly the fields the server sends, for each
    delivery, and its readers (numpy and safetensors alone) read the real thing."""
    tables = format_doc_tables()
    meta_keys, attention_keys = map(set, tables["The meta"])
    (inline_keys,) = map(set, tables['Inline JSON (delivery `"inline"`)'])
    (tensor_names,) = tables['Safetensors (deliveries `"reference"` and `"file"`)']
    (reference_keys,) = map(set, tables['Delivery `"reference"` and `GET /v1/captures/{id}`'])
    (file_keys,) = map(set, tables['Delivery `"file"`'])
    top_k_only = {"indices", "indices_dtype"}

    def complete(**capture):
        body = {"model": view_server.model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                "ignore_eos": True, "attn_capture": True, "attn_capture_layers": LAYERS, **capture}
        r = requests.post(f"{view_server.base_url}/v1/completions", json=body, headers=view_server.headers(),
                          timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def fields(body):
        return {k for k in body if k.startswith("attn_capture")}

    # Inline: the meta, its layer_attention objects and the data entries, dense and top-k.
    dense = complete()
    assert fields(dense) == {"attn_capture_data", "attn_capture_meta"}
    assert set(dense["attn_capture_meta"]) == meta_keys
    assert all(set(info) == attention_keys for info in dense["attn_capture_meta"]["layer_attention"])
    assert all(set(entry) == inline_keys - top_k_only for entry in dense["attn_capture_data"])
    top_k = complete(attn_capture_top_k=4, attn_capture_dtype="float16", attn_capture_reduce="mean_heads")
    assert all(set(entry) == inline_keys for entry in top_k["attn_capture_data"])
    # What the doc says of the values: keys 0..n-1, one run of rows, the last token's
    # reason word for word, top-k sorted descending.
    meta = dense["attn_capture_meta"]
    assert meta["key_positions"] == list(range(len(meta["key_positions"])))
    assert meta["row_positions"] == list(range(meta["row_positions"][0], meta["row_positions"][-1] + 1))
    assert [a["position"] for a in meta["absent_rows"]] == [meta["total_len"] - 1]
    assert meta["absent_rows"][0]["reason"] in FORMAT_DOC.read_text(encoding="utf-8")
    for values in lantern_attn.from_response(top_k).layers.values():
        assert np.all(np.diff(values.astype(np.float32), axis=-1) <= 0)

    # By reference: the response's fields, then GET /v1/captures/{id}'s headers and file.
    reference = complete(attn_capture_delivery="reference", attn_capture_top_k=4)
    assert fields(reference) == reference_keys, reference
    cid = reference["attn_capture_id"]
    assert re.fullmatch(r"cap-[0-9a-f]{32}", cid) and isinstance(reference["attn_capture_expires_in"], int)
    got = requests.get(f"{view_server.base_url}/v1/captures/{cid}", headers=view_server.headers(), timeout=60)
    assert got.status_code == 200
    assert got.headers["content-type"] == "application/octet-stream"
    assert got.headers["content-disposition"] == f'attachment; filename="{cid}.safetensors"'
    (n,) = struct.unpack("<Q", got.content[:8])
    header = json.loads(got.content[8 : 8 + n])
    metadata = header.pop("__metadata__")
    assert set(metadata) == {"format", "lantern.capture"} and metadata["format"] == lantern_attn.FORMAT
    assert json.loads(metadata["lantern.capture"]) == reference["attn_capture_meta"]
    assert set(header) == {name.replace("{L}", str(layer)) for name in tensor_names for layer in LAYERS}

    # As a file.
    file = complete(attn_capture_delivery="file")
    assert fields(file) == file_keys, file
    assert re.fullmatch(r"lantern-capture-[0-9a-f]{32}\.safetensors", Path(file["attn_capture_path"]).name)

    # The doc's readers, as written: the inline top-k response, then the stored capture
    # as its download block fetches it.
    (tmp_path / "response.json").write_text(json.dumps(top_k))
    cap = lantern_attn.from_response(top_k)
    ran = run_format_doc(tmp_path, monkeypatch, cap.meta, cap.layers, cap.indices, kinds={"inline", "use"})
    assert ran == ["inline", "use"]
    cap = lantern_attn.from_response(reference, client=view_server.client())
    ran = run_format_doc(tmp_path, monkeypatch, cap.meta, cap.layers, cap.indices, base_url=f"{view_server.base_url}/v1",
                         api_key=API_KEY, response=reference, kinds={"download", "safetensors", "numpy-safetensors"})
    assert ran[0] == "download" and "numpy-safetensors" in ran, ran
