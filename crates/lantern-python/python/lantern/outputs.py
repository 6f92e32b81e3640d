"""Outputs shaped like vLLM's: ``RequestOutput`` with its ``CompletionOutput``s,
``Logprob`` and ``RequestMetrics``, plus ``attention`` when a capture was asked for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from .attention import Attention


@dataclass
class Logprob:
    """A token's log-probability, its rank (1 is the most likely; ``None`` when the
    engine did not rank it) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass
class CompletionOutput:
    """One generated sequence (one of ``n``)."""

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str] = None
    # The stop string or stop token id that ended the sequence.
    stop_reason: Union[int, str, None] = None
    # vLLM's: no LoRA adapter runs here.
    lora_request: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Unix times in seconds; ``None`` where it did not happen."""

    arrival_time: float
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None


@dataclass
class RequestOutput:
    """One prompt's result. ``attention`` is its capture (``None`` without one);
    when the capture failed after the text was generated, ``attention_error`` says
    why and the text is still good."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    prompt_logprobs: Optional[List[Optional[Dict[int, Logprob]]]]
    outputs: List[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: Optional[int] = None
    attention: Optional[Attention] = None
    attention_error: Optional[str] = None
    # vLLM's fields for encoder-decoder models, adapters and disaggregated serving:
    # always None here (decoder-only models, one process).
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    lora_request: None = None
    kv_transfer_params: None = None
    # Each sequence's new text in the last streamed update (streaming only).
    deltas: List[str] = field(default_factory=list, repr=False)
    # Streaming with a capture of spans or top-k: the live figures of the rows that
    # sampled this update's tokens, as the HTTP chunks' `attn_capture_row`.
    attention_rows: List[Dict[str, Any]] = field(default_factory=list, repr=False)


@dataclass
class BeamSearchSequence:
    """One sequence of a beam search, as vLLM's: ``tokens`` are the prompt's and the
    generated ones, ``text`` their text (special tokens written out), ``logprobs``
    each generated token's with its most likely alternatives, and ``cum_logprob``
    their sum."""

    tokens: List[int]
    logprobs: List[Dict[int, Logprob]]
    lora_request: None = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    # With `LLM.beam_search(..., capture=...)`: the sequence's attention (its tokens run
    # as one prompt), or why it could not be taken.
    attention: Optional[Attention] = None
    attention_error: Optional[str] = None


@dataclass
class BeamSearchOutput:
    """One prompt's beam search: its ``beam_width`` best sequences, best first."""

    sequences: List[BeamSearchSequence]
