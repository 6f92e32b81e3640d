"""``LLM``: lantern's engine in this process, with vLLM's offline API."""

from __future__ import annotations

import collections.abc
import itertools
import json
import os
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

from . import _lantern
from ._requests import Request
from .outputs import BeamSearchOutput, BeamSearchSequence, RequestOutput
from .sampling_params import BeamSearchParams, SamplingParams, _invalid
from .tokenizer import Tokenizer, as_token_ids, is_token_id

Prompt = Union[str, List[int], Dict[str, Any]]
Capture = Union[bool, Dict[str, Any], None]
# Seconds each wait for events lasts: how soon Ctrl-C is seen.
_POLL_S = 0.1


def _capture_json(capture: Capture) -> Optional[str]:
    """``capture=``: ``True`` for the defaults, or a dict of the HTTP capture fields
    without their ``attn_capture_`` prefix."""
    if capture is None or capture is False:
        return None
    if capture is True:
        return "{}"
    if isinstance(capture, dict):
        return json.dumps(capture)
    raise _lantern.InvalidRequestError(
        f"capture must be True or a dict like {{\"layers\": [0, 7]}}, got {type(capture).__name__}"
    )


def _prompt_field(prompt: Prompt) -> Union[str, List[int]]:
    """A prompt as the completions endpoint takes it: text or token ids (vLLM's
    ``{"prompt": ...}`` and ``{"prompt_token_ids": ...}`` dicts too)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise _invalid("prompt", 'a prompt dict needs "prompt" or "prompt_token_ids"')
    if isinstance(prompt, str):
        return prompt
    return _token_ids(prompt)


def _prompt_extras(prompt: Prompt) -> Dict[str, Any]:
    """A prompt dict's request fields beside its prompt: vLLM's ``cache_salt``."""
    if isinstance(prompt, dict) and prompt.get("multi_modal_data"):
        raise _invalid("multi_modal_data", "lantern runs text-only models: a prompt's multi_modal_data is not supported")
    if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
        return {"cache_salt": prompt["cache_salt"]}
    return {}


def _token_ids(ids) -> List[int]:
    """Token ids as plain ints: a list, or a numpy array or torch tensor (``tolist``)."""
    if isinstance(ids, (bytes, bytearray)):
        raise _invalid("prompt", "a prompt is text (str) or token ids, not bytes: decode it first")
    return as_token_ids(ids, "prompt")


def _as_prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> List[Prompt]:
    if prompts is None:
        raise _lantern.InvalidRequestError("no prompt given")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise _lantern.InvalidRequestError("a prompt is text (str) or token ids, not bytes: decode it first")
    if hasattr(prompts, "tolist"):
        # A numpy array or tensor: one prompt of ids (1-D) or a batch of them (2-D).
        prompts = prompts.tolist()
    if isinstance(prompts, collections.abc.Iterable) and not isinstance(prompts, (list, tuple)):
        prompts = list(prompts)  # a generator of prompts, as vLLM takes any sequence
    if not isinstance(prompts, (list, tuple)):
        raise _invalid(
            "prompt", f"a prompt is text (str), token ids or a prompt dict, not {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if prompts and all(is_token_id(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _per_prompt(params: Union[SamplingParams, Sequence[SamplingParams], None], count: int,
                default: SamplingParams) -> List[SamplingParams]:
    if params is None:
        return [default] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, dict):
        raise _invalid(
            "sampling_params",
            "sampling_params must be a SamplingParams (or a list of them), not a dict: "
            "lantern.SamplingParams(**params)",
        )
    params = list(params)
    if not all(isinstance(p, SamplingParams) for p in params):
        raise _invalid("sampling_params", "sampling_params must be a SamplingParams or a list of them")
    if len(params) != count:
        raise _lantern.InvalidRequestError(
            f"sampling_params has {len(params)} entries for {count} prompts; give one, or one per prompt"
        )
    return params


# Engine options that count something: whole numbers, checked before they reach Rust
# (where a negative one would be an OverflowError naming nothing).
_COUNT_OPTIONS = ("threads", "block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len")


def _progress(total: int, use_tqdm: Union[bool, Callable[..., Any]]):
    """A tqdm bar over prompts when tqdm is installed and there is more than one
    (``use_tqdm`` may be tqdm's class, or a function making a bar, as in vLLM)."""
    if not use_tqdm or total < 2:
        return None
    make = use_tqdm
    if not callable(make):
        try:
            from tqdm.auto import tqdm as make
        except ImportError:
            return None
    return make(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)


def _no_lora_nor_priority(lora_request: Any, priority: Any) -> None:
    """vLLM's ``lora_request`` and ``priority``: accepted when they ask for nothing."""
    if isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request):
        lora_request = None
    if lora_request is not None:
        raise _invalid("lora_request", "LoRA adapters are not supported: lora_request must be None")
    if priority is not None and any(p != 0 for p in (priority if isinstance(priority, list) else [priority])):
        raise _invalid("priority", "priority scheduling is not supported: priority must be None or 0")


