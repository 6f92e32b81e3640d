"""The capture viewer's views of key statistics and span masses, from a real `lantern
serve` (SmolLM2) through the official openai client, rendered in headless Chromium:
`cap.to_html()` of a capture of statistics alone shows a heat strip with one cell per key
coloured like key_mass (and key_max, and block_mass per block) and no heatmap; of a
capture of spans, one stacked bar per generated row whose parts are the row's span
masses, labelled; `GET /v1/captures/{id}/view` reads the same from the safetensors file,
beside today's heatmap when the maps were asked for; and no page logs a JavaScript
error."""

import html
import http.server
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import requests

from conftest import API_KEY, ROOT, start_server, stop_server
from test_attn_view import BROWSER_FLAGS, chromium

sys.path.insert(0, str(ROOT / "clients" / "python"))
import lantern_attn  # noqa: E402
import lantern_attn.view  # noqa: E402

PASSAGES = [
    "The Eiffel Tower is 330 metres tall and stands in Paris.",
    "Tokyo Tower, completed in 1958, is 333 metres tall.",
]
QUESTION = "Question: how tall is Tokyo Tower? Answer:"
PROMPT = "".join(f"[{i + 1}] {p}\n" for i, p in enumerate(PASSAGES)) + QUESTION
SPANS = [{"label": f"[{i + 1}]", "chars": [PROMPT.index(p), PROMPT.index(p) + len(p)]}
         for i, p in enumerate(PASSAGES)] + [
    {"label": "question", "chars": [PROMPT.index(QUESTION), len(PROMPT)]}]
MAX_TOKENS = 6

# The page's colour map (view.html): viridis at 10 stops, interpolated to 256 entries.
STOPS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e",
         "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"]


def lut() -> list:
    stops = [[int(h[i:i + 2], 16) for i in (1, 3, 5)] for h in STOPS]
    out = []
    for i in range(256):
        x = i / 255 * (len(stops) - 1)
        j = min(int(x), len(stops) - 2)
        f = x - j
        out.append(tuple(int(np.floor(c + (stops[j + 1][k] - c) * f + 0.5)) for k, c in enumerate(stops[j])))
    return out


LUT = lut()


@pytest.fixture(scope="module")
def srv():
    server = start_server("--enable-attention-capture")
    yield server
    stop_server(server)


def complete(srv, **fields):
    return srv.client().completions.create(
        model=srv.model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"attn_capture": True, "attn_capture_rows": "generated", "ignore_eos": True, **fields},
    )


# Runs before the page's script: records what the page logs and any error it throws.
RECORDER = """<script>
window.__errors = [];
for (const level of ["error", "warn"]) {
  const original = console[level];
  console[level] = function () { window.__errors.push(level + ": " + Array.from(arguments).join(" ")); return original.apply(console, arguments); };
}
window.addEventListener("error", (e) => window.__errors.push("error: " + e.message));
window.addEventListener("unhandledrejection", (e) => window.__errors.push("rejection: " + e.reason));
</script>"""

# Runs once the page shows the capture: for each setting (layer index, group index,
# statistic), selects it and records the strip's cells, the bars, and the tip over the
# first key cells; the result goes in data-probe.
PROBE = """<script>
(function probe() {
  const status = document.body.dataset.status;
  if (status === "loading") { setTimeout(probe, 20); return; }
  const $ = (id) => document.getElementById(id);
  const rgb = (e) => (e.style.background.match(/\\d+/g) || []).slice(0, 3).map(Number);
  const shown = (id) => $(id) !== null && getComputedStyle($(id)).display !== "none";
  const results = [];
  if (status === "ok") for (const [layer, group, stat] of __SETTINGS__) {
    for (const [id, value] of [["layer", layer], ["group", group], ["stat", stat]]) {
      if (value === null || $(id).value === String(value)) continue;
      $(id).value = String(value);
      $(id).dispatchEvent(new Event("change"));
    }
    const keys = [...document.querySelectorAll("#strip .keys span")];
    const tips = keys.slice(0, 12).map((cell) => {
      const box = cell.getBoundingClientRect();
      cell.dispatchEvent(new MouseEvent("mousemove", { clientX: box.left + 1, clientY: box.top + 1, bubbles: true }));
      return $("tip").style.display === "block" ? $("tip").textContent : null;
    });
    const barTips = [...document.querySelectorAll("#bars .row:not(.mean) .track span:first-child")].map((part) => {
      const box = part.getBoundingClientRect();
      part.dispatchEvent(new MouseEvent("mousemove", { clientX: box.left + 1, clientY: box.top + 1, bubbles: true }));
      return $("tip").style.display === "block" ? $("tip").textContent : null;
    });
    results.push({
      barTips,
      keys: keys.map((c) => [Number(c.dataset.k), rgb(c)]),
      blocks: [...document.querySelectorAll("#strip .blocks span")].map((c) => [Number(c.dataset.b), rgb(c)]),
      tips,
      rows: [...document.querySelectorAll("#bars .row")].map((row) => ({
        r: row.dataset.r === undefined ? null : Number(row.dataset.r),
        position: row.dataset.position === undefined ? null : Number(row.dataset.position),
        total: Number(row.dataset.total),
        text: row.querySelector(".tok").textContent,
        parts: [...row.querySelectorAll(".track span")].map((p) => [p.dataset.label, Number(p.dataset.mass), parseFloat(p.style.width)]),
      })),
      legend: [...document.querySelectorAll("#spans-legend [data-label]")].map((e) => e.dataset.label),
      groups: [...$("group").options].map((o) => o.textContent),
    });
  }
  document.body.dataset.probe = JSON.stringify({
    results, errors: window.__errors || [],
    map: shown("wrap"), stats: shown("stats"), spans: shown("spans"),
    label: $("map").getAttribute("aria-label"), info: $("info").textContent,
  });
})();
</script>"""


