"""Batch invariance of the CPU attention kernels: a query row's output, bit for bit, does not
depend on how its request reached the step or on what else the step holds.

The same request (its keys at fixed places of one paged cache) attends from its last position
as a decode alone, as one decode among 1 to 32 others, as the last row of its whole prefill, as
the last rows of a segment over a cached prefix (a prefix-cache hit, a chunked prefill), and
beside prefills of other requests; every one of these must give the same bits, in float32 and
bfloat16, through the AVX-512 kernels and through the plain loops. (With AXON_BATCH_INVARIANT=0
short items take the few-rows path, whose sums run in another order: that opt-out is checked
against the reference in test_attention_fast.py, not here.)
"""

from __future__ import annotations

import random

import pytest
import torch

from axon.platforms.cpu_kernels import load_cpu_kernels


@pytest.fixture(params=["avx512", "generic"])
def kernels(request: pytest.FixtureRequest, kernel_cache_root: str):
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: axon's CPU kernels cannot be built here")
    torch.ops.axon_cpu.set_generic(request.param == "generic")
    torch.ops.axon_cpu.set_batch_invariant(True)
    try:
        yield request.param
    finally:
        torch.ops.axon_cpu.set_generic(False)


class PagedCache:
    """One KV cache whose requests each own shuffled blocks; the target is request 0."""

    def __init__(
        self, lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype, seed: int
    ) -> None:
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        per_req = [-(-n // block_size) for n in lens]
        ids = list(range(1, sum(per_req) + 1))
        rng.shuffle(ids)
        self.tables = []
        for n in per_req:
            self.tables.append(ids[:n])
            ids = ids[n:]
        shape = (sum(per_req) + 1, block_size, kv_heads, head_dim)
        self.k = torch.randn(shape, generator=gen).to(dtype)
        self.v = torch.randn(shape, generator=gen).to(dtype)
        self.lens = lens

    def attend(
        self, q_rows: dict[int, torch.Tensor], order: list[int], scale: float
    ) -> dict[int, torch.Tensor]:
        """One step: request r (in ``order``) attends from its last len(q_rows[r]) positions."""
        width = max(len(self.tables[r]) for r in order)
        table = torch.zeros(len(order), width, dtype=torch.int64)
        qsl, seq_lens = [0], []
        for i, r in enumerate(order):
            table[i, : len(self.tables[r])] = torch.tensor(self.tables[r])
            qsl.append(qsl[-1] + q_rows[r].shape[0])
            seq_lens.append(self.lens[r])
        q = torch.cat([q_rows[r] for r in order])
        out = torch.ops.axon_cpu.paged_attention(
            q,
            self.k,
            self.v,
            table,
            torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32),
            q.shape[0],
            scale,
        )
        return {r: out[qsl[i] : qsl[i + 1]] for i, r in enumerate(order)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("gqa", "head_dim", "block_size"), [(3, 64, 16), (1, 32, 8), (8, 128, 32), (2, 24, 16)]
)
def test_a_row_is_the_same_however_its_step_is_made(
    kernels: str, dtype, gqa: int, head_dim: int, block_size: int
) -> None:
    rng = random.Random(head_dim * 7 + gqa)
    kv_heads, target_len = 2, 150
    lens = [target_len] + [rng.randint(1, 300) for _ in range(40)]
    cache = PagedCache(lens, kv_heads, head_dim, block_size, dtype, seed=head_dim)
    gen = torch.Generator().manual_seed(1)
    # The target's query rows for every position; the last row is the one compared.
    q_all = torch.randn(target_len, kv_heads * gqa, head_dim, generator=gen).to(dtype)
    q_other = {
        r: torch.randn(lens[r], kv_heads * gqa, head_dim, generator=gen).to(dtype)
        for r in range(1, len(lens))
    }
    scale = head_dim**-0.5

    def last_row(target_rows: int, companions: list[int], companion_rows) -> torch.Tensor:
        q = {0: q_all[-target_rows:]}
        q.update({r: q_other[r][-companion_rows(r) :] for r in companions})
        order = [0] + companions
        rng.shuffle(order)
        return cache.attend(q, order, scale)[0][-1]

    alone = last_row(1, [], None)
    ways = {
        "whole prefill": last_row(target_len, [], None),
        "segment over a cached prefix (33 rows)": last_row(33, [], None),
        "segment of 2 rows": last_row(2, [], None),
    }
    for n in (1, 3, 7, 16, 32):
        ways[f"decode among {n} decodes"] = last_row(1, rng.sample(range(1, len(lens)), n), lambda r: 1)
    mixed = rng.sample(range(1, len(lens)), 6)
    ways["decode beside prefills"] = last_row(1, mixed, lambda r: rng.randint(1, lens[r]))
    ways["segment beside decodes"] = last_row(20, mixed, lambda r: 1)
    for how, row in ways.items():
        assert torch.equal(row, alone), f"{how}: differs from the decode alone ({kernels}, {dtype})"
