"""axon's fused pointwise CPU kernels (``axon/csrc/cpu_pointwise.cpp``) against plain torch.

RMSNorm (with and without the residual add), SiLU-and-multiply and neox rotary embedding, on
random shapes including widths that are not a multiple of the 16-lane vectors; each row's
output must not depend on how many rows the call has (the models rely on this for batch
invariance), and bad arguments fail with a message naming them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from axon.model.layers.rotary import RotaryEmbedding
from axon.platforms.cpu_kernels import load_cpu_kernels

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]
WIDTHS = [1, 7, 16, 17, 64, 100, 576]
# float32 sums in another order than torch's; the 16-bit types round each output once.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def kernels(kernel_cache_root: str) -> None:
    if not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: axon's CPU kernels cannot be built here")


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * h.to(x.dtype).float()).to(x.dtype)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[got.dtype], rtol=TOL[got.dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("float_weight", [False, True])
def test_rms_norm(dtype: torch.dtype, width: int, float_weight: bool) -> None:
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(37, width, generator=gen) * 3).to(dtype)
    res = torch.randn(37, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(torch.float32 if float_weight else dtype)
    close(torch.ops.axon_cpu.rms_norm(x, w, 1e-6), hf_rms_norm(x, w, 1e-6))
    normed, total = torch.ops.axon_cpu.add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(total, x + res), "the residual sum is rounded once, as torch's add"
    close(normed, hf_rms_norm(x + res, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_and_mul(dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(3, 5, 2 * width, generator=gen) * 4).to(dtype)
    g, u = gate_up.float().chunk(2, dim=-1)
    close(torch.ops.axon_cpu.silu_and_mul(gate_up), (F.silu(g) * u).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("head_dim", [2, 16, 24, 64, 128])
def test_rotary_neox_matches_the_torch_layer(dtype: torch.dtype, head_dim: int) -> None:
    rope = RotaryEmbedding(head_dim, 300, 10000.0, {"rope_type": "default"})
    gen = torch.Generator().manual_seed(head_dim)
    t, heads, kv_heads = 11, 6, 2
    # q and k as views of one fused projection, as the models hand them over.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    positions = torch.randint(0, 300, (t,), generator=gen)
    got_q, got_k = torch.ops.axon_cpu.rotary_neox(positions, q, k, rope.cos_cached, rope.sin_cached)
    cos, sin = rope.cos_cached[positions].unsqueeze(1), rope.sin_cached[positions].unsqueeze(1)
    for got, x in ((got_q, q), (got_k, k)):
        half = head_dim // 2
        xf = x.float()
        rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        close(got, (xf * cos + rotated * sin).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_a_row_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    width, head_dim = 100, 64
    x = torch.randn(33, width, generator=gen).to(dtype)
    res = torch.randn(33, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    gate_up = torch.randn(33, 2 * width, generator=gen).to(dtype)
    q = torch.randn(33, 3, head_dim, generator=gen).to(dtype)
    k = torch.randn(33, 1, head_dim, generator=gen).to(dtype)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, {"rope_type": "default"})
    pos = torch.randint(0, 64, (33,), generator=gen)

    def ops(rows: slice) -> list[torch.Tensor]:
        normed, total = torch.ops.axon_cpu.add_rms_norm(x[rows], res[rows], w, 1e-6)
        rq, rk = torch.ops.axon_cpu.rotary_neox(pos[rows], q[rows], k[rows], rope.cos_cached, rope.sin_cached)
        return [
            torch.ops.axon_cpu.rms_norm(x[rows], w, 1e-6),
            normed,
            total,
            torch.ops.axon_cpu.silu_and_mul(gate_up[rows]),
            rq,
            rk,
        ]

    whole = ops(slice(0, 33))
    for rows in (slice(5, 6), slice(0, 7), slice(5, 21), slice(1, 33)):
        for got, ref in zip(ops(rows), whole):
            assert torch.equal(got, ref[rows])


def test_bad_arguments_are_named() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight of"):
        torch.ops.axon_cpu.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.axon_cpu.add_rms_norm(x, torch.randn(4, 9), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="gate and up"):
        torch.ops.axon_cpu.silu_and_mul(torch.randn(4, 7))
    rope = RotaryEmbedding(8, 16, 10000.0, {"rope_type": "default"})
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="position 16 outside"):
        torch.ops.axon_cpu.rotary_neox(torch.tensor([0, 16]), q, k, rope.cos_cached, rope.sin_cached)
