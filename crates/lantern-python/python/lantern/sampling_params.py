"""SamplingParams with vLLM's names and defaults, checked as lantern's server checks
a request's fields (a bad one raises ``InvalidRequestError``, a ``ValueError``, whose
``param`` names it)."""

from __future__ import annotations

import json
import math
import enum
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Union

from . import _lantern


@dataclass
class StructuredOutputsParams:
    """vLLM's structured output: give one of ``json`` (a JSON schema, as a dict or
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (Lark) or
    ``json_object=True``. vLLM's options for its grammar backends (``backend``,
    ``disable_fallback``, ``disable_any_whitespace``, ``disable_additional_properties``,
    ``whitespace_pattern``) are taken and change nothing (lantern's grammars are
    llguidance's)."""

    json: Optional[Union[str, Dict[str, Any]]] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    backend: Optional[str] = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if not kinds:
            raise _invalid(
                "structured_outputs",
                "structured_outputs need one constraint (json, regex, choice, grammar or json_object); none is given",
            )

    def to_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v is not False}


# vLLM 0.10's name for it (`SamplingParams(guided_decoding=GuidedDecodingParams(...))`).
GuidedDecodingParams = StructuredOutputsParams


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what each streamed output holds. The offline API returns whole outputs
    whatever the kind (``LLM.stream``'s updates carry each sequence's new text in
    ``deltas``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The fields sent to the engine as the server's request fields of the same name.
_SERVER_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "max_tokens",
    "min_tokens",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "truncate_prompt_tokens",
)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class SamplingParams:
    """How to sample, with vLLM's names and defaults.

    ``temperature=0`` is greedy. ``max_tokens=None`` generates until the context (or
    the KV cache) is full. ``logprobs=k`` returns each generated token's logprob with
    the ``k`` most likely alternatives (up to 20, as the server's completions and chat
    endpoints allow); ``prompt_logprobs=k`` (0 to 20) the prompt's.
    ``truncate_prompt_tokens=k`` keeps the prompt's last ``k`` tokens (``-1``: as many
    as leave room for ``max_tokens``). ``allowed_token_ids`` restricts sampling to
    those tokens, ``bad_words`` keeps those words out of the output (vLLM's rules: each
    word's last token is banned where the output ends with its others), and
    ``skip_special_tokens=False`` gives special tokens their text. ``structured_outputs`` takes a
    ``StructuredOutputsParams`` or a dict with the same keys.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Optional[int] = None
    logit_bias: Optional[Dict[int, float]] = None
    allowed_token_ids: Optional[List[int]] = None
    bad_words: Optional[List[str]] = None
    skip_special_tokens: bool = True
    structured_outputs: Optional[Union[StructuredOutputsParams, Dict[str, Any]]] = None
    # vLLM's, accepted: fast tokenizers' decoding ignores the first (vLLM's too), the
    # offline API returns whole outputs whatever the kind, and extra_args feed custom
    # logits processors, which lantern does not load.
    spaces_between_special_tokens: bool = True
    output_kind: Any = None
    extra_args: Optional[Dict[str, Any]] = None
    detokenize: bool = True
    # vLLM 0.10's name for structured_outputs, and its best_of (only equal to n).
    guided_decoding: Optional[Union[StructuredOutputsParams, Dict[str, Any]]] = None
    best_of: Optional[int] = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise _invalid("guided_decoding", "give structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.best_of is not None and self.best_of != self.n:
            raise _invalid("best_of", f"best_of other than n is not supported (best_of={self.best_of!r}, n={self.n!r})")
        # vLLM's normal forms: seed -1 is none, True logprobs are one alternative, stop
        # strings and stop token ids are lists.
        if self.seed == -1:
            self.seed = None
        if isinstance(self.seed, int) and not isinstance(self.seed, bool) and not -(2**63) <= self.seed < 2**64:
            raise _invalid("seed", f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.detokenize is not True:
            raise _invalid("detokenize", "detokenize=False is not supported: outputs always carry their text")
        self._check_finite()
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or self.logprobs < 0
        ):
            raise _invalid("logprobs", f"logprobs must be an int >= 0 (or None), got {self.logprobs!r}")
        # The server's own checks, on the same fields (a placeholder prompt).
        _lantern.check_sampling(json.dumps(self._fields("completion", with_logprobs=False)))

    def _check_finite(self) -> None:
        """Non-finite numbers named here (JSON has none; they could be set after the
        parameters were made)."""
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
                raise _invalid(name, f"{name} must be a finite number, got {value}")
        if isinstance(self.logit_bias, dict):
            for token, bias in self.logit_bias.items():
                if isinstance(bias, (int, float)) and not isinstance(bias, bool) and not math.isfinite(bias):
                    raise _invalid("logit_bias", f"logit_bias[{token!r}] must be a finite number, got {bias}")

    def _structured(self) -> Optional[Dict[str, Any]]:
        s = self.structured_outputs
        if s is None:
            return None
        if isinstance(s, StructuredOutputsParams):
            return s.to_dict()
        if isinstance(s, dict):
            return dict(s)
        raise _invalid("structured_outputs", "structured_outputs must be a StructuredOutputsParams or a dict")

    def _fields(self, kind: str, with_logprobs: bool = True) -> Dict[str, Any]:
        """The request fields these parameters are, for the "completion" or "chat"
        endpoint's body."""
        self._check_finite()
        body: Dict[str, Any] = {}
        for name in _SERVER_FIELDS:
            value = getattr(self, name)
            if name == "logit_bias" and value is not None:
                value = {str(k): v for k, v in value.items()}
            if value is not None or name == "max_tokens":
                body[name] = value
        structured = self._structured()
        if structured is not None:
            body["structured_outputs"] = structured
        if with_logprobs and self.logprobs is not None:
            if kind == "chat":
                body["logprobs"] = True
                body["top_logprobs"] = self.logprobs
            else:
                body["logprobs"] = self.logprobs
        return body

    def clone(self) -> "SamplingParams":
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(self)})


@dataclass
class BeamSearchParams:
    """vLLM's beam search settings for ``LLM.beam_search``: ``beam_width`` beams,
    scored by ``cumulative logprob / length ** length_penalty`` (the length counting
    the prompt, as vLLM's). ``temperature`` is accepted and, as in vLLM, does not
    change the beams: they are ranked by the model's own logprobs."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _invalid(name, f"{name} must be an int >= 1, got {value!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _invalid(name, f"{name} must be a finite number, got {value!r}")

    def _fields(self) -> Dict[str, Any]:
        """The completions body fields of this search (with up to 20 alternatives per
        token in its logprobs, the server's limit)."""
        return {
            "use_beam_search": True,
            "n": self.beam_width,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "length_penalty": self.length_penalty,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": min(2 * self.beam_width, 20),
        }


def _invalid(param: str, message: str) -> Exception:
    e = _lantern.InvalidRequestError(message)
    e.param = param
    e.status = 400
    return e
