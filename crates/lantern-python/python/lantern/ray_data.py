"""Capture jobs over many machines with Ray Data: one ``lantern.LLM`` per Ray worker.

    import ray
    from lantern.ray_data import CaptureBatches

    ds = ray.data.read_parquet("prompts/")          # a "prompt" column (and any others)
    ds = ds.map_batches(
        CaptureBatches,
        fn_constructor_kwargs={"sampling": {"temperature": 0, "max_tokens": 64},
                               "layers": [0, -1]},
        compute=ray.data.ActorPoolStrategy(size=8),  # 8 engines, one per worker
        num_cpus=4,                                  # each engine's compute threads
        batch_size=32,                               # prompts per continuous batch
    )
    ds.write_parquet("captures/")

Each output row holds the input row's columns, the generated ``text``, ``token_ids``,
``finish_reason``, ``prompt_token_ids`` and, for each captured layer ``L``, what the
captured rows (the generated tokens by default) attended to in the prompt, from the
engine's exact ``key_mass`` statistic with heads averaged (docs/attention-capture.md,
"Key statistics"):

- ``prompt_mass_L{L}``: list of float32, one per prompt token: the mean probability a
  captured row gave that token (H2O's accumulated score over the rows, divided by them).
- ``prompt_share_L{L}``: float32, the sum of the above: the share of the rows' attention
  that went to the prompt rather than to the tokens generated before them.
- ``top_keys_L{L}``: list of int32, the ``top_k`` prompt positions with the most mass,
  heaviest first (the heavy hitters an eviction policy would keep).
- ``captured_rows``: how many rows the means are over (0 when nothing was generated past
  the first token: the masses are then 0).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

try:
    import pyarrow as pa
    import ray
except ImportError as e:  # ray is optional: only this module needs it
    raise ImportError(
        f'lantern.ray_data needs Ray Data: pip install "ray[data]" ({e})'
    ) from e
import numpy as np

from .llm import LLM
from .sampling_params import SamplingParams

__all__ = ["CaptureBatches"]


class CaptureBatches:
    """A callable class for ``Dataset.map_batches``: builds one ``LLM`` when Ray starts
    the worker, then generates each batch as one continuous batch with a key-statistics
    capture and returns a ``pyarrow.Table`` (types fixed, so every Parquet file of the
    job has the same schema).

    Args:
        model: as ``LLM(model)``; ``None`` is the default model.
        sampling: ``SamplingParams`` or a dict of its keywords (``n`` must be 1: one
            output row per prompt). Default: greedy, 16 tokens.
        layers: the layers to capture (negative counts from the last).
        rows: which rows' attention is summed: ``"generated"`` (default), ``"prompt"``
            or ``"all"``, as ``attn_capture_rows``.
        top_k: how many heavy-hitter positions ``top_keys_L{L}`` keeps.
        prompt_column: the column holding the prompts (text, or lists of token ids).
        **engine_options: ``LLM``'s engine options. ``threads`` defaults to the CPUs
            Ray gave the worker (``num_cpus``), so that engines sharing a machine do
            not each take every core.
    """

    def __init__(
        self,
        model: Optional[str] = None,
        *,
        sampling: Union[SamplingParams, Mapping[str, Any], None] = None,
        layers: Sequence[int] = (-1,),
        rows: str = "generated",
        top_k: int = 8,
        prompt_column: str = "prompt",
        **engine_options: Any,
    ):
        if sampling is None:
            sampling = SamplingParams(temperature=0.0)
        elif not isinstance(sampling, SamplingParams):
            sampling = SamplingParams(**dict(sampling))
        if sampling.n != 1:
            raise ValueError(f"CaptureBatches writes one row per prompt: sampling n must be 1, got {sampling.n}")
        if top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {top_k}")
        if "threads" not in engine_options:
            threads = _ray_cpus()
            if threads:
                engine_options["threads"] = threads
        self.sampling = sampling
        self.top_k = top_k
        self.prompt_column = prompt_column
        self.llm = LLM(model, **engine_options)
        num_layers = self.llm.model_info["num_layers"]
        self.layers = _resolve_layers(layers, num_layers)
        self.capture = {
            "layers": self.layers,
            "rows": rows,
            "stats": ["key_mass"],
            "stats_heads": "mean",
        }

    def __call__(self, batch: Dict[str, Any]) -> "pa.Table":
        if self.prompt_column not in batch:
            raise KeyError(f"CaptureBatches: the batch has no {self.prompt_column!r} column (it has {sorted(batch)})")
        prompts = [_prompt(p) for p in batch[self.prompt_column]]
        outputs = (
            self.llm.generate(prompts, self.sampling, capture=self.capture, use_tqdm=False) if prompts else []
        )
        columns: Dict[str, pa.Array] = {}
        for name, values in batch.items():
            columns[name] = _arrow(values)
        columns["text"] = pa.array([o.outputs[0].text for o in outputs], pa.string())
        columns["token_ids"] = pa.array([list(o.outputs[0].token_ids) for o in outputs], pa.list_(pa.int32()))
        columns["finish_reason"] = pa.array([o.outputs[0].finish_reason for o in outputs], pa.string())
        columns["prompt_token_ids"] = pa.array([list(o.prompt_token_ids) for o in outputs], pa.list_(pa.int32()))
        stats = [prompt_statistics(o.attention, self.top_k) for o in outputs]
        columns["captured_rows"] = pa.array([s["captured_rows"] for s in stats], pa.int32())
        for layer in self.layers:
            columns[f"prompt_mass_L{layer}"] = pa.array(
                [s["prompt_mass"][layer] for s in stats], pa.list_(pa.float32())
            )
            columns[f"prompt_share_L{layer}"] = pa.array([s["prompt_share"][layer] for s in stats], pa.float32())
            columns[f"top_keys_L{layer}"] = pa.array([s["top_keys"][layer] for s in stats], pa.list_(pa.int32()))
        return pa.table(columns)


def prompt_statistics(attention, top_k: int = 8) -> Dict[str, Any]:
    """The per-row statistics ``CaptureBatches`` writes, from one output's capture
    (``capture={"stats": ["key_mass"], "stats_heads": "mean", ...}``): for each layer,
    ``prompt_mass`` (float32 ``[prompt_len]``), ``prompt_share`` and ``top_keys``; and
    ``captured_rows``. Usable on a direct ``LLM.generate`` to check a job's output."""
    meta = attention.meta
    prompt_len = meta["prompt_len"]
    rows = len(meta["row_positions"])
    out: Dict[str, Any] = {"captured_rows": rows, "prompt_mass": {}, "prompt_share": {}, "top_keys": {}}
    for layer in meta["layers"]:
        mass = attention.stats[layer]["key_mass"]  # [groups, keys]; one group with "mean"
        prompt = mass.mean(axis=0, dtype=np.float32)[:prompt_len] / np.float32(max(rows, 1))
        out["prompt_mass"][layer] = prompt
        out["prompt_share"][layer] = float(prompt.sum(dtype=np.float32))
        # Stable, so that ties keep the earlier position first.
        out["top_keys"][layer] = np.argsort(-prompt, kind="stable")[:top_k].astype(np.int32)
    return out


