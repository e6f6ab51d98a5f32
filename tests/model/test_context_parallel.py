"""Decode context parallelism's attention, without processes: D ranks' caches in one test.

Each sequence's K/V is written through ``describe_step``'s slot mapping for rank d of D (position
p on rank p mod D, as its key p // D), each rank attends the queries over its own keys
(``forward_partial``), and ``merge_partials`` must give the attention of the whole sequence,
for the reference backend and for the C++ kernels (AVX-512 and plain loops), whatever the
requests (decodes, prefills, prefills over a cached prefix, queries before a rank's first key).
"""

from __future__ import annotations

import random

import pytest
import torch

from axon.model.layers.attention import AttentionBackend
from axon.model.layers.attention.backend import AttentionSpec, Segment, describe_step, write_kv
from axon.model.layers.attention.context_parallel import merge_partials
from axon.model.layers.attention.cpu_flash import CpuFlashAttentionBackend
from axon.model.layers.attention.reference import NO_SCORE, ReferenceAttentionBackend
from axon.platforms.cpu_kernels import load_cpu_kernels

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(params=["reference", "cpu_flash", "cpu_flash_generic"])
def backend(request: pytest.FixtureRequest, kernel_cache_root: str):
    if request.param == "reference":
        yield ReferenceAttentionBackend()
        return
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: cpu_flash cannot be built here")
    torch.ops.axon_cpu.set_generic(request.param == "cpu_flash_generic")
    try:
        yield CpuFlashAttentionBackend(kernel_cache_root)
    finally:
        torch.ops.axon_cpu.set_generic(False)


