"""Pooling (embedding) requests in the front end: prompt -> validated ``EngineCoreRequest``, and
the scoring of embedded pairs.

Every check runs before the request reaches the engine core (a bad one changes nothing):
``dimensions`` against the embedding size, ``truncate_prompt_tokens`` and the prompt against
``max_model_len``. ``pooler_config``'s instruction is prepended to text prompts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from axon.config import AxonConfig
from axon.engine.input_processor import InputProcessor, PromptType, validate_token_ids
from axon.engine.messages import EngineCoreRequest
from axon.model.pooler import PoolerConfig, model_pooler_config
from axon.outputs import EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput
from axon.pooling_params import PoolingParams


@dataclass
class PoolingInput:
    """One validated embedding request: the prompt as the user gave it and its core request."""

    prompt: str | None
    request: EngineCoreRequest


class PoolingInputProcessor:
    def __init__(self, config: AxonConfig, inputs: InputProcessor) -> None:
        m = config.model_config
        assert m.max_model_len is not None and m.hf_config is not None
        self.inputs = inputs
        self.tokenizer = inputs.tokenizer
        self.max_model_len = m.max_model_len
        self.embedding_size = int(m.hf_config["hidden_size"])
        self.pooler_config: PoolerConfig = model_pooler_config(m)

    def process(self, request_id: str, prompt: PromptType, params: PoolingParams) -> PoolingInput:
        """Raises ValueError naming what is wrong."""
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
        validate_token_ids(ids, self.inputs.vocab_size)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len {self.max_model_len}; "
                f"shorten it or pass truncate_prompt_tokens"
            )
        request = EngineCoreRequest(
            req_id=request_id,
            prompt_token_ids=ids,
            sampling_params=None,
            eos_token_id=None,
            arrival_time=time.time(),
            pooling_params=params.for_engine(self.pooler_config.normalize),
        )
        return PoolingInput(text, request)

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


def score_outputs(
    left: list[EmbeddingRequestOutput], right: list[EmbeddingRequestOutput], request_id: str
) -> list[ScoringRequestOutput]:
    """A bi-encoder's scores: the cosine similarity of each pair's embeddings."""
    outputs = []
    for k, (i, j) in enumerate(score_pairs(len(left), len(right))):
        a = torch.tensor(left[i].outputs.embedding, dtype=torch.float64)
        b = torch.tensor(right[j].outputs.embedding, dtype=torch.float64)
        outputs.append(
            ScoringRequestOutput(
                request_id=f"{request_id}-{k}",
                outputs=ScoringOutput(float(F.cosine_similarity(a, b, dim=0))),
                prompt_token_ids=left[i].prompt_token_ids + right[j].prompt_token_ids,
            )
        )
    return outputs
