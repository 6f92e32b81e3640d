"""Reading lantern attention captures into numpy arrays, with token labels.

numpy and the standard library only (it never unpickles anything). The wire format is
docs/capture-format.md; the user guide is docs/attention-capture.md.

Maps are `[rows, heads, keys]`: row i is the query at absolute position
`row_positions[i]`, key j the key at `key_positions[j]`. After a head reduction
(`mean_heads`, `max_heads`) the heads dimension is 1 and `heads` lists the heads reduced
over; `head_labels` says what each index of the heads dimension is. With top-k the last
dimension is k, values sorted descending, and `indices[layer]` (int32, same shape) holds
each value's key position; `dense(layer)` scatters them back into a full map.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import struct
import urllib.error
import urllib.parse
import urllib.request
import zlib
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from .convert import HFAttentions

__all__ = [
    "Capture",
    "CaptureError",
    "FetchError",
    "FORMAT",
    "from_response",
    "load",
    "fetch",
    "delete",
    "save_safetensors",
    "to_npz",
]

#: `format` of the meta this module reads.
FORMAT = "lantern.attn_capture.v1"
#: `__metadata__` key of the meta (a JSON string) in a capture's safetensors file.
META_KEY = "lantern.capture"
#: The only JSON encoding of a layer's data.
ENCODING = "gzip+base64"

# Delivered dtypes (meta["dtype"]) -> little-endian numpy dtype and safetensors name.
_WIRE_DTYPES = {"float32": (np.dtype("<f4"), "F32"), "float16": (np.dtype("<f2"), "F16")}

# safetensors dtype -> little-endian numpy dtype. BF16 has no numpy type: it is read as
# its 16-bit patterns and widened to float32.
_ST_DTYPES = {
    "BOOL": np.dtype("|b1"),
    "U8": np.dtype("|u1"),
    "I8": np.dtype("|i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
}

# Fields of the meta (CaptureMeta in crates/lantern-capture/src/result.rs).
_META_FIELDS = (
    "format",
    "prompt_len",
    "total_len",
    "tokens",
    "layers",
    "heads",
    "reduce",
    "top_k",
    "dtype",
    "row_positions",
    "key_positions",
    "absent_rows",
    "layer_attention",
)


class CaptureError(ValueError):
    """A capture (response, JSON or file) that is malformed or absent."""


class FetchError(RuntimeError):
    """`GET/DELETE /v1/captures/{id}` answered with an error; `status` is the HTTP status."""

    def __init__(self, message: str, status: Optional[int] = None):
        super().__init__(message)
        self.status = status


# --------------------------------------------------------------------------- Capture


class Capture:
    """A finished capture.

    Attributes:
        meta: the capture's metadata (dict, CaptureMeta's JSON).
        layers: {layer_idx: np.ndarray [rows, heads, keys]}, float32 or float16 as
            delivered, in the order of ``meta["layers"]``.
        indices: {layer_idx: np.ndarray int32, same shape} with top-k, else empty.
        stats: {layer_idx: {stat: np.ndarray float32}} with ``attn_capture_stats``:
            ``key_mass`` and ``key_max`` are ``[groups, keys]``, ``block_mass``
            ``[groups, blocks]`` (blocks of ``meta["block_size"]`` keys); the groups of
            each layer are ``meta["stats_groups"]`` (the query heads each averages). Empty
            without statistics; ``layers`` is empty when only statistics were asked for.
        span_mass: {layer_idx: np.ndarray float32 [rows, groups, spans + 1]} with
            ``attn_capture_spans``: per captured row and group (as ``stats``), the
            attention mass on each span of ``meta["spans"]``, the last column the mass
            outside every span (``span_labels`` names the columns). Empty without spans.
    """

    def __init__(
        self,
        meta: Dict[str, Any],
        layers: Dict[int, np.ndarray],
        indices: Optional[Dict[int, np.ndarray]] = None,
        stats: Optional[Dict[int, Dict[str, np.ndarray]]] = None,
        span_mass: Optional[Dict[int, np.ndarray]] = None,
    ):
        self.meta = meta
        self.layers = layers
        self.indices = indices if indices is not None else {}
        self.stats = stats if stats is not None else {}
        self.span_mass = span_mass if span_mass is not None else {}

    @property
    def span_labels(self) -> List[str]:
        """The columns of ``span_mass``: each span's label, then ``"other"``."""
        spans = self.meta.get("spans") or []
        return [s["label"] for s in spans] + ["other"] if spans else []

    # -- the meta, conveniently

    @property
    def token_ids(self) -> np.ndarray:
        """Token id of every position 0..total_len (int64)."""
        return np.array([t["id"] for t in self.meta["tokens"]], dtype=np.int64)

    @property
    def tokens(self) -> List[str]:
        """Text of every position's token, decoded alone."""
        return [t["text"] for t in self.meta["tokens"]]

    @property
    def row_positions(self) -> np.ndarray:
        """Absolute position of each row (query) of the maps."""
        return np.array(self.meta["row_positions"], dtype=np.int64)

    @property
    def key_positions(self) -> np.ndarray:
        """Absolute position of each key (column) of a dense map."""
        return np.array(self.meta["key_positions"], dtype=np.int64)

    def _label(self, position: int) -> str:
        tokens = self.meta["tokens"]
        text = tokens[position]["text"] if 0 <= position < len(tokens) else "?"
        return f"{position}:{text!r}"

    @property
    def row_labels(self) -> List[str]:
        """One label per row, like ``"12:' the'"`` (position and token text)."""
        return [self._label(p) for p in self.meta["row_positions"]]

    @property
    def key_labels(self) -> List[str]:
        """One label per key of a dense map, like ``"12:' the'"``."""
        return [self._label(p) for p in self.meta["key_positions"]]

    @property
    def prompt_len(self) -> int:
        return int(self.meta["prompt_len"])

    @property
    def total_len(self) -> int:
        """Prompt plus generated tokens."""
        return int(self.meta["total_len"])

    @property
    def absent_rows(self) -> List[Dict[str, Any]]:
        """Requested positions without a row: ``[{"position": p, "reason": "..."}]``."""
        return list(self.meta["absent_rows"])

    @property
    def heads(self) -> List[int]:
        """The query heads captured, as the request chose them.

        Without a reduction, index ``i`` of the maps' heads dimension is head
        ``heads[i]``. After ``mean_heads`` / ``max_heads`` the maps have a heads
        dimension of 1, and ``heads`` lists the heads that were reduced over: use
        ``head_labels`` for what each index of the maps' heads dimension is.
        """
        return list(self.meta["heads"])

    @property
    def head_labels(self) -> List[str]:
        """One label per index of the maps' heads dimension (``layers[l].shape[1]``
        entries): ``"head 5"`` for each captured head, or a single
        ``"mean of heads 0-8"`` / ``"max of heads 0-8"`` after a reduction."""
        return _head_labels(self.meta)

    @property
    def reduce(self) -> str:
        return self.meta["reduce"]

    @property
    def top_k(self) -> Optional[int]:
        return self.meta["top_k"]

    @property
    def dtype(self) -> str:
        """``"float32"`` or ``"float16"``: the delivered element type."""
        return self.meta["dtype"]

    def layer_attention(self, layer_idx: int) -> Dict[str, Any]:
        """How layer `layer_idx` attends: scale, sliding_window, chunk_size,
        logits_soft_cap, has_sinks, num_heads, num_kv_heads."""
        for info in self.meta.get("layer_attention", []):
            if info.get("layer_idx") == layer_idx:
                return info
        raise KeyError(f"no attention info for layer {layer_idx}")

    # -- maps

    def dense(self, layer_idx: int) -> np.ndarray:
        """Layer `layer_idx` as a new dense float32 array [rows, heads, len(key_positions)].

        Without top-k this is the map itself in float32; with top-k the kept values are
        scattered to their key positions and every other entry is 0.
        """
        if layer_idx not in self.layers:
            if self.meta.get("maps") is False:
                raise KeyError(
                    f"this capture has no maps (attn_capture_maps was false: statistics or spans "
                    f"only), so layer {layer_idx} has no probabilities; see .stats and .span_mass"
                )
            raise KeyError(f"layer {layer_idx} was not captured (captured: {list(self.layers)})")
        values = self.layers[layer_idx]
        if not self.meta.get("top_k"):
            return values.astype(np.float32)
        indices = self.indices.get(layer_idx)
        if indices is None:
            raise CaptureError(f"layer {layer_idx}: a top-k capture without indices")
        keys = self.meta["key_positions"]
        rows, heads = values.shape[0], values.shape[1]
        out = np.zeros((rows, heads, len(keys)), dtype=np.float32)
        if values.size == 0:
            return out
        # Key position -> column of the dense map (the identity when keys are 0..n).
        positions = np.asarray(indices, dtype=np.int64)
        key_array = np.asarray(keys, dtype=np.int64)
        order = np.argsort(key_array, kind="stable")
        sorted_keys = key_array[order]
        at = np.clip(np.searchsorted(sorted_keys, positions), 0, max(len(keys) - 1, 0))
        if len(keys) == 0 or not np.array_equal(sorted_keys[at], positions):
            raise CaptureError(f"layer {layer_idx}: a top-k index is not one of key_positions")
        cols = order[at]
        np.put_along_axis(out, cols, values.astype(np.float32), axis=-1)
        return out

    # -- other libraries' shapes

    def to_hf(self, return_tensors: str = "np") -> "HFAttentions":
        """The tuple transformers returns for ``output_attentions=True`` over the whole
        sequence (``token_ids``): one float32 ``[1, heads, total_len, total_len]`` per
        captured layer. Rows that have no probabilities (not asked for, or absent) are
        zeros and listed in ``.absent_rows``; ``.layers`` and ``.heads`` say which
        layers and heads the entries are. ``return_tensors="pt"`` gives torch tensors.
        """
        from .convert import to_hf

        return to_hf(self, return_tensors)

    def to_bertviz(self, return_tensors: str = "pt") -> tuple:
        """``(attention, tokens)``, what bertviz's ``head_view`` and ``model_view``
        take: ``head_view(*cap.to_bertviz())``. ``attention`` is ``to_hf()``'s tuple
        as torch tensors, which bertviz needs: without torch this raises ImportError
        (``to_hf()`` gives the same arrays in numpy). ``return_tensors="np"`` asks for
        numpy arrays on purpose."""
        from .convert import to_bertviz

        return to_bertviz(self, return_tensors)

    def to_html(self, title: Optional[str] = None) -> str:
        """A self-contained HTML page (no network) with the capture as a heatmap: the
        viewer of ``lantern attn view`` and ``GET /v1/captures/{id}/view``."""
        from .view import to_html

        return to_html(self, title)

    def _repr_html_(self) -> str:
        """Jupyter shows a capture as its viewer, in an iframe of its own."""
        from .view import notebook_html

        return notebook_html(self)

    def __repr__(self) -> str:
        shape = next(iter(self.layers.values())).shape if self.layers else None
        # What the heads dimension holds: after a reduction, one map, not `heads`.
        if self.meta.get("reduce") == "none":
            head_text = f"heads {_head_span(self.meta.get('heads', []))}"
        else:
            head_text = _head_labels(self.meta)[0]
        return (
            f"<lantern_attn.Capture layers={list(self.layers)} "
            f"shape={shape} (rows × {head_text} × keys) "
            f"dtype={self.meta.get('dtype')} top_k={self.meta.get('top_k')} "
            f"prompt_len={self.meta.get('prompt_len')} total_len={self.meta.get('total_len')} "
            f"absent_rows={[a.get('position') for a in self.meta.get('absent_rows', [])]}>"
        )


