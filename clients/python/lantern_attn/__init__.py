"""lantern_attn: attention captures from a lantern server, in one line.

    import lantern_attn
    r = client.chat.completions.create(..., extra_body={"attn_capture": True})
    cap = lantern_attn.from_response(r, client=client)  # inline, file or by reference
    cap.layers[7]                   # np.ndarray [rows, heads, keys]
    attentions = cap.to_hf()        # transformers' output_attentions: [1, heads, q, k] per layer
    head_view(*cap.to_bertviz())    # bertviz (needs torch, as bertviz does)
    cap                             # in a notebook: the heatmap viewer (cap.to_html())

numpy is the only dependency; torch is used when asked for (``return_tensors="pt"``).
"""

from .capture import (  # noqa: F401 (the package's API)
    FORMAT,
    Capture,
    CaptureError,
    FetchError,
    delete,
    fetch,
    from_response,
    load,
    save_safetensors,
    to_npz,
)
from .capture import __all__ as _capture_all
from .convert import HFAttentions

__version__ = "0.3.0"

__all__ = [*_capture_all, "HFAttentions"]
