"""PoolingEngine: prompts -> validated token ids -> encoder batches -> EmbeddingRequestOutputs.

Used by ``LLM(runner="pooling")``. An embedding request is one whole-sequence forward with no
KV cache, no decode and no sampling, so it does not go through the scheduler's token-count
loop: every prompt is validated first (a bad one changes nothing), then all run through the
``PoolingRunner`` in length-sorted padded batches.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from axon.config import AxonConfig
from axon.engine.input_processor import PromptType
from axon.engine.tokenizer import get_tokenizer
from axon.model.pooler import PoolerConfig, finish_embedding, read_pooler_config
from axon.outputs import EmbeddingOutput, EmbeddingRequestOutput
from axon.pooling_params import PoolingParams
from axon.worker.pooling_runner import PoolingRunner


class PoolingEngine:
    def __init__(self, config: AxonConfig) -> None:
        self.config = config
        m = config.model_config
        assert m.tokenizer is not None and m.model_path is not None and m.max_model_len is not None
        assert m.hf_config is not None, "resolve_config() comes first"
        self.tokenizer = get_tokenizer(m.tokenizer)
        self.max_model_len = m.max_model_len
        self.vocab_size = int(m.hf_config["vocab_size"])
        self.pooler_config: PoolerConfig = read_pooler_config(m.model_path)
        self.runner = PoolingRunner(config, self.pooler_config)
        self._counter = itertools.count()

    @property
    def embedding_size(self) -> int:
        return self.runner.hidden_size

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def embed(self, prompts: list[PromptType], params: list[PoolingParams]) -> list[EmbeddingRequestOutput]:
        """One output per prompt, in order. Raises ValueError (before any forward) on bad input."""
        processed = [self.process(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        vectors = self.runner.embed([ids for _, ids in processed])
        outputs = []
        for (text, ids), p, vector in zip(processed, params, vectors, strict=True):
            outputs.append(
                EmbeddingRequestOutput(
                    request_id=str(next(self._counter)),
                    outputs=EmbeddingOutput(self.finish(vector, p).tolist()),
                    prompt_token_ids=ids,
                    prompt=text,
                )
            )
        return outputs

    def finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        normalize = self.pooler_config.normalize if params.normalize is None else params.normalize
        return finish_embedding(vector, params.dimensions, normalize)

    def process(self, prompt: PromptType, params: PoolingParams) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), validated against the model."""
        if params.dimensions is not None and params.dimensions > self.embedding_size:
            raise ValueError(
                f"dimensions {params.dimensions} exceeds the model's embedding size {self.embedding_size}"
            )
        limit = params.truncate_prompt_tokens
        if limit == -1:
            limit = self.max_model_len
        if limit is not None and limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens {limit} exceeds max_model_len {self.max_model_len}")
        text, ids = self._tokenize(prompt, limit)
        self.validate(ids)
        return text, ids

    def _tokenize(self, prompt: PromptType, limit: int | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            ids = list(ids)
            # Token ids keep their last `limit` tokens (vLLM's truncation side for ids).
            return prompt.get("prompt"), ids[-limit:] if limit is not None else ids
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str):
            raise ValueError(  # noqa: TRY004 (user input: a ValueError, as InputProcessor raises)
                f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                f"got {type(prompt).__name__}"
            )
        if not text:
            raise ValueError("the prompt is empty")
        if limit is None:
            return text, list(self.tokenizer.encode(text))
        # The tokenizer truncates the text's tokens and keeps [CLS] ... [SEP].
        return text, list(self.tokenizer(text, truncation=True, max_length=limit)["input_ids"])

    def validate(self, ids: list[int]) -> None:
        n = len(ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n > self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, more than max_model_len {self.max_model_len}; shorten it "
                f"or pass truncate_prompt_tokens"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