# The engine's options (the CLI's flags).
_ENGINE_OPTIONS = (
    "kv_cache_memory", "kv_cache_dtype", "block_size", "attention_backend", "max_num_batched_tokens",
    "max_num_seqs", "enable_prefix_caching", "f32_weights", "quantize", "chat_template", "generation_config",
    "max_model_len",
    "threads", "enable_attention_capture", "max_capture_bytes", "device", "gpu_memory_utilization",
    "enforce_eager", "reasoning_parser",
)
# vLLM's options with nothing to do here when they ask for what lantern does anyway
# (`None`: any value).
_VLLM_OPTIONS_AT_DEFAULT = {
    "trust_remote_code": (True, False),
    "tensor_parallel_size": (1,),
    "pipeline_parallel_size": (1,),
    "data_parallel_size": (1,),
    "disable_log_stats": (True, False),
    "tokenizer": (None,),
    "tokenizer_mode": ("auto",),
    "swap_space": None,  # lantern does not swap (it recomputes preempted requests)
    "cpu_offload_gb": (0,),
    "enable_chunked_prefill": None,  # lantern splits long prompts over steps anyway
    "max_logprobs": None,  # lantern's limit is 20 alternatives, as the server's
    "max_seq_len_to_capture": None,  # CUDA graphs' sizes: lantern chooses its own
    "compilation_config": None,
    "disable_custom_all_reduce": None,
    "guided_decoding_backend": None,  # structured output is llguidance's
    "structured_outputs_config": None,
    "enable_lora": (False, None),
    "quantization": (None,),
    "load_format": ("auto", "gguf", "safetensors"),
    "download_dir": (None,),
    "revision": (None,),
    "tokenizer_revision": (None,),
    "code_revision": (None,),
    "hf_token": (None, False),
    "limit_mm_per_prompt": (None, {}),
}
# vLLM's `dtype`: lantern computes in the types the model's file stores (GGUF types,
# or a directory's bf16/f16/f32), with float32 activations.
_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