# --------------------------------------------------------------------------- heads

# What a reduction makes of the heads, in labels.
_REDUCED = {"mean_heads": "mean", "max_heads": "max"}


def _head_span(heads: List[int]) -> str:
    """Heads as text, runs shortened: ``"0-8"``, ``"0, 2, 5-7"``."""
    parts: List[str] = []
    i = 0
    while i < len(heads):
        j = i
        while j + 1 < len(heads) and heads[j + 1] == heads[j] + 1:
            j += 1
        parts.append(f"{heads[i]}-{heads[j]}" if j > i + 1 else ", ".join(map(str, heads[i : j + 1])))
        i = j + 1
    return ", ".join(parts)


def _head_labels(meta: Dict[str, Any]) -> List[str]:
    """What each index of the maps' heads dimension is (see `Capture.head_labels`)."""
    heads = list(meta["heads"])
    if meta["reduce"] == "none":
        return [f"head {h}" for h in heads]
    return [f"{_REDUCED.get(meta['reduce'], meta['reduce'])} of heads {_head_span(heads)}"]


# --------------------------------------------------------------------------- checks


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(meta: Dict[str, Any], name: str) -> None:
    value = meta[name]
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise CaptureError(f"attn_capture_meta.{name} is not a list of non-negative integers")


def _check_meta(meta: Any) -> Dict[str, Any]:
    if not isinstance(meta, dict):
        raise CaptureError("attn_capture_meta is not a JSON object")
    missing = [f for f in _META_FIELDS if f not in meta]
    if missing:
        raise CaptureError(f"attn_capture_meta: missing field(s) {', '.join(missing)}")
    if meta["format"] != FORMAT:
        raise CaptureError(f"attn_capture_meta.format is {meta['format']!r}, expected {FORMAT!r}")
    if meta["dtype"] not in _WIRE_DTYPES:
        raise CaptureError(
            f"attn_capture_meta.dtype is {meta['dtype']!r}, expected \"float32\" or \"float16\""
        )
    for name in ("prompt_len", "total_len"):
        if not _is_int(meta[name]) or meta[name] < 0:
            raise CaptureError(f"attn_capture_meta.{name} is not a non-negative integer")
    for name in ("layers", "heads", "row_positions", "key_positions"):
        _int_list(meta, name)
    top_k = meta["top_k"]
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise CaptureError("attn_capture_meta.top_k is not null or a positive integer")
    if meta["reduce"] not in ("none", "mean_heads", "max_heads"):
        raise CaptureError(f"attn_capture_meta.reduce is {meta['reduce']!r}")
    tokens = meta["tokens"]
    if not isinstance(tokens, list) or not all(
        isinstance(t, dict) and _is_int(t.get("id")) and isinstance(t.get("text"), str)
        for t in tokens
    ):
        raise CaptureError("attn_capture_meta.tokens is not a list of {id, text}")
    if not isinstance(meta["absent_rows"], list) or not isinstance(meta["layer_attention"], list):
        raise CaptureError("attn_capture_meta.absent_rows / layer_attention are not lists")
    if len(set(meta["layers"])) != len(meta["layers"]):
        raise CaptureError("attn_capture_meta.layers lists a layer twice")
    return meta


