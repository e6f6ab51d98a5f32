"""Attention backends behind one interface, chosen by name."""

from __future__ import annotations

from axon.model.layers.attention.backend import AttentionBackend, AttentionMetadata, write_kv
from axon.model.layers.attention.cpu_paged import CpuPagedAttentionBackend
from axon.model.layers.attention.reference import ReferenceAttentionBackend

_BACKENDS: dict[str, type] = {"reference": ReferenceAttentionBackend, "cpu_paged": CpuPagedAttentionBackend}


def get_attention_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: {', '.join(sorted(_BACKENDS))}")
    return _BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend", "write_kv"]