def _ray_cpus() -> Optional[int]:
    """The CPUs Ray reserved for this worker, when running in one."""
    if not ray.is_initialized():
        return None
    try:
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    except AssertionError:  # Ray's answer in the driver: not a worker, no reservation
        return None
    return max(1, int(cpus)) if cpus else None


def _resolve_layers(layers: Sequence[int], num_layers: int) -> List[int]:
    resolved = []
    for layer in layers:
        index = layer + num_layers if layer < 0 else layer
        if not 0 <= index < num_layers:
            raise ValueError(f"layer {layer} is out of range: the model has {num_layers} layers")
        if index not in resolved:
            resolved.append(index)
    if not resolved:
        raise ValueError("layers must name at least one layer")
    return resolved


def _prompt(value: Any) -> Union[str, List[int]]:
    """A prompt from a Ray batch cell: numpy strings and arrays of token ids too."""
    if isinstance(value, (str, np.str_)):
        return str(value)
    if isinstance(value, (bytes, np.bytes_)):
        return value.decode()
    if isinstance(value, (list, tuple, np.ndarray)):
        return [int(t) for t in value]
    raise TypeError(f"a prompt must be text or token ids, got {type(value).__name__}")


def _arrow(values: Any) -> "pa.Array":
    """An input column carried over to the output unchanged."""
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # Multi-dimensional arrays (Ray's tensor columns) and object arrays of arrays.
        return pa.array(values.tolist() if isinstance(values, np.ndarray) else list(values))
