"""POST /score and /v1/score (vLLM's scoring API on a bi-encoder), and /rerank, /v1/rerank and
/v2/rerank (Jina's and Cohere's shape) on top of it.

A pair's score is the cosine similarity of its two embeddings (``score_outputs``), embedded by
the engine core as /v1/embeddings does.
"""

from __future__ import annotations

from fastapi import Request

from axon.engine.pooling_inputs import PoolingInput, score_outputs, score_pairs
from axon.entrypoints.openai.errors import bad_request
from axon.entrypoints.openai.protocol import (
    RerankRequest,
    RerankResponse,
    RerankResult,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    UsageInfo,
)
from axon.entrypoints.openai.serving_engine import OpenAIServing
from axon.pooling_params import PoolingParams


class OpenAIServingScore(OpenAIServing):
    async def create_score(self, request: ScoreRequest, raw_request: Request | None = None) -> ScoreResponse:
        self.check_model(request.model)
        self.check_accepting()
        engine = self.engine
        params = _pooling_params(request)
        texts = {"text_1": _texts(request.text_1, "text_1"), "text_2": _texts(request.text_2, "text_2")}
        items: dict[str, list[PoolingInput]] = {"text_1": [], "text_2": []}
        for name, side in texts.items():  # every text is checked before any runs
            for text in side:
                try:  # tokenized off the loop
                    items[name].append(await self.off_loop(engine.process_pooling, text, params))
                except ValueError as e:
                    raise bad_request(f"{name}: {e}", param=name) from e
        try:
            score_pairs(len(texts["text_1"]), len(texts["text_2"]))
        except ValueError as e:
            raise bad_request(str(e), param="text_2") from e
        embedded = await self.embed_all(items["text_1"] + items["text_2"], raw_request)
        num_1 = len(items["text_1"])
        outputs = score_outputs(embedded[:num_1], embedded[num_1:], "score")
        num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        return ScoreResponse(
            model=self.model_name,
            data=[ScoreResponseData(index=i, score=o.outputs.score) for i, o in enumerate(outputs)],
            usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens, completion_tokens=None),
        )

    async def create_rerank(
        self, request: RerankRequest, raw_request: Request | None = None
    ) -> RerankResponse:
        """The documents' scores against the query (as /score computes them), best first."""
        texts = [_document_text(d, i) for i, d in enumerate(request.documents)]
        if not texts:
            raise bad_request("documents must not be an empty list", param="documents")
        scored = await self.create_score(
            ScoreRequest(
                model=request.model,
                text_1=request.query,
                text_2=texts,
                truncate_prompt_tokens=request.truncate_prompt_tokens,
            ),
            raw_request,
        )
        ranked = sorted(scored.data, key=lambda d: -d.score)[: request.top_n]
        return RerankResponse(
            model=self.model_name,
            usage={"total_tokens": scored.usage.total_tokens},
            results=[
                RerankResult(
                    index=d.index,
                    document={"text": texts[d.index]} if request.return_documents else None,
                    relevance_score=d.score,
                )
                for d in ranked
            ],
        )


def _document_text(document: str | dict, index: int) -> str:
    if isinstance(document, str):
        return document
    text = document.get("text")
    if not isinstance(text, str):
        raise bad_request(f"documents[{index}] must be a string or {{'text': str}}", param="documents")
    return text


def _pooling_params(request: ScoreRequest) -> PoolingParams:
    try:
        return PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens)
    except ValueError as e:
        raise bad_request(str(e), param="truncate_prompt_tokens") from e


def _texts(value: str | list[str], name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise bad_request(f"{name} must not be an empty list", param=name)
    return texts
