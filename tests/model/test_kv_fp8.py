"""The FP8 KV cache in ``cpu_flash``: reading E4M3/E5M2 blocks equals the reference attention
over the same FP8 values (the same rounding), on the AVX-512 and the plain-loop paths; writing
stores k / k_scale (saturated, rounded as torch rounds to FP8) and attends with the scales;
scales left at 0 are calculated from the first write (amax / 200 for K, amax / 100 for V)."""

from __future__ import annotations

import random

import pytest
import torch
from test_attention_fast import make_case, random_reqs, run

from axon.model.layers.attention.cpu_flash import CpuFlashAttentionBackend
from axon.model.layers.attention.reference import ReferenceAttentionBackend
from axon.platforms.cpu_kernels import load_cpu_kernels

FP8 = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}


@pytest.fixture(params=["avx512", "generic"])
def flash(request: pytest.FixtureRequest, kernel_cache_root: str):
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: cpu_flash cannot be built here")
    backend = CpuFlashAttentionBackend(kernel_cache_root)
    torch.ops.axon_cpu.set_generic(request.param == "generic")
    try:
        yield backend
    finally:
        torch.ops.axon_cpu.set_generic(False)


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("seed", range(3))
def test_reading_fp8_blocks_equals_the_reference_on_the_same_values(
    flash: CpuFlashAttentionBackend, fmt: str, q_dtype: torch.dtype, seed: int
) -> None:
    fp8, _ = FP8[fmt]
    reqs = random_reqs(random.Random(seed), num_reqs=5, max_len=70)
    case = make_case(
        reqs, num_kv_heads=2, gqa_ratio=3, block_size=16, dtype=torch.float32, seed=seed, head_dim=64
    )
    case.q = case.q.to(q_dtype)
    case.k_cache, case.v_cache = case.k_cache.to(fp8), case.v_cache.to(fp8)
    got = run(flash, case)
    reference = make_case(reqs, 2, 3, 16, torch.float32, seed, head_dim=64)
    reference.q = case.q.float()
    reference.k_cache, reference.v_cache = case.k_cache.float(), case.v_cache.float()
    want = run(ReferenceAttentionBackend(), reference)
    tolerance = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def _step(flash: CpuFlashAttentionBackend, case, k, v, scales: torch.Tensor) -> torch.Tensor:
    metadata = flash.build_metadata(case.metadata)
    torch.ops.axon_cpu.set_attention_step(
        [case.k_cache],
        [case.v_cache],
        case.metadata.slot_mapping,
        case.metadata.block_table,
        metadata.query_start_loc,
        metadata.seq_lens,
        case.metadata.num_actual_tokens,
        scales,
        [],  # no sliding windows
        [],  # no sinks
    )
    try:
        return torch.ops.axon_cpu.attention(case.q, k, v, 0, case.spec.scale)
    finally:
        torch.ops.axon_cpu.clear_attention_step()


@pytest.mark.parametrize("fmt", sorted(FP8))
@pytest.mark.parametrize("calculate", [False, True])
def test_writing_stores_scaled_saturated_fp8_and_attends_with_the_scales(
    flash: CpuFlashAttentionBackend, fmt: str, calculate: bool
) -> None:
    fp8, limit = FP8[fmt]
    # One fresh prefill of 40 tokens (it writes them all) and a decode over 20 cached tokens.
    case = make_case([(40, 40), (21, 1)], 2, 2, 16, torch.float32, seed=7, head_dim=32)
    case.k_cache, case.v_cache = case.k_cache.to(fp8), case.v_cache.to(fp8)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(41, 2, 32, generator=gen) * 30
    v = torch.randn(41, 2, 32, generator=gen) * 3
    k[0, 0, 0] = 1e6  # saturates
    table = case.metadata.block_table
    slots = [int(table[0, t // 16]) * 16 + t % 16 for t in range(40)] + [int(table[1, 1]) * 16 + 4]
    case.metadata.slot_mapping = torch.tensor(slots)
    scales = torch.zeros(1, 2) if calculate else torch.tensor([[0.5, 0.25]])
    got = _step(flash, case, k, v, scales)
    if calculate:
        expected = [k.abs().max() / 200, v.abs().max() / 100]
        torch.testing.assert_close(scales[0], torch.stack(expected))
    k_scale, v_scale = float(scales[0, 0]), float(scales[0, 1])
    stored_k = (k / k_scale).clamp(-limit, limit).to(fp8)
    stored_v = (v / v_scale).clamp(-limit, limit).to(fp8)
    flat_k, flat_v = case.k_cache.view(-1, 2, 32), case.v_cache.view(-1, 2, 32)
    assert torch.equal(flat_k[slots].view(torch.uint8), stored_k.view(torch.uint8))
    assert torch.equal(flat_v[slots].view(torch.uint8), stored_v.view(torch.uint8))
    # The reference reads the same FP8 values, times the scales.
    reference = make_case([(40, 40), (21, 1)], 2, 2, 16, torch.float32, seed=7, head_dim=32)
    reference.q = case.q
    reference.k_cache, reference.v_cache = case.k_cache.float() * k_scale, case.v_cache.float() * v_scale
    want = run(ReferenceAttentionBackend(), reference)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_an_fp8_cache_without_scales_is_an_error(flash: CpuFlashAttentionBackend) -> None:
    case = make_case([(5, 5)], 1, 1, 16, torch.float32, seed=0)
    case.k_cache, case.v_cache = case.k_cache.to(torch.float8_e4m3fn), case.v_cache.to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="FP8 KV cache needs kv_scales"):
        _step(flash, case, torch.zeros(5, 1, 32), torch.zeros(5, 1, 32), None)