def _engine_options(model: Any, options: Dict[str, Any]) -> Dict[str, Any]:
    """``LLM``'s keywords as the engine's options: vLLM's that change nothing here are
    taken (``kv_cache_memory_bytes`` is ``kv_cache_memory``); any other is refused,
    naming it."""
    options = dict(options)
    if "kv_cache_memory_bytes" in options:
        options.setdefault("kv_cache_memory", options.pop("kv_cache_memory_bytes"))
    for name in ("kv_cache_memory", "max_capture_bytes"):
        value = options.get(name)
        if isinstance(value, float):
            # 2.5e8 bytes, as Python writes large numbers.
            if not value.is_integer() or value < 0:
                raise _invalid(name, f"{name} must be a whole number of bytes (or \"512M\"), got {value!r}")
            options[name] = int(value)
        elif value is not None and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise _invalid(name, f"{name} must be a number of bytes or a size like \"512M\", got {value!r}")
    if options.get("tokenizer") is not None and model is not None and os.fspath(options["tokenizer"]) == os.fspath(model):
        options["tokenizer"] = None
    if options.get("tokenizer") is not None:
        raise _invalid(
            "tokenizer",
            f"tokenizer={options['tokenizer']!r}: lantern tokenizes with the model's own tokenizer (a GGUF "
            "file's, or the directory's tokenizer.json): leave tokenizer out, or name the model itself",
        )
    if "dtype" in options:
        dtype = str(options.pop("dtype")).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise _invalid("dtype", f"dtype={dtype!r} is not one of {', '.join(_DTYPES)}")
        if dtype != "auto":
            warnings.warn(
                f"dtype={dtype!r} changes nothing: lantern computes in the types the model's file stores",
                stacklevel=3,
            )
    for name, allowed in _VLLM_OPTIONS_AT_DEFAULT.items():
        if name in options and name not in _ENGINE_OPTIONS:
            value = options.pop(name)
            if allowed is not None and value not in allowed:
                raise _invalid(name, f"{name}={value!r} is not supported (lantern runs with {allowed[0]!r})")
    unknown = sorted(set(options) - set(_ENGINE_OPTIONS))
    if unknown:
        raise _invalid(
            unknown[0],
            f"LLM has no option {unknown[0]!r}; its options are {', '.join(_ENGINE_OPTIONS)}",
        )
    return options


