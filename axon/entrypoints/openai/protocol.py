"""Pydantic request and response models with OpenAI's and vLLM's field names.

Requests allow extra fields (as vLLM does): unknown ones are logged and ignored, while known
but unsupported ones (suffix, beam search, ...) are rejected by the handlers.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    SerializerFunctionWrapHandler,
    Tag,
    field_validator,
    model_serializer,
)

from axon.engine.input_processor import check_valid_unicode


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error body (axon/entrypoints/openai/errors.py), declared for the OpenAPI schema."""

    error: ErrorInfo


class RequestModel(OpenAIBaseModel):
    """What clients send. Every field holds valid Unicode and finite numbers: JSON can carry a
    lone surrogate ("\\ud800") and Python's parser accepts NaN and Infinity, and neither means
    anything to the engine, so both are a 400 that names the field."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)
        return value


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        check_valid_unicode(value, "the text")
    elif isinstance(value, list | tuple):
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class StreamOptions(RequestModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class SamplingFields(RequestModel):
    """The sampling parameters both generation endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    best_of: int | None = None
    # vLLM's extra sampling parameters
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = None
    # vLLM's structured outputs (axon/entrypoints/openai/structured_outputs.py reads them)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    request_id: str | None = None
    # Disaggregated prefill/decode (vLLM's protocol; axon/kv_transfer/): do_remote_decode asks a
    # prefill server to keep the prompt's KV; a decode server loads it as the params say.
    kv_transfer_params: dict[str, Any] | None = None


# ---- chat ------------------------------------------------------------------------------------
class ImageURL(RequestModel):
    url: str
    detail: str | None = None  # accepted, as OpenAI's; the processor decides the resolution


class ChatContentPart(RequestModel):
    type: str
    text: str | None = None
    image_url: ImageURL | None = None  # type "image_url": a data:, http(s):// or file:// URL


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = Field(default=None, description="deprecated: max_completion_tokens")
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = True
    # How long a reasoning model thinks: handed to the chat template (GPT-OSS's renders it)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogprobsContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatCompletionLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobsContent] | None = None


class ChatCompletionMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill server's: where to load the KV


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}  # as OpenAI's deltas


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- responses (axon/entrypoints/openai/serving_responses.py reads the items) ----------------
class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    reasoning: dict[str, Any] | None = None  # {"effort": "low" | "medium" | "high", "summary": ...}
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    metadata: dict[str, Any] | None = None
    user: str | None = None


# ---- Anthropic messages (axon/entrypoints/openai/serving_messages.py reads the blocks) -------
class CountTokensRequest(RequestModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # accepted; a reasoning parser decides what is thinking


# ---- completions -----------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    # vLLM's: prompts given as embeddings, each the base64 of a torch.save'd [num_tokens, hidden]
    # tensor (the server needs --enable-prompt-embeds)
    prompt_embeds: str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    response_format: dict[str, Any] | None = None
    add_special_tokens: bool = True


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill server's: where to load the KV


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenization --------------------------------------------------------------------
class LoadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str
    lora_int_id: int | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "axon"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def _tokenize_kind(body: Any) -> str:
    chat = isinstance(body, TokenizeChatRequest) or (isinstance(body, dict) and "messages" in body)
    return "TokenizeChatRequest" if chat else "TokenizeCompletionRequest"


# Discriminated by the presence of ``messages``, so that errors come from the one form the client
# meant. Error locations carry the tag (the class name); the error handler drops UNION_TAGS.
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]
UNION_TAGS = frozenset({"TokenizeCompletionRequest", "TokenizeChatRequest"})


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings request, with vLLM's extras (truncate_prompt_tokens, normalize)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class ScoreRequest(RequestModel):
    """vLLM's /score request: one text_1 against every text_2, or text_1[i] with text_2[i]."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    encoding_format: Literal["float", "base64"] = "float"  # accepted; scores are always floats
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankRequest(RequestModel):
    """vLLM's /rerank (Jina's and Cohere's shape): ``documents`` ranked by their score against
    ``query``, best first."""

    model: str | None = None
    query: str
    documents: list[str | dict[str, Any]]  # strings, or {"text": ...} objects
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None


class RerankResult(OpenAIBaseModel):
    index: int
    document: dict[str, str] | None = None
    relevance_score: float


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: dict[str, int]
    results: list[RerankResult]


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo
