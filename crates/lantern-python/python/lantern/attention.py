"""A finished capture as numpy arrays: ``lantern_attn.Capture`` (``dense()``,
``to_hf()``, ``to_html()``, ...) made from the engine's own buffers rather than a
wire format."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
from lantern_attn import Capture


class Attention(Capture):
    """The attention maps one request captured.

    Attributes:
        meta: the same dict as the server's ``attn_capture_meta`` for that request.
        maps: ``{layer: np.ndarray [rows, heads, keys]}`` (float32, or float16 as
            asked), in ``meta["layers"]`` order; the same values as the server's.
        indices: ``{layer: np.ndarray int32}`` of key positions, with top-k only.
        stats: ``{layer: {"key_mass" | "key_max" | "block_mass": np.ndarray float32}}``
            with ``capture={"stats": [...]}`` (see docs/attention-capture.md, "Key
            statistics"); ``maps`` is empty when only statistics were asked for.
        span_mass: ``{layer: np.ndarray float32 [rows, groups, spans + 1]}`` with
            ``capture={"spans": [...]}`` (docs/attention-capture.md, "Spans"); the last
            column is the mass outside every span.
    """

    def __init__(
        self,
        meta: Dict[str, Any],
        maps: List[np.ndarray],
        indices: Optional[List[np.ndarray]],
        stats: Optional[List[tuple]] = None,
        span_mass: Optional[List[tuple]] = None,
    ):
        layers = list(meta["layers"]) if meta.get("maps", True) else []
        by_layer: Dict[int, Dict[str, np.ndarray]] = {}
        for layer, name, values in stats or []:
            by_layer.setdefault(layer, {})[name] = values
        super().__init__(
            meta,
            dict(zip(layers, maps)),
            dict(zip(layers, indices)) if indices is not None else {},
            by_layer,
            dict(span_mass or []),
        )

    @property
    def maps(self) -> Dict[int, np.ndarray]:
        return self.layers
