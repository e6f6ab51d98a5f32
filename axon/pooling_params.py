"""PoolingParams: vLLM's per-request options of a pooling (embedding) request.

Pure Python (no torch): it crosses the process boundary inside ``EngineCoreRequest``, as
``SamplingParams`` does. Values that need no model are checked here, at construction; the ones
that need the model (``dimensions`` against the embedding size, ``truncate_prompt_tokens``
against ``max_model_len``) are checked by the pooling input processor.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import msgspec

POOLING_TASKS = ("embed",)


@dataclass
class PoolingParams:
    """Embedding options with vLLM's names.

    ``dimensions``: keep the first N dimensions (Matryoshka), then normalize (if normalizing).
    ``normalize``: L2-normalize the vector; None means the model's default (its
    sentence-transformers Normalize module, or ``--pooler-config``).
    ``truncate_prompt_tokens``: keep at most this many prompt tokens (-1: ``max_model_len``);
    text is truncated by the tokenizer (special tokens kept), token ids keep their last N.
    """

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}.")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}.")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {t!r}.")
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")

    def clone(self) -> PoolingParams:
        return copy.deepcopy(self)

    def for_engine(self, default_normalize: bool) -> EnginePoolingParams:
        """The engine's resolved record: ``normalize`` filled from the model's default."""
        normalize = default_normalize if self.normalize is None else self.normalize
        return EnginePoolingParams(dimensions=self.dimensions, normalize=normalize)


class EnginePoolingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the worker needs to finish a pooled vector, resolved by the front end (the model's
    pooling type is the worker's own). Plain values: decoding re-derives nothing."""

    dimensions: int | None
    normalize: bool


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