def _expected_shape(meta: Dict[str, Any]) -> tuple:
    heads = len(meta["heads"]) if meta["reduce"] == "none" else 1
    keys = len(meta["key_positions"])
    if meta["top_k"] is not None:
        keys = min(meta["top_k"], keys)
    return (len(meta["row_positions"]), heads, keys)


def _check_shape(layer_idx: int, shape: Iterable[int], meta: Dict[str, Any]) -> None:
    shape = tuple(shape)
    expected = _expected_shape(meta)
    if shape != expected:
        raise CaptureError(
            f"layer {layer_idx}: shape {list(shape)} does not match the meta, which implies "
            f"{list(expected)} (rows = row_positions, heads, keys)"
        )


def _check_indices(layer_idx: int, indices: np.ndarray) -> None:
    if indices.size and int(indices.min()) < 0:
        raise CaptureError(f"layer {layer_idx}: negative key position in the top-k indices")


def _native(a: np.ndarray) -> np.ndarray:
    """`a` in the machine's byte order (no copy on little-endian machines)."""
    if not a.dtype.isnative:
        return a.astype(a.dtype.newbyteorder("="))
    return a


# --------------------------------------------------------------------------- inline JSON


def _unbase64_gunzip(text: Any, expected_len: int, what: str) -> bytearray:
    """Decodes base64(gzip(bytes)), insisting on exactly `expected_len` bytes (and never
    inflating more than that, so a decompression bomb stops early)."""
    if not isinstance(text, str):
        raise CaptureError(f"{what} is not a string")
    try:
        compressed = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise CaptureError(f"{what}: not valid base64 ({e})") from None
    out = bytearray()
    rest = compressed
    try:
        while True:
            d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip only
            out += d.decompress(rest, expected_len + 1 - len(out))
            if len(out) > expected_len:
                raise CaptureError(
                    f"{what}: more than the {expected_len} bytes that the shape and dtype need"
                )
            if not d.eof:
                if d.unconsumed_tail:
                    # Only reached when the output limit stopped it; handled above.
                    raise CaptureError(f"{what}: more than the {expected_len} bytes needed")
                raise CaptureError(f"{what}: not valid gzip (truncated)")
            rest = d.unused_data
            if not rest:
                break  # another gzip member may follow; anything else is an error
    except zlib.error as e:
        raise CaptureError(f"{what}: not valid gzip ({e})") from None
    if len(out) != expected_len:
        raise CaptureError(f"{what}: {len(out)} bytes, the shape and dtype need {expected_len}")
    return out


