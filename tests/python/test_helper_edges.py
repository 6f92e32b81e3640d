"""Edges of the lantern_attn package (clients/python), with no server:

- `to_bertviz()` gives torch tensors, and without torch raises an ImportError that says
  so (bertviz cannot use numpy arrays); checked here without torch (torch hidden) and
  with it (this Python if it has torch, else Debian's python3 with python3-torch);
- after a head reduction, `head_labels` and the repr say what the heads dimension of 1
  holds, while `heads` keeps listing the heads reduced over.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_capture_helper import HEADS, LAYERS, inline_response, make_capture

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
