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


class BatchEncoding(dict):
    """Hugging Face's result of calling a tokenizer: a dict whose keys also read as
    attributes (``enc.input_ids``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Tokenizer:
    """The tokenizer the engine tokenizes prompts with (the same ids a prompt gets)."""

    def __init__(self, engine: Any, name_or_path: Optional[str] = None):
        self._engine = engine
        self.name_or_path = name_or_path
        self._vocab: Optional[Dict[str, int]] = None
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

    def decode(self, token_ids: Union[int, Sequence[int]], skip_special_tokens: bool = False) -> str:
        if is_token_id(token_ids):
            token_ids = [token_ids]
        return self._engine.decode(as_token_ids(token_ids, "token_ids"), skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> List[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __call__(self, text: Union[str, List[str]], add_special_tokens: bool = True) -> BatchEncoding:
        """``input_ids`` (a key and an attribute) for a text, or a list of id lists for
        a list of texts."""
        if isinstance(text, str):
            return BatchEncoding(input_ids=self.encode(text, add_special_tokens))
        return BatchEncoding(input_ids=[self.encode(t, add_special_tokens) for t in text])

    def tokenize(self, text: str) -> List[Optional[str]]:
        """The text's tokens as the vocabulary spells them (no special tokens added)."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens=False))

    def get_vocab(self) -> Dict[str, int]:
        """Every token as the vocabulary spells it, with its id."""
        if self._vocab is None:
            pieces = self._engine.token_pieces(list(range(self.vocab_size)))
            self._vocab = {p: i for i, p in enumerate(pieces) if p is not None}
        return dict(self._vocab)

    def convert_tokens_to_ids(self, tokens: Union[str, Sequence[str]]) -> Union[Optional[int], List[Optional[int]]]:
        """Each token's id (``None`` for a token the vocabulary does not have)."""
        if self._vocab is None:
            self.get_vocab()
        if isinstance(tokens, str):
            return self._vocab.get(tokens)
        return [self._vocab.get(t) for t in tokens]

    @property
    def all_special_ids(self) -> List[int]:
        """The ids of the BOS, EOS and pad tokens and of every token that ends a
        sequence."""
        ids = [self.bos_token_id, self.eos_token_id, self.pad_token_id, *self.stop_token_ids]
        return sorted({i for i in ids if i is not None})

    @property
    def all_special_tokens(self) -> List[str]:
        return [t for t in self.convert_ids_to_tokens(self.all_special_ids) if t is not None]

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
    ) -> Union[str, List[int], List[str], List[List[int]]]:
        """The conversation through the model's chat template, as ``LLM.chat`` renders
        it: token ids, or with ``tokenize=False`` their text (Hugging Face's defaults:
        no generation prompt unless asked). A list of conversations gives a list."""
        if conversation and all(isinstance(c, (list, tuple)) for c in conversation):
            return [
                self.apply_chat_template(
                    list(c), tools, add_generation_prompt, continue_final_message, tokenize, **chat_template_kwargs
                )
                for c in conversation
            ]
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
