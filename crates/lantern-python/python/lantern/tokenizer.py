"""``LLM.get_tokenizer()``: the engine's own tokenizer and chat template, with the parts
of a Hugging Face tokenizer's interface that code written for vLLM reaches for."""

from __future__ import annotations

import json
import numbers
from typing import Any, Dict, List, Optional, Sequence, Union

from .sampling_params import _invalid


def is_token_id(t: Any) -> bool:
    """An int >= 0, numpy's included (``list(np_array)`` gives numpy ints), not a bool."""
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0


def as_token_ids(ids: Any, param: str) -> List[int]:
    """Token ids as plain ints from a list, a tuple, or a numpy array or torch tensor
    (``tolist``); anything else is refused naming ``param``."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise _invalid(param, f"{param} must be a list of token ids, not {type(ids).__name__}")
    for i, t in enumerate(ids):
        if not is_token_id(t):
            raise _invalid(param, f"{param}[{i}] must be a token id (an int >= 0), got {t!r}")
    return [int(t) for t in ids]


class Tokenizer:
    """The tokenizer the engine tokenizes prompts with (the same ids a prompt gets)."""

    def __init__(self, engine: Any):
        self._engine = engine
        info = engine.tokenizer_info()
        self.bos_token: Optional[str] = info["bos_token"]
        self.eos_token: Optional[str] = info["eos_token"]
        self.pad_token: Optional[str] = info["pad_token"]
        self.add_bos_token: bool = info["add_bos_token"]
        self.vocab_size: int = info["vocab_size"]
        self.chat_template: Optional[str] = info["chat_template"]
        # Every id that ends a sequence (the EOS and the model's end-of-turn tokens).
        self.stop_token_ids: List[int] = list(info["stop_token_ids"])
        self.bos_token_id = self._single_id(self.bos_token)
        self.eos_token_id = self._single_id(self.eos_token)
        self.pad_token_id = self._single_id(self.pad_token)

    def _single_id(self, token: Optional[str]) -> Optional[int]:
        if token is None:
            return None
        ids = self.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        if not isinstance(text, str):
            raise _invalid("text", f"text must be a str, got {type(text).__name__}")
        return self._engine.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._engine.decode(as_token_ids(token_ids, "token_ids"), skip_special_tokens)

    def __call__(self, text: Union[str, List[str]], add_special_tokens: bool = True) -> Dict[str, Any]:
        """``{"input_ids": ids}`` for a text, or a list of id lists for a list of texts."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def convert_ids_to_tokens(self, ids: Union[int, Sequence[int]]) -> Union[Optional[str], List[Optional[str]]]:
        """Each token as the vocabulary spells it (byte-level tokens as stored, ``Ġ``
        for a space)."""
        if isinstance(ids, int) and not isinstance(ids, bool):
            return self._engine.token_pieces(as_token_ids([ids], "ids"))[0]
        return self._engine.token_pieces(as_token_ids(ids, "ids"))

    def apply_chat_template(
        self,
        conversation: List[Dict[str, Any]],
        tools: Optional[List[Dict[str, Any]]] = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        **chat_template_kwargs: Any,
    ) -> Union[str, List[int]]:
        """The conversation through the model's chat template, as ``LLM.chat`` renders
        it: token ids, or with ``tokenize=False`` their text (Hugging Face's defaults:
        no generation prompt unless asked)."""
        body: Dict[str, Any] = {
            "messages": list(conversation),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if tools is not None:
            body["tools"] = tools
        for name in ("return_tensors", "return_dict", "padding", "truncation"):
            if chat_template_kwargs.pop(name, None) is not None:
                raise _invalid(name, f"apply_chat_template's {name} is not supported; ids come as a list")
        if chat_template_kwargs:
            body["chat_template_kwargs"] = chat_template_kwargs
        ids = self._engine.tokenize(json.dumps(body))
        return ids if tokenize else self._engine.decode(ids, False)
