"""PoolingRunner: an embedding model on one device, run over padded batches of whole sequences.

The model is an encoder (``BertModel``) or a decoder's embedding adapter
(``decoder_embedding.py``, which keeps its own per-forward KV cache); both take a right-padded
[B, L] batch and its mask. There is no decode: each sequence is computed whole, once. Sequences are
sorted by length and cut into batches of at most ``max_num_seqs`` rows and
``max_num_batched_tokens`` padded tokens, so padding stays small; each batch is one forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from axon.config import AxonConfig
from axon.model.layers.attention import get_attention_backend
from axon.model.layers.linear import resolve_linear_backend
from axon.model.loader.model_loader import load_model
from axon.model.pooler import PoolerConfig, pool
from axon.platforms import resolve_device, resolve_dtype
from axon.platforms.cpu_threads import init_cpu_process


class PoolingRunner:
    def __init__(self, config: AxonConfig, pooler_config: PoolerConfig) -> None:
        self.device = resolve_device(config.device_config.device)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device)
        cache_root = config.model_config.cache_root
        assert cache_root is not None, "resolve_config() sets cache_root"
        d = config.device_config
        cpu_kernels, _ = init_cpu_process(self.device, cache_root, d.num_threads, d.omp_threads_bind)
        # Encoders ignore the backend; a decoder's attention layers run on it (as the worker's do).
        backend = get_attention_backend("reference")
        linear = resolve_linear_backend(
            config.compilation_config.linear_backend, self.dtype, self.device, cpu_kernels
        )
        # Pooling batches are whole prompts: hundreds to thousands of rows.
        self.model = load_model(
            config.model_config, self.dtype, self.device, backend, linear, linear_batch_hint=128
        )
        self.pooler_config = pooler_config
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens or 2048
        self.pad_token_id = int((config.model_config.hf_config or {}).get("pad_token_id") or 0)

    @property
    def hidden_size(self) -> int:
        return self.model.arch.hidden_size

    @torch.inference_mode()
    def embed(
        self, token_ids: list[list[int]], on_batch: Callable[[int], object] | None = None
    ) -> list[torch.Tensor]:
        """Pooled, unnormalized float32 vectors [hidden] on the CPU, in the order given.

        ``on_batch(num_seqs)`` is called after each batch (a progress bar's update).
        """
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))
        out: list[torch.Tensor | None] = [None] * len(token_ids)
        for batch in self._batches([len(token_ids[i]) for i in order]):
            rows = [order[k] for k in batch]
            pooled = self._forward([token_ids[i] for i in rows])  # [B, hidden]
            for i, vector in zip(rows, pooled.cpu(), strict=True):
                out[i] = vector
            if on_batch is not None:
                on_batch(len(rows))
        return out  # type: ignore[return-value]

    def _batches(self, sorted_lens: list[int]) -> list[list[int]]:
        """Consecutive index runs whose padded size (rows x longest) fits the token budget.

        A sequence longer than the budget runs alone (lengths were checked against max_model_len).
        """
        batches: list[list[int]] = []
        current: list[int] = []
        for k, n in enumerate(sorted_lens):
            # Lengths ascend, so n is the longest of current + [k].
            if current and (
                len(current) >= self.max_num_seqs or (len(current) + 1) * n > self.max_num_batched_tokens
            ):
                batches.append(current)
                current = []
            current.append(k)
        if current:
            batches.append(current)
        return batches

    def _forward(self, seqs: list[list[int]]) -> torch.Tensor:
        longest = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), longest), self.pad_token_id, dtype=torch.int64)  # [B, L]
        attention_mask = torch.zeros((len(seqs), longest), dtype=torch.int64)  # [B, L]
        for row, s in enumerate(seqs):
            input_ids[row, : len(s)] = torch.tensor(s, dtype=torch.int64)
            attention_mask[row, : len(s)] = 1
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        hidden = self.model(input_ids, attention_mask)  # [B, L, hidden]
        return pool(hidden, attention_mask, self.pooler_config.pooling_type)  # [B, hidden] float32
