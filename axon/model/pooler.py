"""Poolers: per-token hidden states -> one vector per sequence, as sentence-transformers does.

The pooling of a model folder is read from its sentence-transformers files: ``modules.json``
lists the modules (a ``Pooling`` module with its folder, and a ``Normalize`` module when the
embeddings are unit vectors), ``<pooling folder>/config.json`` names the mode, and
``sentence_bert_config.json`` the maximum sequence length. A folder without them pools by the
model kind's default and normalizes, as vLLM does: CLS for encoders (BERT's own convention), LAST
for decoders used as embedders (Qwen3-Embedding). ``pooler_config`` (``--pooler-config``, vLLM's
name) overrides both:

    {"pooling_type": "LAST" | "MEAN" | "CLS" | "MAX", "normalize": bool, "instruction": str}

``instruction`` is prepended to every text prompt (not to token-id prompts), for embedders
trained with a task prefix, e.g. Qwen3-Embedding's "Instruct: <task>\nQuery:".
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from axon.config import ModelConfig
from axon.model.registry import resolve_model_class

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' config key -> axon's pooling type
_ST_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": "MAX",
    "pooling_mode_lasttoken": "LAST",
}
_OVERRIDE_KEYS = ("pooling_type", "normalize", "instruction")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "CLS"  # MEAN | CLS | MAX | LAST
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json's limit, if any
    instruction: str = ""  # prepended to text prompts


def model_pooler_config(model_config: ModelConfig) -> PoolerConfig:
    """The pooling of a resolved pooling model: its folder's, its kind's default, then overrides."""
    assert model_config.model_path is not None and model_config.hf_config is not None
    cls = resolve_model_class(model_config.hf_config.get("architectures"), "pooling")
    default_type = getattr(cls, "default_pooling_type", "CLS")
    return resolve_pooler_config(model_config.model_path, default_type, model_config.pooler_config)


def resolve_pooler_config(
    folder: str, default_pooling_type: str, overrides: dict[str, Any] | None
) -> PoolerConfig:
    """The folder's sentence-transformers pooling (or the model kind's default), then overrides."""
    cfg = read_pooler_config(folder, default_pooling_type)
    if not overrides:
        return cfg
    if not isinstance(overrides, dict):
        raise ValueError(f"pooler_config must be a JSON object, got {overrides!r}")  # noqa: TRY004
    unknown = sorted(set(overrides) - set(_OVERRIDE_KEYS))
    if unknown:
        raise ValueError(
            f"pooler_config has unknown key {unknown[0]!r}; supported: {', '.join(_OVERRIDE_KEYS)}"
        )
    pooling_type = str(overrides.get("pooling_type", cfg.pooling_type)).upper()
    if pooling_type not in POOLERS:
        raise ValueError(
            f"pooler_config pooling_type {overrides['pooling_type']!r} is not supported; "
            f"supported: {', '.join(sorted(POOLERS))}"
        )
    normalize = overrides.get("normalize", cfg.normalize)
    if not isinstance(normalize, bool):
        raise ValueError(f"pooler_config normalize must be true or false, got {normalize!r}")  # noqa: TRY004
    instruction = overrides.get("instruction", cfg.instruction)
    if not isinstance(instruction, str):
        raise ValueError(f"pooler_config instruction must be a string, got {instruction!r}")  # noqa: TRY004
    return replace(cfg, pooling_type=pooling_type, normalize=normalize, instruction=instruction)


def read_pooler_config(folder: str, default_pooling_type: str = "CLS") -> PoolerConfig:
    modules = _read_json(os.path.join(folder, "modules.json"))
    if not isinstance(modules, list):
        return PoolerConfig(pooling_type=default_pooling_type, max_seq_length=_max_seq_length(folder))
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    pooling_type = default_pooling_type
    if _ST_POOLING in types:
        pooling_path = os.path.join(folder, types[_ST_POOLING].get("path", ""), "config.json")
        pooling_type = _pooling_type(_read_json(pooling_path) or {}, pooling_path)
    return PoolerConfig(
        pooling_type=pooling_type, normalize=_ST_NORMALIZE in types, max_seq_length=_max_seq_length(folder)
    )


def _pooling_type(cfg: dict[str, Any], path: str) -> str:
    if cfg.get("pooling_mode"):  # newer sentence-transformers write one string
        mode = str(cfg["pooling_mode"]).upper()
        mode = {"MEAN_TOKENS": "MEAN", "CLS_TOKEN": "CLS", "MAX_TOKENS": "MAX", "LASTTOKEN": "LAST"}.get(
            mode, mode
        )
        if mode in POOLERS:
            return mode
        raise ValueError(
            f"{path}: pooling_mode {cfg['pooling_mode']!r} is not supported; supported: {sorted(POOLERS)}"
        )
    chosen = [mode for key, mode in _ST_MODES.items() if cfg.get(key)]
    unsupported = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if unsupported or len(chosen) != 1:
        raise ValueError(
            f"{path}: exactly one of {sorted(_ST_MODES)} must be true (got {chosen + unsupported}); "
            "combined or other pooling modes are not supported"
        )
    return chosen[0]


def _max_seq_length(folder: str) -> int | None:
    cfg = _read_json(os.path.join(folder, "sentence_bert_config.json"))
    value = cfg.get("max_seq_length") if isinstance(cfg, dict) else None
    return int(value) if value else None


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def _cls(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[:, 0]


def _max(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden.masked_fill(~mask.bool().unsqueeze(-1), float("-inf")).amax(1)


def _last(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Rows are right-padded: a row's last real token sits at (its length - 1).
    last = mask.sum(1).clamp(min=1) - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


# hidden [B, L, H], attention_mask [B, L] (1 for real tokens, right-padded) -> [B, H]
POOLERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "MEAN": _mean,
    "CLS": _cls,
    "MAX": _max,
    "LAST": _last,
}


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """[B, L, H] -> [B, H] in float32 (pooling and normalizing never run in low precision)."""
    return POOLERS[pooling_type](hidden.float(), attention_mask)


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """[H] -> [dimensions or H]: Matryoshka truncation first, then L2 normalization."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return F.normalize(vector, p=2, dim=-1) if normalize else vector