def _element_count(shape: Any, what: str) -> tuple:
    if (
        not isinstance(shape, list)
        or len(shape) != 3
        or not all(_is_int(d) and d >= 0 for d in shape)
    ):
        raise CaptureError(f"{what}: shape {shape!r} is not [rows, heads, keys]")
    count = shape[0] * shape[1] * shape[2]
    if count * 4 > 2**62:
        raise CaptureError(f"{what}: shape {shape!r} is too large")
    return tuple(shape), count


def _from_inline(obj: Dict[str, Any]) -> Capture:
    meta = _check_meta(obj.get("attn_capture_meta"))
    data = obj["attn_capture_data"]
    if not isinstance(data, list):
        raise CaptureError("attn_capture_data is not a list")
    map_layers = meta["layers"] if meta.get("maps", True) else []
    if len(data) != len(map_layers):
        raise CaptureError(
            f"attn_capture_data has {len(data)} layers, the meta implies {len(map_layers)}"
        )
    np_dtype, _ = _WIRE_DTYPES[meta["dtype"]]
    layers: Dict[int, np.ndarray] = {}
    indices: Dict[int, np.ndarray] = {}
    for entry, layer_idx in zip(data, meta["layers"]):
        at = f"attn_capture_data (layer {layer_idx})"
        if not isinstance(entry, dict):
            raise CaptureError(f"{at} is not a JSON object")
        for field in ("layer_idx", "shape", "dtype", "encoding", "data"):
            if field not in entry:
                raise CaptureError(f"{at}: no {field!r} field")
        if entry["layer_idx"] != layer_idx or not _is_int(entry["layer_idx"]):
            raise CaptureError(
                f"{at}: layer_idx is {entry['layer_idx']!r}, the meta lists layer {layer_idx} here"
            )
        shape, count = _element_count(entry["shape"], at)
        if entry["dtype"] != meta["dtype"]:
            raise CaptureError(
                f"{at}: dtype {entry['dtype']!r} differs from the meta's {meta['dtype']!r}"
            )
        if entry["encoding"] != ENCODING:
            raise CaptureError(f"{at}: unknown encoding {entry['encoding']!r} (expected {ENCODING!r})")
        raw = _unbase64_gunzip(entry["data"], count * np_dtype.itemsize, f"{at}: data")
        values = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
        if meta["top_k"] is not None:
            if entry.get("indices_dtype") != "int32":
                raise CaptureError(
                    f"{at}: indices_dtype is {entry.get('indices_dtype')!r}, expected \"int32\""
                )
            if "indices" not in entry:
                raise CaptureError(f"{at}: no 'indices' field (the capture is top-k)")
            raw = _unbase64_gunzip(entry["indices"], count * 4, f"{at}: indices")
            idx = np.frombuffer(raw, dtype="<i4").reshape(shape)
            _check_indices(layer_idx, idx)
            indices[layer_idx] = _native(idx)
        _check_shape(layer_idx, shape, meta)
        layers[layer_idx] = _native(values)
    return Capture(
        meta,
        layers,
        indices,
        _stats_from_inline(obj.get("attn_capture_stats_data"), meta),
        _span_mass_from_inline(obj.get("attn_capture_span_data"), meta),
    )


