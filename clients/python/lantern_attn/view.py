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
    their int32 key positions, which the page scatters), as `lantern attn view` writes."""
    layers = []
    for layer in cap.meta["layers"]:
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
    data = {"source": title or "lantern capture", "meta": cap.meta, "layers": layers}
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
