"""axon: an LLM inference engine and OpenAI-compatible server with vLLM's surface."""

from axon.entrypoints.llm import LLM
from axon.lora.request import LoRARequest
from axon.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from axon.pooling_params import PoolingParams
from axon.sampling_params import SamplingParams, StructuredOutputsParams
from axon.version import __version__

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