def _expected_span_mass(meta: Dict[str, Any]) -> List[tuple]:
    """(layer_idx, shape) of every layer's span masses the meta implies."""
    spans = meta.get("spans") or []
    if not spans:
        return []
    groups = meta.get("stats_groups")
    if not isinstance(groups, list) or len(groups) != len(meta["layers"]):
        raise CaptureError("attn_capture_meta.stats_groups does not list every captured layer")
    rows = len(meta["row_positions"])
    return [(layer_idx, (rows, len(g), len(spans) + 1)) for layer_idx, g in zip(meta["layers"], groups)]


def _span_mass_from_inline(data: Any, meta: Dict[str, Any]) -> Dict[int, np.ndarray]:
    expected = _expected_span_mass(meta)
    if not expected:
        return {}
    if not isinstance(data, list) or len(data) != len(expected):
        raise CaptureError(f"attn_capture_span_data should hold {len(expected)} entries (one per layer)")
    out: Dict[int, np.ndarray] = {}
    for entry, (layer_idx, shape) in zip(data, expected):
        at = f"attn_capture_span_data (layer {layer_idx})"
        if not isinstance(entry, dict) or entry.get("layer_idx") != layer_idx or entry.get("stat") != "span_mass":
            raise CaptureError(f"{at}: expected layer_idx {layer_idx} and stat 'span_mass' here")
        if entry.get("dtype") != "float32" or entry.get("encoding") != ENCODING:
            raise CaptureError(f"{at}: expected dtype 'float32' and encoding {ENCODING!r}")
        if list(entry.get("shape", [])) != list(shape):
            raise CaptureError(f"{at}: shape {entry.get('shape')!r}, the meta implies {list(shape)}")
        raw = _unbase64_gunzip(entry.get("data"), shape[0] * shape[1] * shape[2] * 4, f"{at}: data")
        out[layer_idx] = _native(np.frombuffer(raw, dtype="<f4").reshape(shape))
    return out