def browse(url: str) -> tuple:
    """Loads `url` in headless Chromium with the probe; (status, probe, console lines)."""
    with tempfile.TemporaryDirectory(prefix="lantern-chromium-") as profile:
        proc = subprocess.run(
            [chromium(), *BROWSER_FLAGS, f"--user-data-dir={profile}", "--window-size=1200,900",
             "--enable-logging=stderr", "--v=0", "--dump-dom", url],
            capture_output=True, text=True, timeout=180,
        )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    status = re.search(r'<body[^>]*\sdata-status="([^"]*)"', proc.stdout)
    found = re.search(r'<body[^>]*\sdata-probe="([^"]*)"', proc.stdout)
    assert found, f"the probe did not run (status {status and status.group(1)!r}):\n" + "\n".join(console)
    return status and html.unescape(status.group(1)), json.loads(html.unescape(found.group(1))), console


def instrument(page: str, settings: list) -> str:
    """The page with the recorder first and the probe (for `settings`) last."""
    assert page.count("<head>") == 1 and page.count("</body>") == 1
    probe = PROBE.replace("__SETTINGS__", json.dumps(settings))
    return page.replace("<head>", "<head>" + RECORDER).replace("</body>", probe + "</body>")


def probe_html(page: str, workdir: Path, settings: list) -> tuple:
    path = workdir / "view.html"
    path.write_text(instrument(page, settings), encoding="utf-8")
    return browse(path.resolve().as_uri())


SLOT = re.compile(r'<script type="application/json" id="capture">(.*?)</script>', re.S)


