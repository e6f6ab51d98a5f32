"""Quantized weights and their GEMM, by their invariants: the kernel equals dequantize-then-matmul
(in float64) on every path, kind and group size, each row's result is the same whatever the
batch, each GGUF block type re-lays to exactly what the ``gguf`` package dequantizes, and the
formats keep their promises (code ranges, error bounds, lossless merges)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from axon.model.layers.quant import (
    KIND_FP8,
    KIND_INT8,
    KIND_UINT4,
    QuantizedWeight,
    QuantLinear,
    W8A8Linear,
    concat_rows,
    default_group_size,
    quantize_activations,
    quantize_linears,
    quantize_weight,
)
from axon.model.loader.gguf_blocks import KEPT_QUANTIZED, quantized_weight

_T = GGMLQuantizationType

SHAPES = [  # (N outputs, K inputs, M rows, group or None)
    (192, 576, 1, None),
    (100, 64, 17, 32),
    (70, 96, 5, 16),
    (70, 96, 3, 16),
    (130, 1536, 4, 64),
    (256, 576, 40, None),
    (130, 1536, 33, 64),
]


def _layer(method: str, n: int, k: int, group: int | None, seed: int, use_kernel: bool = True):
    gen = torch.Generator().manual_seed(seed)
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, method, group)
    return weight, QuantLinear(weight, None, use_kernel)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize(("n", "k", "m", "group"), SHAPES)
def test_kernel_equals_dequantize_then_matmul(
    bf16_path: str, method: str, n: int, k: int, m: int, group
) -> None:
    weight, layer = _layer(method, n, k, group, seed=n + k + m)
    assert layer.use_kernel
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen)
    layer.bias = bias
    got = layer(x, float_out=True)
    expected = x.double() @ weight.dequantize().double().T + bias.double()
    scale = expected.abs().max().item()
    # int4 codes run as 128 + code (the 128 taken back through the group's input sum): a few
    # bits of float32 go to that offset.
    tolerance = 2e-5 if method == "int4" else 2e-6
    assert (got.double() - expected).abs().max().item() <= tolerance * scale
    # bf16 out is the float32 result rounded.
    torch.testing.assert_close(layer(x), got.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_each_row_is_the_same_whatever_the_batch(bf16_path: str, method: str) -> None:
    _, layer = _layer(method, 200, 576, None, seed=3)
    x = torch.randn(70, 576, generator=torch.Generator().manual_seed(4)).bfloat16()
    full = layer(x, float_out=True)
    # Up to 4 rows decode each step in registers, more through a decoded panel: the same bits.
    for rows in (1, 2, 3, 4, 5, 15, 16, 17, 33):
        assert torch.equal(layer(x[:rows], float_out=True), full[:rows]), rows
    assert torch.equal(layer(x[5:6], float_out=True)[0], full[5])


def test_every_fp8_code_decodes_exactly(bf16_path: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[codes.float().isfinite()][:240]  # 254 finite codes; whole groups of 16
    weight = QuantizedWeight(finite.repeat(64, 1), KIND_FP8, torch.ones(64, 1), None, 240)
    identity = torch.eye(240).bfloat16()
    got = QuantLinear(weight, None, True)(identity, float_out=True)
    assert torch.equal(got[:, 0], finite.float())


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_the_fallback_without_the_kernel_is_f_linear_on_the_dequantized_weight(method: str) -> None:
    weight, layer = _layer(method, 48, 64, None, seed=1, use_kernel=False)
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, weight.dequantize()))


def test_int8_codes_and_error_bound() -> None:
    w = torch.randn(40, 128) * 0.1
    q = quantize_weight(w, "int8", 32)
    assert q.codes.dtype == torch.int8 and q.codes.abs().max() <= 127 and q.group == 32
    assert q.scales.shape == (40, 4)
    bound = q.scales.repeat_interleave(32, dim=1) / 2
    assert ((q.dequantize() - w).abs() <= bound * (1 + 1e-5)).all()


def test_int4_codes_and_error_bound() -> None:
    w = torch.randn(40, 576) * 0.1
    q = quantize_weight(w, "int4", None)
    assert q.group == default_group_size("int4", 576) == 64
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 15
    bound = q.scales.repeat_interleave(64, dim=1) / 2
    assert ((q.dequantize() - w).abs() <= bound * (1 + 1e-4) + 1e-7).all()


def test_fp8_is_per_channel_with_amax_at_448() -> None:
    w = torch.randn(16, 64)
    q = quantize_weight(w, "fp8", None)
    assert q.codes.dtype == torch.float8_e4m3fn and q.scales.shape == (16, 1)
    assert torch.allclose(q.codes.float().abs().amax(dim=1), torch.full((16,), 448.0))
    assert (q.dequantize() - w).abs().max() <= w.abs().max() * 2**-4  # 3 mantissa bits


@pytest.mark.parametrize(("method", "head_quantized"), [("int8", True), ("int4", False), ("fp8", False)])
def test_the_lm_head_is_quantized_by_int8_alone(method: str, head_quantized: bool) -> None:
    """int8 keeps the LM head as codes too; fp8 and int4 keep it in the model's dtype."""
    model = torch.nn.Module()
    model.mlp = torch.nn.Linear(64, 32, bias=False)
    model.lm_head = torch.nn.Linear(64, 48, bias=False)
    assert quantize_linears(model, method, None, use_kernel=False) == 1 + head_quantized
    assert isinstance(model.mlp, QuantLinear)
    assert isinstance(model.lm_head, QuantLinear) == head_quantized