def _requests(seed: int, world: int, block_size: int) -> list[tuple[list[int], int, int]]:
    """(block ids, seq_len, queries) per request: block ids as the scheduler hands them out, each
    covering block_size x world positions; the queries are the sequence's last ones."""
    rng = random.Random(seed)
    free = list(range(1, 64))
    rng.shuffle(free)
    reqs = []
    for kind in ["decode", "prefill", "prefix", "short", "decode", "prefix"]:
        seq_len = rng.randint(1, 3) if kind == "short" else rng.randint(2, 150)
        q_len = {"decode": 1, "prefill": seq_len, "short": seq_len}.get(kind) or rng.randint(2, seq_len)
        n = -(-seq_len // (block_size * world))
        reqs.append((free[:n], seq_len, q_len))
        free = free[n:]
    return reqs


def _cache(
    reqs, world: int, rank: int, block_size: int, k_all, v_all, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s cache: every request's K/V written through the step's slot mapping."""
    shape = (64, block_size, *k_all[0].shape[1:])
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    for (ids, seq_len, _), k, v in zip(reqs, k_all, v_all, strict=True):
        step = describe_step([Segment(ids, 0, seq_len)], block_size, dcp=(world, rank))
        write_kv(k, v, k_cache, v_cache, step.slot_mapping)
    return k_cache, v_cache


def _attend_shards(backend: AttentionBackend, world: int, block_size: int, dtype: torch.dtype, gqa: int):
    """(merged partial attention over ``world`` shards, whole-sequence reference attention)."""
    gen = torch.Generator().manual_seed(world * 100 + block_size)
    reqs = _requests(world + block_size, world, block_size)
    kv_heads, head_dim = 1, 32
    k_all = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for _, n, _ in reqs]
    v_all = [torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype) for _, n, _ in reqs]
    num_tokens = sum(q for _, _, q in reqs)
    q = torch.randn(num_tokens + 3, kv_heads * gqa, head_dim, generator=gen).to(dtype)  # 3 padding rows
    spec = AttentionSpec(q.shape[1], kv_heads, head_dim, head_dim**-0.5)
    segments = [Segment(ids, n - q_len, n) for ids, n, q_len in reqs]
    outs, lses = [], []
    for rank in range(world):
        k_cache, v_cache = _cache(reqs, world, rank, block_size, k_all, v_all, dtype)
        step = describe_step(segments, block_size, num_tokens=q.shape[0], dcp=(world, rank))
        out, lse = backend.forward_partial(q, k_cache, v_cache, backend.build_metadata(step), spec)
        assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:2]
        assert bool((out[num_tokens:] == 0).all()) and bool((lse[num_tokens:] == NO_SCORE).all())
        outs.append(out)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    # The same sequences whole, in one unsharded cache, through the reference.
    k_cache, v_cache = _cache(reqs, 1, 0, block_size * world, k_all, v_all, dtype)
    whole = describe_step(segments, block_size * world, num_tokens=q.shape[0])
    want = ReferenceAttentionBackend().forward(q, k_cache, v_cache, whole, spec)
    return merged, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("world", "block_size", "gqa"), [(2, 16, 1), (2, 8, 4), (3, 16, 2), (4, 32, 3)])
def test_merged_shards_equal_whole_sequence_attention(
    backend: AttentionBackend, world: int, block_size: int, gqa: int, dtype: torch.dtype
) -> None:
    merged, want = _attend_shards(backend, world, block_size, dtype, gqa)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(merged.float(), want.float(), atol=tol, rtol=tol)


def test_slot_mapping_writes_each_position_on_exactly_one_rank() -> None:
    """Every position of a sequence lands on rank p mod D, in a distinct slot of the block the
    scheduler gave for it; the other ranks write nothing for it."""
    world, block_size, ids = 3, 4, [7, 2, 9]
    seen = {}
    for rank in range(world):
        slots = describe_step([Segment(ids, 5, 30)], block_size, dcp=(world, rank)).slot_mapping.tolist()
        for p, slot in zip(range(5, 30), slots, strict=True):
            if slot < 0:
                continue
            assert p % world == rank
            assert slot // block_size == ids[p // (block_size * world)]
            seen[(rank, slot)] = p
    assert sorted(seen.values()) == list(range(5, 30))


def test_a_query_before_a_ranks_first_key_reads_nothing_there(backend: AttentionBackend) -> None:
    """Position 0 lives on rank 0: rank 1's partial for it is zeros with log-sum-exp -1e30."""
    q = torch.randn(1, 2, 32)
    cache = torch.randn(4, 16, 1, 32)
    step = describe_step([Segment([1], 0, 1)], 16, dcp=(2, 1))
    out, lse = backend.forward_partial(
        q, cache, cache, backend.build_metadata(step), AttentionSpec(2, 1, 32, 0.2)
    )
    assert bool((out == 0).all()) and bool((lse == NO_SCORE).all()) and lse.shape == (1, 2)


def test_cpu_flash_partials_equal_the_references(kernel_cache_root: str) -> None:
    """Not only the merged result: each rank's output and log-sum-exp."""
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: cpu_flash cannot be built here")
    flash, ref = CpuFlashAttentionBackend(kernel_cache_root), ReferenceAttentionBackend()
    gen = torch.Generator().manual_seed(5)
    world, block_size = 2, 16
    reqs = _requests(11, world, block_size)
    k_all = [torch.randn(n, 2, 64, generator=gen) for _, n, _ in reqs]
    v_all = [torch.randn(n, 2, 64, generator=gen) for _, n, _ in reqs]
    q = torch.randn(sum(q for _, _, q in reqs), 6, 64, generator=gen)
    spec = AttentionSpec(6, 2, 64, 0.125)
    segments = [Segment(ids, n - q_len, n) for ids, n, q_len in reqs]
    for rank in range(world):
        k_cache, v_cache = _cache(reqs, world, rank, block_size, k_all, v_all, torch.float32)
        step = describe_step(segments, block_size, dcp=(world, rank))
        got = flash.forward_partial(q, k_cache, v_cache, flash.build_metadata(step), spec)
        want = ref.forward_partial(q, k_cache, v_cache, step, spec)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_merge_op_equals_the_softmax_weighted_sum(kernel_cache_root: str, dtype: torch.dtype) -> None:
    """The C++ merge on strided views (one rank's heads of every rank's gathered partials), parts
    without keys included, against the torch formula in float64."""
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: the merge op cannot be built here")
    gen = torch.Generator().manual_seed(3)
    outs = torch.randn(3, 5, 8, 32, generator=gen).to(dtype)
    lses = torch.randn(3, 5, 8, generator=gen) * 4
    lses[1, 2] = NO_SCORE  # token 2 has no key on part 1
    lses[:, 4] = NO_SCORE  # token 4 has none anywhere
    outs[:, 4] = 0
    view_o, view_l = outs[:, :, 2:6], lses[:, :, 2:6]
    got = torch.ops.axon_cpu.merge_attention_partials(view_o, view_l)
    weights = torch.softmax(view_l.double(), dim=0).unsqueeze(-1)
    want = (weights * view_o.double()).sum(dim=0)
    assert got.dtype == dtype and got.shape == (5, 4, 32)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert bool((got[4] == 0).all())
