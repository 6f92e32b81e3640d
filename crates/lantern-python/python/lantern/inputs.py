"""vLLM's prompt types (``from vllm.inputs import TokensPrompt``): plain dicts, which
``LLM.generate`` takes as they are."""

from __future__ import annotations

from typing import List, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: List[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids (``prompt`` may hold its text, for the output)."""

    prompt: str


__all__ = ["TextPrompt", "TokensPrompt"]