@pytest.mark.parametrize(("group", "k"), [(48, 64), (32, 80)])
def test_a_group_that_does_not_divide_the_layer_is_an_error_naming_it(group: int, k: int) -> None:
    with pytest.raises(ValueError, match=f"quantization_group_size {group} must divide"):
        quantize_weight(torch.randn(8, k), "int4", group)


def test_concat_rows_is_lossless_across_kinds_and_groups() -> None:
    a = quantize_weight(torch.randn(8, 64), "int4", 32)
    b = quantize_weight(torch.randn(4, 64), "int8", 16)
    c = quantize_weight(torch.randn(6, 64), "int8", 64)
    merged = concat_rows([a, b, c])
    assert merged.kind == KIND_INT8 and merged.group == 16
    expected = torch.cat([a.dequantize(), b.dequantize(), c.dequantize()])
    assert torch.equal(merged.dequantize(), expected)


def _random_blocks(tensor_type: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes with sane float16 scales (K types cannot be quantized by ``gguf``)."""
    rng = np.random.default_rng(seed)
    if tensor_type in (_T.Q8_0, _T.Q4_0, _T.Q4_1):
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32), tensor_type)
    block_bytes = {_T.Q4_K: 144, _T.Q5_K: 176, _T.Q6_K: 210}[tensor_type]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    halves = rng.uniform(0.001, 0.05, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if tensor_type == _T.Q6_K:
        blocks[:, 208:210] = halves[:, 0:2]
    else:
        blocks[:, 0:4] = halves
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("tensor_type", sorted(KEPT_QUANTIZED, key=lambda t: t.name))
def test_each_gguf_block_type_relays_to_what_gguf_dequantizes(tensor_type: GGMLQuantizationType) -> None:
    rows, cols = 6, 512
    data = _random_blocks(tensor_type, rows, cols, seed=int(tensor_type))
    weight = quantized_weight(data, tensor_type, rows, cols)
    assert weight.shape == (rows, cols)
    expected = torch.from_numpy(dequantize(data, tensor_type).reshape(rows, cols))
    # ggml multiplies then adds (two roundings); the kernel's form rounds once.
    torch.testing.assert_close(weight.dequantize(), expected, rtol=2e-7, atol=1e-7)
    assert weight.kind in (KIND_INT8, KIND_UINT4)


@pytest.mark.parametrize("tensor_type", [_T.Q4_1, _T.Q6_K])
def test_gguf_weights_run_on_the_kernel(bf16_path: str, tensor_type: GGMLQuantizationType) -> None:
    data = _random_blocks(tensor_type, 70, 512, seed=5)
    weight = quantized_weight(data, tensor_type, 70, 512)
    layer = QuantLinear(weight, None, True)
    assert layer.use_kernel
    x = torch.randn(9, 512).bfloat16()
    expected = x.double() @ weight.dequantize().double().T
    assert (layer(x, float_out=True).double() - expected).abs().max() <= 2e-5 * expected.abs().max()


def test_a_gguf_type_not_kept_quantized_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="Q2_K is not kept quantized"):
        quantized_weight(np.zeros((1, 84), np.uint8), _T.Q2_K, 1, 256)


def test_tables_are_float16_only_where_that_loses_nothing(bf16_kernel: None) -> None:
    q4_1 = quantized_weight(_random_blocks(_T.Q4_1, 64, 256, seed=1), _T.Q4_1, 64, 256)
    q4_k = quantized_weight(_random_blocks(_T.Q4_K, 64, 256, seed=2), _T.Q4_K, 64, 256)
    assert QuantLinear(q4_1, None, True).scales.dtype == torch.float16  # ggml's own float16 d and m
    assert QuantLinear(q4_k, None, True).scales.dtype == torch.float32  # d * sc is not a float16


@pytest.mark.parametrize(("n", "k", "m"), [(192, 576, 1), (100, 64, 17), (300, 576, 40), (70, 1536, 33)])
def test_w8a8_kernel_equals_its_arithmetic_in_float64(bf16_path: str, n: int, k: int, m: int) -> None:
    gen = torch.Generator().manual_seed(n + m)
    weight = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, "int8", None)
    bias = torch.randn(n, generator=gen)
    kernel, reference = W8A8Linear(weight, bias, True), W8A8Linear(weight, bias, False)
    assert kernel.use_kernel and not reference.use_kernel
    x = torch.randn(m, k, generator=gen).bfloat16()
    got, want = kernel(x, float_out=True), reference(x, float_out=True)
    # The int32 sums are exact; only the float32 scaling rounds.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for rows in (1, 16, m):  # each row the same whatever the batch
        assert torch.equal(kernel(x[:rows], float_out=True), got[:rows])


def test_w8a8_activations_are_quantized_per_row() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    codes, scales = quantize_activations(x)
    assert torch.equal(scales.flatten(), torch.tensor([2.0 / 127, 1.0]))
    assert torch.equal(codes[0], torch.tensor([64.0, -127.0, 32.0], dtype=torch.float64))  # 63.5 -> 64 (even)
    assert torch.equal(codes[1], torch.zeros(3, dtype=torch.float64))
