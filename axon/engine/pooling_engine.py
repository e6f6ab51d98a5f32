"""PoolingEngine: prompts -> validated token ids -> encoder batches -> EmbeddingRequestOutputs.

Used by ``LLM(runner="pooling")`` and, on a worker thread, by the server's ``AsyncPoolingLLM``.
An embedding request is one whole-sequence forward with no decode and no sampling, so it does
not go through the scheduler's token-count loop: every prompt is validated first (a bad one
changes nothing), then all run through the ``PoolingRunner`` in length-sorted padded batches.
Scoring (``score``) embeds both sides and returns the cosine similarity of each pair.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from axon.config import AxonConfig
from axon.engine.input_processor import InputProcessor, PromptType, validate_token_ids
from axon.engine.tokenizer import get_tokenizer
from axon.model.pooler import PoolerConfig, finish_embedding, model_pooler_config
from axon.outputs import EmbeddingOutput, EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from axon.pooling_params import PoolingParams
from axon.worker.pooling_runner import PoolingRunner


class PoolingEngine:
    def __init__(self, config: AxonConfig) -> None:
        self.config = config
        m = config.model_config
        assert m.tokenizer is not None and m.model_path is not None and m.max_model_len is not None
        assert m.hf_config is not None, "resolve_config() comes first"
        self.tokenizer = get_tokenizer(m.tokenizer)
        self.inputs = InputProcessor(m, self.tokenizer)
        self.max_model_len = m.max_model_len
        self.vocab_size = self.inputs.vocab_size
        self.pooler_config: PoolerConfig = model_pooler_config(m)
        self.runner = PoolingRunner(config, self.pooler_config)
        self._counter = itertools.count()

    @property
    def embedding_size(self) -> int:
        return self.runner.hidden_size

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def embed(
        self,
        prompts: list[PromptType],
        params: list[PoolingParams],
        on_batch: Callable[[int], object] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One output per prompt, in order. Raises ValueError (before any forward) on bad input."""
        processed = [self.process(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        vectors = self.runner.embed([ids for _, ids in processed], on_batch)
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

    def score(
        self,
        text_1: list[PromptType],
        text_2: list[PromptType],
        params: PoolingParams,
        on_batch: Callable[[int], object] | None = None,
    ) -> list[ScoringRequestOutput]:
        """Cosine similarity of each pair: one text_1 against every text_2, or pairwise."""
        pairs = score_pairs(len(text_1), len(text_2))
        embedded = self.embed(text_1 + text_2, [params] * (len(text_1) + len(text_2)), on_batch)
        left, right = embedded[: len(text_1)], embedded[len(text_1) :]
        outputs = []
        for i, j in pairs:
            a = torch.tensor(left[i].outputs.embedding, dtype=torch.float64)
            b = torch.tensor(right[j].outputs.embedding, dtype=torch.float64)
            outputs.append(
                ScoringRequestOutput(
                    request_id=str(next(self._counter)),
                    outputs=ScoringOutput(float(F.cosine_similarity(a, b, dim=0))),
                    prompt_token_ids=left[i].prompt_token_ids + right[j].prompt_token_ids,
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
        validate_token_ids(ids, self.vocab_size)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}; "
                f"shorten it or pass truncate_prompt_tokens"
            )
        return text, ids

    def _tokenize(self, prompt: PromptType, limit: int | None) -> tuple[str | None, list[int]]:
        is_text = not (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
        text, ids = self.inputs.tokenize(self._with_instruction(prompt) if is_text else prompt)
        if limit is None or len(ids) <= limit:
            return _user_text(prompt, text), ids
        if not is_text:
            return text, ids[-limit:]  # token ids keep their last `limit` (vLLM's side for ids)
        # The tokenizer truncates the text's tokens and keeps its special tokens ([CLS] ... [SEP]).
        ids = list(self.tokenizer(text, truncation=True, max_length=limit)["input_ids"])
        return _user_text(prompt, text), ids

    def _with_instruction(self, prompt: PromptType) -> PromptType:
        """pooler_config's instruction, prepended to a text prompt (an empty text stays empty)."""
        instruction = self.pooler_config.instruction
        if not instruction:
            return prompt
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        if not isinstance(text, str) or not text:
            return prompt  # InputProcessor names what is wrong with it
        return instruction + text if isinstance(prompt, str) else {**prompt, "prompt": instruction + text}


def _user_text(prompt: PromptType, tokenized_text: str | None) -> str | None:
    """The prompt's text as the user gave it (without the instruction)."""
    if isinstance(prompt, str):
        return prompt
    return prompt.get("prompt", tokenized_text) if isinstance(prompt, dict) else tokenized_text


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """(text_1 index, text_2 index) of each score: 1 x N broadcasts text_1, N x N pairs by index."""
    if num_1 == 0 or num_2 == 0:
        raise ValueError("text_1 and text_2 must not be empty")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise ValueError(
            f"text_1 has {num_1} texts and text_2 {num_2}: give one text_1, or as many as text_2"
        )
    return [(i, i) for i in range(num_1)]
