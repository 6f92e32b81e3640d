"""lantern in Python: the engine in this process, vLLM's offline API, and each
request's exact attention maps as numpy arrays.

    import lantern
    llm = lantern.LLM()
    out = llm.generate("Hello", capture={"layers": [0], "rows": "prompt"})[0]
    print(out.outputs[0].text, out.attention.maps[0].shape)
"""

from ._lantern import EngineError, InvalidRequestError, __version__
from . import inputs
from .attention import Attention
from .inputs import TextPrompt, TokensPrompt
from .llm import LLM
from .outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from .sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from .tokenizer import Tokenizer

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "Attention",
    "TextPrompt",
    "TokensPrompt",
    "Tokenizer",
    "inputs",
    "InvalidRequestError",
    "EngineError",
    "__version__",
]