class LLM:
    """lantern's engine in this process.

    ``model``: a GGUF file or a Hugging Face directory; ``None`` is the default model
    (SmolLM2-135M-Instruct, fetched into lantern's cache directory when missing).
    Engine options are the CLI's, as keywords: ``kv_cache_memory`` (bytes, or
    ``"512M"``, ``"1G"``), ``kv_cache_dtype`` (``"f16"``, ``"bf16"``, ``"f32"``),
    ``block_size``, ``attention_backend``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``enable_prefix_caching``, ``f32_weights``, ``quantize``,
    ``chat_template`` (a file), ``max_model_len``, ``threads``,
    ``enable_attention_capture`` (default on), ``max_capture_bytes``, ``device``
    (``"cpu"``, ``"cuda"``, ``"cuda:N"``: an NVIDIA GPU, with the NVRTC and cuBLAS 13
    libraries), ``gpu_memory_utilization`` (GPU only: the share of the card's memory
    lantern may use, the KV cache sized from what the weights leave) and
    ``enforce_eager`` (GPU only: no decode steps replayed from CUDA graphs) and
    ``reasoning_parser`` (vLLM's ``"deepseek_r1"`` or ``"qwen3"``: structured output
    waits for a thinking model's ``</think>``; outputs stay raw text, as vLLM's).
    """

    def __init__(self, model: Union[str, "os.PathLike[str]", None] = None, **engine_options: Any):
        # vLLM's seed (0 unless given, as vLLM V1's): requests without their own get
        # seeds drawn from it, in order, so that a script's sampling repeats run after
        # run; None draws fresh randomness.
        seed = engine_options.pop("seed", 0)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise _invalid("seed", f"seed must be an int (or None), got {seed!r}")
        self._seed = seed
        self._seeds = itertools.count()
        engine_options = _engine_options(model, engine_options)
        share = engine_options.get("gpu_memory_utilization")
        if engine_options.get("device", "cpu") in ("cpu", None) and share is not None:
            # Passed along by code written for vLLM: nothing to size on a CPU.
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
                raise _invalid("gpu_memory_utilization", f"gpu_memory_utilization must be in (0, 1], got {share!r}")
            del engine_options["gpu_memory_utilization"]
        for name in _COUNT_OPTIONS:
            value = engine_options.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise _invalid(name, f"{name} must be a whole number >= 0, got {value!r}")
        self._engine = _lantern.Engine(None if model is None else os.fspath(model), **engine_options)
        self._info = self._engine.info()
        self._info["sampling_defaults"] = json.loads(self._info["sampling_defaults"])
        self._tokenizer = Tokenizer(self._engine, None if model is None else os.fspath(model))

    # -- generation

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: Any = None,
        *,
        capture: Capture = None,
        priority: Optional[List[int]] = None,
    ) -> List[RequestOutput]:
        """Generates for one prompt or several (text, token ids, or vLLM's prompt
        dicts), all in one continuous batch; results in input order. ``capture``
        (``True``, or a dict like ``{"layers": [0, 7], "rows": "prompt"}``) captures
        each prompt's attention into its output's ``attention``."""
        _no_lora_nor_priority(lora_request, priority)
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts), self.get_default_sampling_params())
        bodies = [dict(p._fields("completion"), prompt=_prompt_field(x), **_prompt_extras(x))
                  for x, p in zip(prompts, params)]
        texts = [x if isinstance(x, str) else x.get("prompt") if isinstance(x, dict) else None for x in prompts]
        return self._run("completion", bodies, params, texts, capture, use_tqdm)

    def beam_search(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: Union[bool, Callable[..., Any]] = False,
        concurrency_limit: Optional[int] = None,
        *,
        capture: Capture = None,
    ) -> List[BeamSearchOutput]:
        """vLLM's beam search: for each prompt (text, token ids, or a prompt dict),
        its ``params.beam_width`` best sequences, best first. ``concurrency_limit``
        prompts at most search at once (all of them by default). ``capture`` (as
        ``generate``'s) gives each sequence its attention: its tokens, prompt and beam,
        run as one prompt once the search is over."""
        _no_lora_nor_priority(lora_request, None)
        if not isinstance(params, BeamSearchParams):
            raise _invalid("params", "params must be a BeamSearchParams")
        if concurrency_limit is not None and (
            isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int) or concurrency_limit < 1
        ):
            raise _invalid("concurrency_limit", f"concurrency_limit must be an int >= 1, got {concurrency_limit!r}")
        prompts = _as_prompt_list(prompts)
        fields = params._fields()
        # What the outputs are assembled by: n sequences with their logprobs.
        shape = SamplingParams(n=params.beam_width, max_tokens=params.max_tokens, logprobs=fields["logprobs"])
        chunk = concurrency_limit or max(len(prompts), 1)
        results: List[BeamSearchOutput] = []
        for start in range(0, len(prompts), chunk):
            part = prompts[start:start + chunk]
            bodies = [dict(fields, prompt=_prompt_field(x), **_prompt_extras(x)) for x in part]
            texts = [None] * len(part)
            for out in self._run("completion", bodies, [shape] * len(part), texts, None, use_tqdm):
                sequences = []
                for c in out.outputs:
                    tokens = list(out.prompt_token_ids) + list(c.token_ids)
                    sequences.append(BeamSearchSequence(
                        tokens=tokens,
                        logprobs=list(c.logprobs or []),
                        cum_logprob=c.cumulative_logprob or 0.0,
                        text=self._engine.decode(tokens),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    ))
                results.append(BeamSearchOutput(sequences=sequences))
        if capture is not None and capture is not False:
            self._capture_beams([s for r in results for s in r.sequences], capture)
        return results

    def _capture_beams(self, sequences: List[BeamSearchSequence], capture: Capture) -> None:
        """Each sequence's attention, its tokens run as one prompt."""
        prompts = [{"prompt_token_ids": s.tokens} for s in sequences]
        outs = self.generate(prompts, SamplingParams(max_tokens=0), use_tqdm=False, capture=capture)
        for sequence, out in zip(sequences, outs):
            sequence.attention = out.attention
            sequence.attention_error = out.attention_error

    def chat(
        self,
        messages: Union[List[Dict[str, Any]], Sequence[List[Dict[str, Any]]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: Union[bool, Callable[..., Any]] = True,
        lora_request: Any = None,
        chat_template: Optional[str] = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[List[Dict[str, Any]]] = None,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        mm_processor_kwargs: Optional[Dict[str, Any]] = None,
        *,
        capture: Capture = None,
    ) -> List[RequestOutput]:
        """Generates replies to one conversation (a list of ``{"role", "content"}``
        messages) or several, through the model's chat template (vLLM's arguments;
        ``chat_template`` replaces it for these conversations)."""
        _no_lora_nor_priority(lora_request, None)
        _check_chat_extras(chat_template, chat_template_content_format, mm_processor_kwargs)
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        params = _per_prompt(sampling_params, len(conversations), self.get_default_sampling_params())
        options = _chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
                                chat_template)
        bodies = [dict(p._fields("chat"), messages=list(c), **options) for c, p in zip(conversations, params)]
        return self._run("chat", bodies, params, [None] * len(bodies), capture, use_tqdm)

    def stream(
        self,
        prompt: Prompt,
        sampling_params: Optional[SamplingParams] = None,
        *,
        capture: Capture = None,
    ) -> Iterator[RequestOutput]:
        """Yields the prompt's ``RequestOutput`` as it grows (``deltas`` holds each
        sequence's new text); the last has ``finished`` set and the capture. Leaving
        the loop early aborts the request."""
        params = sampling_params or self.get_default_sampling_params()
        body = dict(params._fields("completion"), prompt=_prompt_field(prompt), **_prompt_extras(prompt))
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        return self._stream("completion", body, params, text, capture)

    def stream_chat(
        self,
        messages: List[Dict[str, Any]],
        sampling_params: Optional[SamplingParams] = None,
        *,
        capture: Capture = None,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Optional[Dict[str, Any]] = None,
        tools: Optional[List[Dict[str, Any]]] = None,
    ) -> Iterator[RequestOutput]:
        """``stream`` for one conversation."""
        params = sampling_params or self.get_default_sampling_params()
        options = _chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
                                chat_template)
        body = dict(params._fields("chat"), messages=list(messages), **options)
        return self._stream("chat", body, params, None, capture)

    # -- the engine

    @property
    def model_info(self) -> Dict[str, Any]:
        """The model: name, context length, vocabulary, layers, heads, block size, and
        the sampling defaults it recommends."""
        return dict(self._info)

    def stats(self) -> Dict[str, Any]:
        """Requests running and waiting, and the KV cache's blocks, between two steps."""
        return self._engine.stats()

    @property
    def kv_cache_free_blocks(self) -> int:
        return self._engine.stats()["kv_cache_free_blocks"]

    @property
    def kv_cache_total_blocks(self) -> int:
        return self._engine.stats()["kv_cache_total_blocks"]

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters a call without ``sampling_params`` samples with: vLLM's
        defaults, with the model's recommended ones (a Hugging Face directory's
        generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty)
        unless ``LLM(generation_config="vllm")``."""
        return SamplingParams(**self._info["sampling_defaults"])

    @property
    def llm_engine(self) -> "LLMEngine":
        """What scripts written for vLLM reach through ``llm.llm_engine``: its tokenizer
        (``get_tokenizer()``, vLLM 0.x's ``tokenizer.tokenizer``) and ``model_config``
        (``model``, ``tokenizer``, ``max_model_len``, ``get_vocab_size()``)."""
        return LLMEngine(self)

    def get_tokenizer(self) -> Tokenizer:
        """The engine's tokenizer and chat template, with the Hugging Face methods code
        written for vLLM calls (``encode``, ``decode``, ``apply_chat_template``,
        ``eos_token_id``, ...)."""
        return self._tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text``, as a prompt is tokenized."""
        return self._tokenizer.encode(text, add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens)

    def close(self) -> None:
        """Stops the engine (``with LLM() as llm:`` does it at the end)."""
        self._engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- internals

    def _submit(self, batch, kind: str, body: Dict[str, Any], params: SamplingParams, text, capture_json,
                stream: bool = False):
        arrival = time.time()
        if self._seed is not None and body.get("seed") is None:
            body = dict(body, seed=(self._seed * 1_000_003 + next(self._seeds)) % (1 << 63))
        ids = batch.submit(kind, json.dumps(body), capture_json, stream)
        if kind == "chat":
            text = self._engine.decode(ids)
        return Request(text, ids, params, arrival)

    def _run(self, kind, bodies, params, texts, capture, use_tqdm) -> List[RequestOutput]:
        capture_json = _capture_json(capture)
        batch = self._engine.batch()
        requests: List[Request] = []
        bar = None
        try:
            for i, (body, p, text) in enumerate(zip(bodies, params, texts)):
                try:
                    requests.append(self._submit(batch, kind, body, p, text, capture_json))
                except _lantern.InvalidRequestError as e:
                    if len(bodies) == 1:
                        raise
                    # Which of the prompts, with the parameter it names.
                    raise _invalid(getattr(e, "param", None), f"prompt {i}: {e}") from e
            bar = _progress(len(requests), use_tqdm)
            while True:
                events = batch.poll(_POLL_S)
                if events is None:
                    break
                for event in events:
                    request = requests[event["prompt"]]
                    request.add(event)
                    if bar is not None and request.finished and event["finished"] is not None:
                        bar.update(1)
        except BaseException:
            # Ctrl-C, or a prompt refused after others were taken: nothing keeps running.
            batch.abort()
            raise
        finally:
            if bar is not None:
                bar.close()
        _raise_engine_errors(requests)
        return [r.output() for r in requests]

    def _stream(self, kind, body, params, text, capture) -> Iterator[RequestOutput]:
        capture_json = _capture_json(capture)
        batch = self._engine.batch()
        # Submitted now, so that a bad parameter raises here rather than at the first next().
        request = self._submit(batch, kind, body, params, text, capture_json, stream=True)
        return _stream_events(batch, request)


class ModelConfig:
    """vLLM's ``model_config``, the fields scripts read from it."""

    def __init__(self, info: Dict[str, Any]):
        self.model: str = info["model"]
        self.tokenizer: str = info["model"]
        self.max_model_len: int = info["context_length"]
        self._vocab_size: int = info["vocab_size"]
        self._num_layers: int = info["num_layers"]

    def get_vocab_size(self) -> int:
        return self._vocab_size

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return self._num_layers


class _TokenizerGroup:
    """vLLM 0.x's tokenizer group: ``.tokenizer`` is the tokenizer itself."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def get_lora_tokenizer(self, lora_request: Any = None) -> Tokenizer:
        _no_lora_nor_priority(lora_request, None)
        return self.tokenizer


class LLMEngine:
    """``llm.llm_engine``: the engine's tokenizer and model configuration, as vLLM's
    engine object offers them (generation goes through ``LLM``'s methods)."""

    def __init__(self, llm: LLM):
        self._llm = llm
        self.model_config = ModelConfig(llm.model_info)
        self.tokenizer = _TokenizerGroup(llm.get_tokenizer())

    def get_tokenizer(self, lora_request: Any = None) -> Tokenizer:
        _no_lora_nor_priority(lora_request, None)
        return self._llm.get_tokenizer()

    def get_model_config(self) -> ModelConfig:
        return self.model_config


def _stream_events(batch, request: Request) -> Iterator[RequestOutput]:
    try:
        while True:
            events = batch.poll(_POLL_S)
            if events is None:
                break
            if not events:
                continue
            for event in events:
                request.add(event)
            _raise_engine_errors([request])
            yield request.output()
    finally:
        if not request.finished:
            batch.abort()


def _check_chat_extras(chat_template, content_format, mm_processor_kwargs) -> None:
    if chat_template is not None and not isinstance(chat_template, str):
        raise _invalid("chat_template", "chat_template must be the template's text (a str)")
    if content_format not in ("auto", "string", "openai"):
        raise _invalid(
            "chat_template_content_format",
            f"chat_template_content_format must be auto, string or openai, got {content_format!r}",
        )
    if mm_processor_kwargs:
        raise _invalid("mm_processor_kwargs", "lantern runs text models: mm_processor_kwargs must be None")


def _chat_options(add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
                  chat_template=None) -> Dict[str, Any]:
    options: Dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
    }
    if chat_template is not None:
        options["chat_template"] = chat_template
    if chat_template_kwargs is not None:
        options["chat_template_kwargs"] = chat_template_kwargs
    if tools is not None:
        options["tools"] = tools
    return options


def _raise_engine_errors(requests: List[Request]) -> None:
    for r in requests:
        if r.error:
            raise _lantern.EngineError(r.error)
