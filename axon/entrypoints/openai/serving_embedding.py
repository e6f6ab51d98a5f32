"""POST /v1/embeddings: OpenAI's request and response shapes. Inputs are tokenized here (off
the loop); the engine-core process embeds them, batched with every other request."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import Request

from axon.engine.input_processor import PromptType
from axon.engine.pooling_inputs import PoolingInput
from axon.entrypoints.openai.errors import bad_request
from axon.entrypoints.openai.protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingResponse,
    PoolingResponseData,
    UsageInfo,
)
from axon.entrypoints.openai.serving_engine import OpenAIServing
from axon.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(
        self, request: EmbeddingRequest, raw_request: Request | None = None
    ) -> EmbeddingResponse:
        self.check_model(request.model)
        self.check_accepting()
        engine = self.engine
        prompts = _prompts(request.input)
        params = _pooling_params(request)
        items: list[PoolingInput] = []
        try:  # every input is checked (tokenized, off the loop) before any runs
            for prompt in prompts:
                items.append(await self.off_loop(engine.process_pooling, prompt, params))
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(str(e))) from e
        outputs = await self.embed_all(items, raw_request)
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        data = [
            EmbeddingResponseData(index=i, embedding=_encode(o.outputs.embedding, request.encoding_format))
            for i, o in enumerate(outputs)
        ]
        return EmbeddingResponse(
            model=self.model_name,
            data=data,
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens, completion_tokens=None),
        )

    async def create_pooling(
        self, request: EmbeddingRequest, raw_request: Request | None = None
    ) -> PoolingResponse:
        """vLLM's /pooling: the pooled vectors of an embedding model, in the pooling shape."""
        embedded = await self.create_embedding(request, raw_request)
        return PoolingResponse(
            model=embedded.model,
            data=[PoolingResponseData(index=d.index, data=d.embedding) for d in embedded.data],
            usage=embedded.usage,
        )


def _prompts(value: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """OpenAI's four input forms: a string, strings, one token-id list, token-id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request("input must not be an empty list", param="input")
    if all(isinstance(t, int) for t in value):
        return [{"prompt_token_ids": list(value)}]  # type: ignore[arg-type]
    return [p if isinstance(p, str) else {"prompt_token_ids": list(p)} for p in value]  # type: ignore[union-attr]


def _pooling_params(request: EmbeddingRequest) -> PoolingParams:
    try:
        return PoolingParams(
            dimensions=request.dimensions,
            normalize=request.normalize,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
    except ValueError as e:  # PoolingParams' messages begin with the field's name
        raise bad_request(str(e), param=str(e).split(" ", 1)[0]) from e


def _param_of(message: str) -> str:
    for name in ("dimensions", "truncate_prompt_tokens"):
        if message.startswith(name):
            return name
    return "input"


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    # OpenAI's base64 format: the raw little-endian float32 bytes.
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