def probe_served(srv, capture_id: str, settings: list) -> tuple:
    """`/v1/captures/{id}/view` of the server, instrumented: a local proxy serves the page
    with the probe added, and passes the page's fetch of `../{id}` (with the key from
    `#key=`) on to lantern unchanged, so that the page reads the server's safetensors
    file. The page is this checkout's view.html with the data the server put in its slot
    (the server compiles view.html in: a binary built before the page changed serves
    the page as it was then)."""

    class Proxy(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            headers = {k: v for k, v in self.headers.items() if k.lower() == "authorization"}
            r = requests.get(srv.base_url + self.path, headers=headers, timeout=30)
            body = r.content
            if self.path.endswith("/view") and r.status_code == 200:
                slot = json.loads(SLOT.search(r.text).group(1))
                assert slot == {"source": capture_id, "url": f"../{capture_id}"}, slot
                page = lantern_attn.view.template().replace(lantern_attn.view.DATA_SLOT, json.dumps(slot), 1)
                body = instrument(page, settings).encode("utf-8")
            self.send_response(r.status_code)
            self.send_header("Content-Type", r.headers.get("content-type", "application/octet-stream"))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        return browse(f"http://127.0.0.1:{proxy.server_port}/v1/captures/{capture_id}/view#key={API_KEY}")
    finally:
        proxy.shutdown()
        proxy.server_close()


def check_clean(status, probe, console):
    assert status == "ok", status
    assert probe["errors"] == [], probe["errors"]
    assert console == [], "the page logged:\n" + "\n".join(console)


def check_strip(cells: list, values: np.ndarray, what: str):
    """One cell per entry, in order, each the colour of its value on the page's √ scale
    (the default), so that colours order as the values do."""
    assert [k for k, _ in cells] == list(range(len(values))), f"{what}: one cell per entry, in order"
    top = float(values.max())
    levels = []
    for (k, colour), v in zip(cells, values.astype(np.float64)):
        level = int(np.floor(np.sqrt(v / top) * 255 + 0.5))
        assert tuple(colour) == LUT[level], (what, k, v, colour, LUT[level])
        levels.append(LUT.index(tuple(colour)))
    order = np.argsort(values, kind="stable")
    assert np.all(np.diff(np.array(levels)[order]) >= 0), f"{what}: colours do not order like the values"
    assert levels[int(values.argmax())] == 255, f"{what}: the largest is the top colour"
    assert len(set(levels)) > 1, f"{what}: one colour for every cell"


def shown_token(text: str) -> str:
    """A token as the page labels it (view.html's `shown`)."""
    s = text.replace("\n", "\u21b5").replace("\t", "\u21e5").replace("\r", "")
    s = re.sub(r"^ +| +$", lambda m: "\u00b7" * len(m.group(0)), s)
    s = s or "\u2205"
    return s if len(s) <= 18 else s[:17] + "\u2026"


def check_bars(result: dict, cap: "lantern_attn.Capture", layer: int, group: int):
    mass = cap.span_mass[layer][:, group, :].astype(np.float64)  # [rows, spans + 1]
    labels = cap.span_labels
    assert labels[-1] == "other" and result["legend"] == labels
    rows = [row for row in result["rows"] if row["r"] is not None]
    assert [row["r"] for row in rows] == list(range(len(cap.row_positions)))
    assert [row["position"] for row in rows] == list(cap.row_positions)
    assert all(p >= cap.prompt_len for p in cap.row_positions), "the rows are the generated tokens"
    for row, expected in zip(rows, mass):
        # Each part is one span's mass, labelled, as wide as its share of the track.
        assert [label for label, _, _ in row["parts"]] == labels
        parts = np.array([m for _, m, _ in row["parts"]])
        np.testing.assert_allclose(parts, expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(row["total"], expected.sum(), rtol=1e-6)
        np.testing.assert_allclose(parts.sum(), row["total"], rtol=1e-6)
        np.testing.assert_allclose(sum(w for _, _, w in row["parts"]), 100 * row["total"], rtol=1e-4)
        # The row's token beside it.
        assert row["text"] == f"{row['position']} {shown_token(cap.tokens[row['position']])}", row["text"]
    # Pointing at a row's first part names the row's token, the span and its mass.
    assert len(result["barTips"]) == len(rows)
    for row, tip in zip(rows, result["barTips"]):
        assert tip is not None and tip.startswith(f"row   {json.dumps(cap.tokens[row['position']])}  position "), tip
        assert f"{json.dumps(labels[0])}: " in tip, tip
    # The mean over the rows comes first.
    mean = [row for row in result["rows"] if row["r"] is None]
    assert len(mean) == 1 and result["rows"][0] is mean[0]
    np.testing.assert_allclose([m for _, m, _ in mean[0]["parts"]], mass.mean(axis=0), rtol=1e-5, atol=1e-7)


def test_statistics_alone_show_a_heat_strip_per_key(srv, tmp_path):
    r = complete(srv, attn_capture_stats=["key_mass", "key_max", "block_mass"])
    cap = lantern_attn.from_response(r)
    assert cap.layers == {} and cap.meta["maps"] is False
    layers = cap.meta["layers"]
    keys = len(cap.key_positions)
    block = cap.meta["block_size"]
    settings = [[0, 0, "key_mass"], [len(layers) - 1, 2, "key_mass"], [len(layers) - 1, 2, "key_max"]]
    status, probe, console = probe_html(cap.to_html(title="stats"), tmp_path, settings)
    check_clean(status, probe, console)
    assert not probe["map"] and probe["stats"] and not probe["spans"], "no heatmap without maps"
    assert "no maps" in probe["info"]
    for (layer_index, group, stat), result in zip(settings, probe["results"]):
        stats = cap.stats[layers[layer_index]]
        assert len(result["keys"]) == keys
        check_strip(result["keys"], stats[stat][group], f"layer {layers[layer_index]} {stat}")
        assert len(result["blocks"]) == -(-keys // block)
        check_strip(result["blocks"], stats["block_mass"][group], "block_mass")
        assert len(result["groups"]) == 3 and result["groups"][group].startswith(f"KV head {group} ")
        # Pointing at a cell names its token in full, with its statistics.
        for k, tip in enumerate(result["tips"]):
            assert tip is not None, k
            assert f"key    {json.dumps(cap.tokens[k])}  position {k}" in tip, tip
            assert "key_mass = " in tip and f"block {k // block} " in tip, tip


def test_spans_show_a_bar_per_generated_row(srv, tmp_path):
    r = complete(srv, attn_capture_spans=SPANS)
    cap = lantern_attn.from_response(r)
    assert cap.layers == {} and cap.stats == {}
    layers = cap.meta["layers"]
    settings = [[0, 0, None], [len(layers) - 1, 1, None]]
    status, probe, console = probe_html(cap.to_html(title="spans"), tmp_path, settings)
    check_clean(status, probe, console)
    assert not probe["map"] and not probe["stats"] and probe["spans"]
    for (layer_index, group, _), result in zip(settings, probe["results"]):
        assert result["keys"] == [] and len(result["rows"]) == MAX_TOKENS - 1 + 1  # rows and the mean
        check_bars(result, cap, layers[layer_index], group)


def test_view_endpoint_reads_statistics_and_spans_from_safetensors(srv):
    # With the maps: today's heatmap, and the strip and the bars below it.
    layers = [0, 29]
    r = complete(srv, attn_capture_delivery="reference", attn_capture_layers=layers, attn_capture_maps=True,
                 attn_capture_stats=["key_mass", "block_mass"], attn_capture_spans=SPANS,
                 attn_capture_stats_heads="mean")
    cap = lantern_attn.from_response(r, client=srv.client())
    status, probe, console = probe_served(srv, r.attn_capture_id, [[1, 0, None]])
    check_clean(status, probe, console)
    assert probe["map"] and probe["stats"] and probe["spans"]
    assert f"{len(cap.row_positions)} queries" in probe["label"]
    for text in cap.tokens:
        assert json.dumps(text, ensure_ascii=False) in probe["label"], text
    [result] = probe["results"]
    assert result["groups"] == ["mean of heads 0\u20138"]
    check_strip(result["keys"], cap.stats[29]["key_mass"][0], "key_mass")
    check_strip(result["blocks"], cap.stats[29]["block_mass"][0], "block_mass")
    check_bars(result, cap, 29, 0)

    # Without the maps: only the strip.
    r = complete(srv, attn_capture_delivery="reference", attn_capture_stats=["key_max"])
    cap = lantern_attn.from_response(r, client=srv.client())
    status, probe, console = probe_served(srv, r.attn_capture_id, [[3, 1, "key_max"]])
    check_clean(status, probe, console)
    assert not probe["map"] and probe["stats"] and not probe["spans"]
    [result] = probe["results"]
    assert result["blocks"] == []
    check_strip(result["keys"], cap.stats[3]["key_max"][1], "key_max")


def test_lantern_attn_view_shows_statistics_and_spans_of_a_file(srv, tmp_path):
    """`lantern attn view` on a file without maps (the CLI's page, compiled in): the strip
    and the bars read the statistics and span masses the file holds."""
    r = complete(srv, attn_capture_delivery="reference", attn_capture_layers=[0, -1],
                 attn_capture_stats=["key_mass", "block_mass"], attn_capture_spans=SPANS,
                 attn_capture_stats_heads="mean")
    got = requests.get(f"{srv.base_url}/v1/captures/{r.attn_capture_id}", headers=srv.headers(), timeout=60)
    assert got.status_code == 200
    capture = tmp_path / "cap.safetensors"
    capture.write_bytes(got.content)
    page = tmp_path / "cap.html"
    subprocess.run([str(ROOT / "target" / "release" / "lantern") if not os.environ.get("LANTERN_BIN")
                    else os.environ["LANTERN_BIN"], "attn", "view", str(capture), "-o", str(page)],
                   check=True, capture_output=True, timeout=120)
    cap = lantern_attn.load(capture)
    status, probe, console = probe_html(page.read_text(encoding="utf-8"), tmp_path, [[1, 0, None]])
    check_clean(status, probe, console)
    assert not probe["map"] and probe["stats"] and probe["spans"]
    [result] = probe["results"]
    check_strip(result["keys"], cap.stats[29]["key_mass"][0], "key_mass")
    check_strip(result["blocks"], cap.stats[29]["block_mass"][0], "block_mass")
    check_bars(result, cap, 29, 0)
