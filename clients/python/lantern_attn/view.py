"""The capture viewer (view.html, the page `lantern attn view` writes and the server
serves) with a capture inside, for files and notebooks."""

from __future__ import annotations

import base64
import html
import json
from importlib import resources
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
    from .capture import Capture

#: Where the page's data goes.
DATA_SLOT = "/*LANTERN_CAPTURE_JSON*/"


def template() -> str:
    return resources.files(__package__).joinpath("view.html").read_text(encoding="utf-8")


def _b64(array: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(array, dtype=dtype).tobytes()).decode("ascii")


def to_html(cap: "Capture", title: Optional[str] = None) -> str:
    """See `Capture.to_html`: values as base64 little-endian float32 (top-k values with
    their int32 key positions, which the page scatters), as `lantern attn view` writes;
    key statistics and span masses likewise, in `stats` and `span_mass`."""
    layers = []
    # A capture of statistics or spans alone (meta "maps": false) has no maps.
    for layer in cap.meta["layers"] if cap.meta.get("maps", True) else []:
        values = cap.layers[layer]
        indices = cap.indices.get(layer)
        layers.append(
            {
                "layer_idx": layer,
                "shape": list(values.shape),
                "values": _b64(values, "<f4"),
                "indices": None if indices is None else _b64(indices, "<i4"),
            }
        )
    # Key statistics and span masses, each {layer_idx, stat, shape, values} with the
    # values as base64 little-endian float32, layer by layer (statistics in meta order).
    stats = [
        {"layer_idx": layer, "stat": stat, "shape": list(cap.stats[layer][stat].shape),
         "values": _b64(cap.stats[layer][stat], "<f4")}
        for layer in cap.meta["layers"] if layer in cap.stats
        for stat in cap.meta.get("stats") or [] if stat in cap.stats[layer]
    ]
    span_mass = [
        {"layer_idx": layer, "stat": "span_mass", "shape": list(cap.span_mass[layer].shape),
         "values": _b64(cap.span_mass[layer], "<f4")}
        for layer in cap.meta["layers"] if layer in cap.span_mass
    ]
    data = {"source": title or "lantern capture", "meta": cap.meta, "layers": layers,
            "stats": stats, "span_mass": span_mass}
    # Inside <script>, "</script>" in a token must not end the element: `<` only occurs
    # in JSON strings, where \u003c means the same.
    text = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")
    page = template()
    if page.count(DATA_SLOT) != 1:
        raise RuntimeError("view.html has no data slot")
    return page.replace(DATA_SLOT, text)


def notebook_html(cap: "Capture", height: int = 640) -> str:
    """The page in an iframe, so that its scripts and ids stay out of the notebook's."""
    page = html.escape(to_html(cap), quote=True)
    return (
        f'<iframe srcdoc="{page}" style="width: 100%; height: {height}px; border: 0" '
        'title="lantern attention capture"></iframe>'
    )
