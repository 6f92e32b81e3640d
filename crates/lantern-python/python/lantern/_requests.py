"""One prompt's ``RequestOutput``, assembled from the engine's events as they arrive."""

from __future__ import annotations

import itertools
import json
from typing import Any, Dict, List, Optional, Union

from .attention import Attention
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

_request_ids = itertools.count()


def _logprob_dict(entry: Dict[str, Any]) -> Dict[int, Logprob]:
    """vLLM's per-token logprobs: the token itself and its top alternatives."""
    out: Dict[int, Logprob] = {}
    for rank, (token_id, text, lp) in enumerate(entry["top"], start=1):
        out[token_id] = Logprob(lp, rank, text)
    if entry["token_id"] not in out:
        out[entry["token_id"]] = Logprob(entry["logprob"], entry.get("rank"), entry["token"])
    # The chosen token first, as vLLM orders it.
    chosen = out.pop(entry["token_id"])
    return {entry["token_id"]: chosen, **out}


class Sequence:
    def __init__(self, index: int, logprobs: bool):
        self.index = index
        self.text = ""
        self.delta = ""
        self.token_ids: List[int] = []
        self.logprobs: Optional[List[Dict[int, Logprob]]] = [] if logprobs else None
        self.cumulative_logprob: Optional[float] = 0.0 if logprobs else None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None

    def output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class Request:
    """One prompt's output as its events arrive."""

    def __init__(self, prompt: Optional[str], prompt_token_ids: List[int], params: SamplingParams, arrival: float):
        self.request_id = str(next(_request_ids))
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sequences = [Sequence(i, params.logprobs is not None) for i in range(params.n)]
        self.prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]] = None
        self.metrics = RequestMetrics(arrival_time=arrival)
        self.num_cached_tokens: Optional[int] = None
        self.attention: Optional[Attention] = None
        self.attention_error: Optional[str] = None
        # Streamed: the live rows that arrived since the last update.
        self.attention_rows: List[Dict[str, Any]] = []
        self.error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)

    def add(self, event: Dict[str, Any]) -> None:
        seq = self.sequences[event["index"]]
        seq.text += event["text"]
        seq.delta += event["text"]
        seq.token_ids.extend(event["token_ids"])
        if event.get("capture_row"):
            self.attention_rows.append(json.loads(event["capture_row"]))
        if event["token_ids"]:
            if self.metrics.first_token_time is None:
                self.metrics.first_token_time = event["time"]
            self.metrics.last_token_time = event["time"]
        if seq.logprobs is not None and event["logprobs"]:
            for entry in event["logprobs"]:
                seq.logprobs.append(_logprob_dict(entry))
                seq.cumulative_logprob += entry["logprob"]
        if event["prompt_logprobs"] is not None:
            self.prompt_logprobs = [
                None if e["logprob"] is None else {
                    e["token_id"]: Logprob(e["logprob"], e["rank"], e["token"]),
                    **{t: Logprob(lp, r, text) for r, (t, text, lp) in enumerate(e["top"], start=1) if t != e["token_id"]},
                }
                for e in event["prompt_logprobs"]
            ]
        end = event["finished"]
        if end is None:
            return
        seq.finish_reason = end["reason"]
        seq.stop_reason = end["stop_reason"]
        self.num_cached_tokens = end["cached_tokens"]
        if end["error"]:
            self.error = end["error"]
        capture = end["capture"]
        if capture is not None and "error" in capture:
            self.attention_error = capture["error"]
        elif capture is not None:
            self.attention = Attention(
                json.loads(capture["meta"]),
                capture["maps"],
                capture["indices"],
                capture["stats"],
                capture["span_mass"],
            )
        if self.finished:
            self.metrics.finished_time = event["time"]

    def output(self) -> RequestOutput:
        deltas = [s.delta for s in self.sequences]
        for s in self.sequences:
            s.delta = ""
        rows, self.attention_rows = self.attention_rows, []
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=self.prompt_logprobs,
            outputs=[s.output() for s in self.sequences],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            attention=self.attention,
            attention_error=self.attention_error,
            deltas=deltas,
            attention_rows=rows,
        )
