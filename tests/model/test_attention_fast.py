"""The fast CPU attention backends against the reference, on seeded random paged batches.

``cpu_paged`` (pure torch) and ``cpu_flash`` (C++), the latter both through its AVX-512 kernels
(where the CPU has them) and through its plain loops (``set_generic``), which other CPUs run.

Every case builds a KV cache with shuffled block ids, a block table padded with the null block
past each request's blocks, and optionally query rows padded past ``num_actual_tokens``; both
backends must agree to the dtype's rounding, and padding rows must come out as zeros.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from axon.model.layers.attention import AttentionBackend
from axon.model.layers.attention.backend import AttentionSpec, AttentionType, CommonAttentionMetadata
from axon.model.layers.attention.cpu_flash import CpuFlashAttentionBackend
from axon.model.layers.attention.cpu_paged import CpuPagedAttentionBackend
from axon.model.layers.attention.reference import ReferenceAttentionBackend
from axon.platforms.cpu_kernels import load_cpu_kernels

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclass
class Case:
    q: torch.Tensor  # [num_tokens, H, D], rows past num_actual_tokens are padding
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    metadata: CommonAttentionMetadata
    spec: AttentionSpec


def make_case(
    reqs: list[tuple[int, int]],  # (seq_len, q_len) per request, in batch order
    num_kv_heads: int,
    gqa_ratio: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = 32,
    pad_rows: int = 0,
    pad_blocks: int = 0,
) -> Case:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // block_size) for seq_len, _ in reqs]
    num_blocks = sum(blocks_per_req) + 1 + rng.randrange(4)  # block 0 is the null block
    block_ids = list(range(1, num_blocks))
    rng.shuffle(block_ids)
    table = torch.zeros(len(reqs), max(blocks_per_req) + pad_blocks, dtype=torch.int64)
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = torch.tensor(block_ids[:n])
        block_ids = block_ids[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query_start_loc = [0]
    for _, q_len in reqs:
        query_start_loc.append(query_start_loc[-1] + q_len)
    num_tokens = query_start_loc[-1]
    q = torch.randn(num_tokens + pad_rows, num_kv_heads * gqa_ratio, head_dim, generator=gen).to(dtype)
    metadata = CommonAttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.full((num_tokens + pad_rows,), -1, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=[seq_len for seq_len, _ in reqs],
        block_table=table,
        block_size=block_size,
    )
    spec = AttentionSpec(q.shape[1], num_kv_heads, head_dim, head_dim**-0.5)
    return Case(q, k_cache, v_cache, metadata, spec)


def random_reqs(rng: random.Random, num_reqs: int, max_len: int) -> list[tuple[int, int]]:
    """A ragged mix of decodes, fresh prefills and prefills over a cached prefix."""
    reqs = []
    for _ in range(num_reqs):
        seq_len = rng.randint(1, max_len)
        kind = rng.choice(["decode", "prefill", "prefix"])
        if kind == "decode":
            q_len = 1
        elif kind == "prefill":
            q_len = seq_len
        else:
            q_len = rng.randint(1, seq_len)
        reqs.append((seq_len, q_len))
    return reqs


def run(backend: AttentionBackend, case: Case) -> torch.Tensor:
    """One step of one layer: the backend builds its metadata, then attends."""
    metadata = backend.build_metadata(case.metadata)
    return backend.forward(case.q, case.k_cache, case.v_cache, metadata, case.spec)


@pytest.fixture(params=["cpu_paged", "cpu_flash", "cpu_flash_generic", "cpu_flash_few_rows"])
def fast(request: pytest.FixtureRequest, kernel_cache_root: str):
    """The backend under test; every test below runs once for each. ``cpu_flash_few_rows``: the
    opt-out from batch invariance (AXON_BATCH_INVARIANT=0), short items on the few-rows path."""
    if request.param == "cpu_paged":
        yield CpuPagedAttentionBackend()
        return
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: cpu_flash cannot be built here")
    backend = CpuFlashAttentionBackend(kernel_cache_root)
    torch.ops.axon_cpu.set_generic(request.param == "cpu_flash_generic")
    torch.ops.axon_cpu.set_batch_invariant(request.param != "cpu_flash_few_rows")
    try:
        yield backend
    finally:
        torch.ops.axon_cpu.set_generic(False)
        torch.ops.axon_cpu.set_batch_invariant(True)


def check(fast: object, case: Case) -> None:
    want = run(ReferenceAttentionBackend(), case)
    got = run(fast, case)
    tol = TOLERANCE[case.q.dtype]
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    n = case.metadata.num_actual_tokens
    assert bool((got[n:] == 0).all()), "padding rows must be zeros"
    assert bool((want[n:] == 0).all()), "the reference must zero padding rows too"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("gqa_ratio", [1, 2, 3, 4, 8])
def test_mixed_ragged_batch(fast: object, gqa_ratio: int, block_size: int, dtype: torch.dtype) -> None:
    seed = gqa_ratio * 1000 + block_size
    rng = random.Random(seed)
    reqs = random_reqs(rng, num_reqs=rng.randint(2, 6), max_len=2 * block_size + 5)
    check(
        fast, make_case(reqs, 2, gqa_ratio, block_size, dtype, seed, pad_rows=rng.randint(0, 5), pad_blocks=3)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gqa_ratio", [1, 3, 8])
def test_decodes_only(fast: object, gqa_ratio: int, dtype: torch.dtype) -> None:
    rng = random.Random(gqa_ratio)
    reqs = [(rng.randint(1, 200), 1) for _ in range(13)]
    check(fast, make_case(reqs, 2, gqa_ratio, 16, dtype, gqa_ratio, pad_rows=3, pad_blocks=5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decodes_filling_their_blocks(fast: object, dtype: torch.dtype) -> None:
    # Every seq_len a multiple of block_size: the unmasked decode path.
    check(fast, make_case([(32, 1), (32, 1), (32, 1)], 4, 2, 16, dtype, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_equal_prefills_batched(fast: object, dtype: torch.dtype) -> None:
    # Same-length fresh prefills share one causal call; lengths not a multiple of block_size.
    check(fast, make_case([(37, 37)] * 4, 3, 3, 16, dtype, 11, pad_rows=2, pad_blocks=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefix_hits(fast: object, dtype: torch.dtype) -> None:
    # Same query count over different cached prefixes (one group, bottom-right causal mask),
    # and a single query over a long prefix among prefills.
    reqs = [(40, 9), (9, 9), (70, 9), (100, 1), (64, 33)]
    check(fast, make_case(reqs, 2, 4, 16, dtype, 13, pad_rows=4, pad_blocks=1))


def test_interleaved_groups(fast: object) -> None:
    # Decodes and prefills alternate, so no group owns a contiguous run of rows.
    reqs = [(50, 1), (20, 20), (31, 1), (20, 20), (5, 1), (44, 12)]
    check(fast, make_case(reqs, 2, 2, 8, torch.float32, 17, pad_rows=1))


def test_padding_rows_do_not_change_real_rows(fast: object) -> None:
    case = make_case([(30, 1), (25, 25), (60, 4)], 2, 2, 16, torch.bfloat16, 19, pad_rows=6)
    first = run(fast, case)
    case.q[case.metadata.num_actual_tokens :] = 1e4
    second = run(fast, case)
    assert torch.equal(first, second)
    assert bool(torch.isfinite(second).all())


def test_non_contiguous_q(fast: object) -> None:
    # q as the model hands it over: a column slice of a fused qkv projection.
    case = make_case([(20, 1), (33, 33), (50, 6)], 2, 3, 16, torch.bfloat16, 29, pad_rows=2)
    fused = torch.cat([case.q.flatten(1), torch.randn(len(case.q), 64).to(case.q.dtype)], dim=1)
    case.q = fused[:, : case.q[0].numel()].view(case.q.shape)
    assert not case.q.is_contiguous()
    check(fast, case)


@torch.inference_mode()
def test_each_step_builds_its_own_metadata(fast: AttentionBackend) -> None:
    # One backend serves every layer and step (under inference mode, as in the runner): a step
    # whose table or lengths changed gets metadata of its own, and shared gather buffers never
    # carry one step's blocks into the next.
    backend, reference = fast, ReferenceAttentionBackend()
    case = make_case([(30, 1), (45, 1)], 2, 2, 16, torch.float32, 23, pad_blocks=2)
    first = backend.build_metadata(case.metadata)
    torch.testing.assert_close(run(backend, case), run(reference, case))
    table = case.metadata.block_table
    table.copy_(table.flip(0))
    torch.testing.assert_close(run(backend, case), run(reference, case))
    case.metadata.seq_lens = [31, 46]
    torch.testing.assert_close(run(backend, case), run(reference, case))
    # Every layer of a step reads the same metadata: twice through one record, same answer.
    again = backend.build_metadata(case.metadata)
    out = [backend.forward(case.q, case.k_cache, case.v_cache, again, case.spec) for _ in range(2)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
    assert first is not again


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("gqa_ratio", "head_dim"), [(1, 32), (4, 64), (2, 24)])
def test_encoder_sequences_attend_themselves_whole(
    fast: AttentionBackend, dtype: torch.dtype, gqa_ratio: int, head_dim: int
) -> None:
    # BERT-style steps: sequences from 1 token to past a work item's query chunk, each attending
    # to all of its own tokens and to no other (the reference: one unmasked SDPA per sequence).
    rng = random.Random(11)
    lens = [rng.randint(1, 90) for _ in range(9)] + [1, 70]
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    gen = torch.Generator().manual_seed(11)
    kv_heads, pad_rows = 2, 5
    q = torch.randn(qsl[-1] + pad_rows, kv_heads * gqa_ratio, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(qsl[-1] + pad_rows, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    spec = AttentionSpec(q.shape[1], kv_heads, head_dim, head_dim**-0.5, AttentionType.ENCODER_ONLY)
    common = CommonAttentionMetadata(
        num_actual_tokens=qsl[-1],
        slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=lens,
        block_table=torch.zeros(len(lens), -(-max(lens) // 16), dtype=torch.int64),  # no cache: unread
        block_size=16,
    )
    got = fast.forward_encoder(q, k, v, fast.build_metadata(common), spec)
    want = torch.zeros_like(q)
    for a, b in zip(qsl, qsl[1:]):
        per_head = [x[a:b].float().transpose(0, 1) for x in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*per_head, scale=spec.scale, enable_gqa=True)
        want[a:b] = out.transpose(0, 1).to(dtype)
    tol = TOLERANCE[dtype]
    assert got.shape == q.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert bool((got[qsl[-1] :] == 0).all()), "padding rows must be zeros"
