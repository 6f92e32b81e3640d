"""A capture in the shapes other libraries take: transformers' ``output_attentions``
and bertviz's ``head_view`` input."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

if TYPE_CHECKING:
    from .capture import Capture

_RETURN_TENSORS = ("np", "pt")


class HFAttentions(tuple):
    """transformers' ``output_attentions``: one ``[1, heads, seq, seq]`` per layer.

    Attributes:
        layers: the model layer of each entry (the captured layers, ascending).
        heads: the query heads captured: without a reduction, index ``i`` of the
            heads dimension is head ``heads[i]``; after a head reduction that
            dimension is 1 and ``heads`` lists the heads reduced over.
        head_labels: one label per index of the heads dimension, like
            ``Capture.head_labels``: ``"head 5"``, or ``"mean of heads 0-8"``.
        absent_rows: positions whose row is all zeros because the capture has no
            probabilities for them (rows not asked for, or the last generated token,
            which never ran through the model).
    """

    layers: List[int]
    heads: List[int]
    head_labels: List[str]
    absent_rows: List[int]


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def to_hf(cap: "Capture", return_tensors: Optional[str] = "np") -> HFAttentions:
    """See `Capture.to_hf`."""
    if return_tensors is None:
        return_tensors = "np"
    if return_tensors not in _RETURN_TENSORS:
        raise ValueError(f"return_tensors is {return_tensors!r}: \"np\" (numpy) or \"pt\" (torch)")
    if return_tensors == "pt" and not torch_available():
        raise ImportError("return_tensors=\"pt\" needs torch (pip install torch); \"np\" gives numpy arrays")
    seq = cap.total_len
    rows, keys = cap.row_positions, cap.key_positions
    if (rows.size and rows.max() >= seq) or (keys.size and keys.max() >= seq):
        raise ValueError(f"row or key positions past the sequence of {seq} tokens")
    arrays = []
    for layer in cap.meta["layers"]:
        dense = cap.dense(layer)  # [rows, heads, keys] float32
        full = np.zeros((1, dense.shape[1], seq, seq), dtype=np.float32)
        full[0][:, rows[:, None], keys[None, :]] = dense.transpose(1, 0, 2)
        arrays.append(full)
    if return_tensors == "pt":
        import torch

        arrays = [torch.from_numpy(a) for a in arrays]
    out = HFAttentions(arrays)
    out.layers = list(cap.meta["layers"])
    out.heads = list(cap.meta["heads"])
    out.head_labels = cap.head_labels
    present = set(int(p) for p in rows)
    out.absent_rows = [p for p in range(seq) if p not in present]
    return out


def to_bertviz(cap: "Capture", return_tensors: Optional[str] = "pt") -> tuple:
    """See `Capture.to_bertviz`."""
    if return_tensors is None:
        return_tensors = "pt"
    # bertviz takes torch tensors only: numpy arrays would fail later, inside bertviz.
    if return_tensors == "pt" and not torch_available():
        raise ImportError(
            "to_bertviz() needs torch, as bertviz does (pip install torch); "
            "cap.to_hf() gives the same attention as numpy arrays"
        )
    attention: Any = to_hf(cap, return_tensors)
    return attention, list(cap.tokens)
