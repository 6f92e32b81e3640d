"""vLLM's prompt types (``from vllm.inputs import TokensPrompt``): plain dicts, which
``LLM.generate`` takes as they are."""

from __future__ import annotations

from typing import List, TypedDict


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A prompt as text (``cache_salt``: only prompts with the same salt share
    prefix-cache blocks)."""

    cache_salt: str


class _TokenIds(TypedDict):
    prompt_token_ids: List[int]


class TokensPrompt(_TokenIds, total=False):
    """A prompt as token ids (``prompt`` may hold its text, for the output)."""

    prompt: str
    cache_salt: str


__all__ = ["TextPrompt", "TokensPrompt"]
