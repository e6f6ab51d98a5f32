"""Poolers: per-token hidden states -> one vector per sequence, as sentence-transformers does.

The pooling of a model folder is read from its sentence-transformers files: ``modules.json``
lists the modules (a ``Pooling`` module with its folder, and a ``Normalize`` module when the
embeddings are unit vectors), ``<pooling folder>/config.json`` names the mode, and
``sentence_bert_config.json`` the maximum sequence length. A folder without them pools by CLS
token (BERT's own convention) and normalizes, as vLLM does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' config key -> axon's pooling type
_ST_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_max_tokens": "MAX",
}


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str = "CLS"  # MEAN | CLS | MAX
    normalize: bool = True
    max_seq_length: int | None = None  # sentence_bert_config.json's limit, if any


def read_pooler_config(folder: str) -> PoolerConfig:
    modules = _read_json(os.path.join(folder, "modules.json"))
    if not isinstance(modules, list):
        return PoolerConfig(max_seq_length=_max_seq_length(folder))
    types = {m.get("type"): m for m in modules if isinstance(m, dict)}
    pooling_type = "CLS"
    if _ST_POOLING in types:
        pooling_path = os.path.join(folder, types[_ST_POOLING].get("path", ""), "config.json")
        pooling_type = _pooling_type(_read_json(pooling_path) or {}, pooling_path)
    return PoolerConfig(
        pooling_type=pooling_type, normalize=_ST_NORMALIZE in types, max_seq_length=_max_seq_length(folder)
    )


def _pooling_type(cfg: dict[str, Any], path: str) -> str:
    if cfg.get("pooling_mode"):  # newer sentence-transformers write one string
        mode = str(cfg["pooling_mode"]).upper()
        mode = {"MEAN_TOKENS": "MEAN", "CLS_TOKEN": "CLS", "MAX_TOKENS": "MAX"}.get(mode, mode)
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


# hidden [B, L, H], attention_mask [B, L] (1 for real tokens) -> [B, H]
POOLERS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "MEAN": _mean,
    "CLS": _cls,
    "MAX": _max,
}


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """[B, L, H] -> [B, H] in float32 (pooling and normalizing never run in low precision)."""
    return POOLERS[pooling_type](hidden.float(), attention_mask)


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """[H] -> [dimensions or H]: Matryoshka truncation first, then L2 normalization."""
    if dimensions is not None:
        vector = vector[:dimensions]
    return F.normalize(vector, p=2, dim=-1) if normalize else vector