def _expected_stats(meta: Dict[str, Any]) -> List[tuple]:
    """(layer_idx, stat, shape) of every statistic the meta lists, in delivered order."""
    stats = meta.get("stats") or []
    if not stats:
        return []
    groups = meta.get("stats_groups")
    block = meta.get("block_size")
    if not isinstance(groups, list) or len(groups) != len(meta["layers"]):
        raise CaptureError("attn_capture_meta.stats_groups does not list every captured layer")
    if not _is_int(block) or block < 1:
        raise CaptureError("attn_capture_meta.block_size is missing in a capture with stats")
    keys = len(meta["key_positions"])
    out = []
    for layer_idx, layer_groups in zip(meta["layers"], groups):
        for stat in stats:
            if stat not in ("key_mass", "key_max", "block_mass"):
                raise CaptureError(f"attn_capture_meta.stats: unknown statistic {stat!r}")
            width = -(-keys // block) if stat == "block_mass" else keys
            out.append((layer_idx, stat, (len(layer_groups), width)))
    return out


def _stats_from_inline(data: Any, meta: Dict[str, Any]) -> Dict[int, Dict[str, np.ndarray]]:
    expected = _expected_stats(meta)
    if not expected:
        return {}
    if not isinstance(data, list) or len(data) != len(expected):
        raise CaptureError(
            f"attn_capture_stats_data should hold {len(expected)} entries (layers x stats)"
        )
    stats: Dict[int, Dict[str, np.ndarray]] = {}
    for entry, (layer_idx, stat, shape) in zip(data, expected):
        at = f"attn_capture_stats_data (layer {layer_idx}, {stat})"
        if not isinstance(entry, dict) or entry.get("layer_idx") != layer_idx or entry.get("stat") != stat:
            raise CaptureError(f"{at}: expected layer_idx {layer_idx} and stat {stat!r} here")
        if entry.get("dtype") != "float32" or entry.get("encoding") != ENCODING:
            raise CaptureError(f"{at}: expected dtype 'float32' and encoding {ENCODING!r}")
        if list(entry.get("shape", [])) != list(shape):
            raise CaptureError(f"{at}: shape {entry.get('shape')!r}, the meta implies {list(shape)}")
        raw = _unbase64_gunzip(entry.get("data"), shape[0] * shape[1] * 4, f"{at}: data")
        stats.setdefault(layer_idx, {})[stat] = _native(np.frombuffer(raw, dtype="<f4").reshape(shape))
    return stats


# --------------------------------------------------------------------------- responses


def _as_dict(resp: Any) -> Dict[str, Any]:
    if isinstance(resp, dict):
        return resp
    if isinstance(resp, (str, bytes, bytearray)):
        try:
            value = json.loads(resp)
        except ValueError as e:
            raise CaptureError(f"not a JSON response: {e}") from None
        if not isinstance(value, dict):
            raise CaptureError("expected a JSON object (a response or its streamed capture chunk)")
        return value
    for method in ("model_dump", "to_dict", "dict"):
        fn = getattr(resp, method, None)
        if callable(fn):
            value = fn()
            if isinstance(value, dict):
                return value
    raise TypeError(
        f"expected a response dict, JSON text or an openai response object, got {type(resp).__name__}"
    )


_RESPONSE_FIELDS = (
    "attn_capture_data",
    "attn_capture_path",
    "attn_capture_id",
    "attn_capture_error",
)


def from_response(resp: Any, client: Any = None) -> Capture:
    """The capture of a completions / chat.completions response.

    `resp`: the parsed JSON (dict) of a response or of the streamed chunk that carries
    the capture, its JSON text, an `openai` client response object, or the list of a
    stream's chunks (the capture is on a chunk of its own after the last token's; with
    ``include_usage`` the usage chunk follows it). Inline
    data is decoded; a response that carries `attn_capture_path` (delivery "file") is
    read from that file (on this machine). A reference (`attn_capture_id`) is
    downloaded with `client`, the `openai.OpenAI` client that made the request (its
    base URL and API key), or with `fetch()`.
    """
    if isinstance(resp, (list, tuple)):
        # The streamed chunks: the capture is on the last one that has it.
        chunks = [_as_dict(c) for c in resp]
        with_capture = [c for c in chunks if any(c.get(f) is not None for f in _RESPONSE_FIELDS)]
        if not with_capture:
            raise CaptureError(
                "none of these streamed chunks carries an attention capture "
                "(did the request set attn_capture to true?)"
            )
        resp = with_capture[-1]
    obj = _as_dict(resp)
    if obj.get("attn_capture_error") is not None:
        raise CaptureError(f"the server could not compute the capture: {obj['attn_capture_error']}")
    if obj.get("attn_capture_data") is not None:
        return _from_inline(obj)
    if obj.get("attn_capture_path"):
        return load(obj["attn_capture_path"])
    if obj.get("attn_capture_id") and client is not None:
        return fetch(str(client.base_url), obj["attn_capture_id"], api_key=client.api_key)
    if obj.get("attn_capture_id"):
        raise CaptureError(
            f"the capture was delivered by reference (attn_capture_id={obj['attn_capture_id']!r}); "
            "download it with from_response(r, client=client) or "
            "lantern_attn.fetch(base_url, capture_id, api_key=...)"
        )
    raise CaptureError(
        "no attention capture in this response (no attn_capture_data, attn_capture_path or "
        "attn_capture_id): did the request set attn_capture to true? In a stream the capture "
        "is on a chunk of its own after the last token's: pass the list of chunks"
    )


# --------------------------------------------------------------------------- safetensors


def _looks_like_json(head: bytes, size: int) -> bool:
    """Whether a file that starts with `head` (its first 9 bytes) is JSON rather than
    safetensors (an 8-byte little-endian header length that fits, then `{`)."""
    if len(head) >= 9:
        (n,) = struct.unpack("<Q", head[:8])
        if head[8:9] == b"{" and n <= size - 8:
            return False
    return head.lstrip()[:1] == b"{"


def _parse_header(buf: Any, size: int) -> tuple:
    """(header dict, data start) of a safetensors buffer of `size` bytes."""
    if size < 8:
        raise CaptureError("not a safetensors file: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(buf[:8]))
    if n > size - 8:
        raise CaptureError(
            f"not a safetensors file: header length {n} is beyond the end ({size} bytes)"
        )
    try:
        header = json.loads(bytes(buf[8 : 8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CaptureError(f"not a safetensors file: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise CaptureError("not a safetensors file: the header is not a JSON object")
    return header, 8 + n


def _tensor(buf: Any, header: Dict[str, Any], start: int, size: int, name: str) -> tuple:
    """(array, safetensors dtype) of tensor `name`, a view of `buf` where possible."""
    info = header.get(name)
    if not isinstance(info, dict):
        raise CaptureError(f"no tensor {name!r}")
    st_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if st_dtype not in _ST_DTYPES:
        raise CaptureError(f"{name}: unsupported safetensors dtype {st_dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CaptureError(f"{name}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= size - start
    ):
        raise CaptureError(f"not a safetensors file: {name} has data_offsets {offsets!r} out of range")
    dtype = _ST_DTYPES[st_dtype]
    count = math.prod(shape)
    if offsets[1] - offsets[0] != count * dtype.itemsize:
        raise CaptureError(
            f"not a safetensors file: {name} has {offsets[1] - offsets[0]} bytes, "
            f"its shape {shape} and dtype {st_dtype} need {count * dtype.itemsize}"
        )
    if count == 0:
        array = np.zeros(shape, dtype=dtype)
    else:
        array = np.ndarray(tuple(shape), dtype=dtype, buffer=buf, offset=start + offsets[0])
    if st_dtype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return _native(array), st_dtype


def _from_safetensors(buf: Any, size: int) -> Capture:
    header, start = _parse_header(buf, size)
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict) or META_KEY not in metadata:
        raise CaptureError(
            f"the safetensors file has no {META_KEY!r} metadata: not a lantern capture"
        )
    try:
        meta = json.loads(metadata[META_KEY])
    except (TypeError, ValueError) as e:
        raise CaptureError(f"{META_KEY} metadata is not JSON: {e}") from None
    meta = _check_meta(meta)
    _, want = _WIRE_DTYPES[meta["dtype"]]
    layers: Dict[int, np.ndarray] = {}
    indices: Dict[int, np.ndarray] = {}
    for layer_idx in meta["layers"] if meta.get("maps", True) else []:
        name = f"layer.{layer_idx}"
        if name not in header:
            raise CaptureError(f"no tensor {name!r} for captured layer {layer_idx}")
        values, st_dtype = _tensor(buf, header, start, size, name)
        if st_dtype != want:
            raise CaptureError(f"{name} is {st_dtype}, the meta says {meta['dtype']}")
        if values.ndim != 3:
            raise CaptureError(f"{name}: shape {list(values.shape)} is not [rows, heads, keys]")
        if meta["top_k"] is not None:
            index_name = f"{name}.indices"
            if index_name not in header:
                raise CaptureError(f"no tensor {index_name!r} (the capture is top-k)")
            idx, idx_dtype = _tensor(buf, header, start, size, index_name)
            if idx_dtype != "I32" or idx.shape != values.shape:
                raise CaptureError(
                    f"{index_name} is {idx_dtype} {list(idx.shape)}, expected I32 {list(values.shape)}"
                )
            _check_indices(layer_idx, idx)
            indices[layer_idx] = idx
        _check_shape(layer_idx, values.shape, meta)
        layers[layer_idx] = values
    stats: Dict[int, Dict[str, np.ndarray]] = {}
    for layer_idx, stat, shape in _expected_stats(meta):
        name = f"layer.{layer_idx}.{stat}"
        if name not in header:
            raise CaptureError(f"no tensor {name!r}: the meta lists {stat}")
        values, st_dtype = _tensor(buf, header, start, size, name)
        if st_dtype != "F32" or values.shape != shape:
            raise CaptureError(f"{name} is {st_dtype} {list(values.shape)}, expected F32 {list(shape)}")
        stats.setdefault(layer_idx, {})[stat] = values
    span_mass: Dict[int, np.ndarray] = {}
    for layer_idx, shape in _expected_span_mass(meta):
        name = f"layer.{layer_idx}.span_mass"
        if name not in header:
            raise CaptureError(f"no tensor {name!r}: the meta lists spans")
        values, st_dtype = _tensor(buf, header, start, size, name)
        if st_dtype != "F32" or values.shape != shape:
            raise CaptureError(f"{name} is {st_dtype} {list(values.shape)}, expected F32 {list(shape)}")
        span_mass[layer_idx] = values
    return Capture(meta, layers, indices, stats, span_mass)


def load(source: Union[str, "os.PathLike[str]", bytes, bytearray, memoryview]) -> Capture:
    """Reads a capture: a safetensors file (delivery "reference" or "file", or
    `lantern attn export --format safetensors`), or a JSON file holding a response with
    the capture inline. A path is memory-mapped (copy-on-write: the arrays can be
    changed, the file never is); bytes are read in place (read-only arrays for `bytes`).
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        buf = memoryview(source).cast("B") if isinstance(source, memoryview) else source
        size = len(buf)
        if _looks_like_json(bytes(buf[:9]), size):
            return from_response(bytes(buf))
        return _from_safetensors(buf, size)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load() takes a path or bytes, not {type(source).__name__}")
    path = os.fspath(source)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(9)
    if size == 0:
        raise CaptureError(f"{path} is empty: not a lantern capture")
    if _looks_like_json(head, size):
        with open(path, "rb") as f:
            return from_response(f.read())
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="c")
        return _from_safetensors(mm, size)
    except CaptureError as e:
        raise CaptureError(f"{path}: {e}") from None


def fetch(
    base_url: str, capture_id: Any, api_key: Optional[str] = None, timeout: float = 60
) -> Capture:
    """Downloads capture `capture_id` (delivery "reference") from
    ``GET {base_url}/captures/{id}``; `base_url` ends in /v1, as the openai client's.
    `capture_id` may also be a response carrying `attn_capture_id`. Only the API key
    that made the capture can read it."""
    capture_id = _capture_id(capture_id)
    status, body = _request("GET", base_url, capture_id, api_key, timeout)
    return _from_safetensors(body, len(body))


def delete(base_url: str, capture_id: Any, api_key: Optional[str] = None, timeout: float = 60) -> None:
    """Frees a stored capture (``DELETE {base_url}/captures/{id}``) before its TTL."""
    _request("DELETE", base_url, _capture_id(capture_id), api_key, timeout)


def _capture_id(capture_id: Any) -> str:
    if isinstance(capture_id, str):
        return capture_id
    obj = _as_dict(capture_id)
    if not obj.get("attn_capture_id"):
        raise CaptureError("this response has no attn_capture_id (was the delivery \"reference\"?)")
    return obj["attn_capture_id"]


def _request(method: str, base_url: str, capture_id: str, api_key: Optional[str], timeout: float):
    url = f"{base_url.rstrip('/')}/captures/{urllib.parse.quote(capture_id, safe='')}"
    headers = {"Accept": "application/octet-stream, application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body = r.status, bytearray(r.read())
    except urllib.error.HTTPError as e:
        status, body = e.code, bytearray(e.read() or b"")
    if status != 200:
        message = bytes(body[:2000]).decode("utf-8", "replace").strip()
        try:
            message = json.loads(bytes(body))["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise FetchError(f"{method} {url}: HTTP {status}: {message or '(no body)'}", status)
    return status, body


# --------------------------------------------------------------------------- writing


def save_safetensors(capture: Capture, path: Union[str, "os.PathLike[str]"]) -> None:
    """Writes `capture` as the safetensors file the server delivers (same tensors and
    metadata; values in the capture's dtype)."""
    meta = _check_meta(capture.meta)
    np_dtype, st_dtype = _WIRE_DTYPES[meta["dtype"]]
    tensors = []
    for layer_idx in meta["layers"] if meta.get("maps", True) else []:
        if layer_idx not in capture.layers:
            raise CaptureError(f"the meta lists layer {layer_idx}, the capture has no map for it")
        values = np.ascontiguousarray(capture.layers[layer_idx], dtype=np_dtype)
        _check_shape(layer_idx, values.shape, meta)
        tensors.append((f"layer.{layer_idx}", st_dtype, values))
        if meta["top_k"] is not None:
            if layer_idx not in capture.indices:
                raise CaptureError(f"layer {layer_idx}: a top-k capture without indices")
            idx = np.ascontiguousarray(capture.indices[layer_idx], dtype="<i4")
            if idx.shape != values.shape:
                raise CaptureError(f"layer {layer_idx}: indices shape differs from the values")
            tensors.append((f"layer.{layer_idx}.indices", "I32", idx))
    for layer_idx, stat, shape in _expected_stats(meta):
        values = np.ascontiguousarray(capture.stats.get(layer_idx, {}).get(stat), dtype="<f4")
        if values.shape != shape:
            raise CaptureError(f"layer {layer_idx}: {stat} is {list(values.shape)}, the meta implies {list(shape)}")
        tensors.append((f"layer.{layer_idx}.{stat}", "F32", values))
    for layer_idx, values in sorted(capture.span_mass.items()):
        tensors.append((f"layer.{layer_idx}.span_mass", "F32", np.ascontiguousarray(values, dtype="<f4")))
    # 4-byte tensors first, then f16 maps: every tensor starts aligned to its element size.
    tensors.sort(key=lambda t: t[1] == "F16")
    header: Dict[str, Any] = {
        "__metadata__": {"format": FORMAT, META_KEY: json.dumps(meta, ensure_ascii=False)}
    }
    offset = 0
    for name, dt, array in tensors:
        header[name] = {
            "dtype": dt,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    text = json.dumps(header, ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, array in tensors:
            f.write(array.tobytes())


def to_npz(capture: Capture, path: Union[str, "os.PathLike[str]"], compressed: bool = False) -> None:
    """Writes `layer_{L}` (and `layer_{L}.indices` with top-k) arrays and `meta` (the meta
    as a JSON string) to a .npz file, readable with ``np.load(path)`` without pickle."""
    arrays: Dict[str, np.ndarray] = {"meta": np.array(json.dumps(capture.meta, ensure_ascii=False))}
    for layer_idx, values in capture.layers.items():
        arrays[f"layer_{layer_idx}"] = np.asarray(values)
        if layer_idx in capture.indices:
            arrays[f"layer_{layer_idx}.indices"] = np.asarray(capture.indices[layer_idx])
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
