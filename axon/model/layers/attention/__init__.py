"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

from axon.model.layers.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    AttentionType,
    CommonAttentionMetadata,
    Segment,
    describe_step,
    write_kv,
)
from axon.model.layers.attention.cpu_flash import CpuFlashAttentionBackend
from axon.model.layers.attention.cpu_paged import CpuPagedAttentionBackend
from axon.model.layers.attention.reference import ReferenceAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    "reference": ReferenceAttentionBackend,
    "cpu_paged": CpuPagedAttentionBackend,
    "cpu_flash": CpuFlashAttentionBackend,
}
_NEEDS_CACHE_ROOT = frozenset({"cpu_flash"})  # built kernels live under the cache root


def get_attention_backend(name: str, cache_root: str | None = None) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {', '.join(sorted(_BACKENDS))}")
    if name in _NEEDS_CACHE_ROOT:
        return _BACKENDS[name](cache_root)
    return _BACKENDS[name]()


__all__ = [
    "AttentionBackend",
    "AttentionSpec",
    "AttentionType",
    "CommonAttentionMetadata",
    "Segment",
    "describe_step",
    "get_attention_backend",
    "write_kv",
]
