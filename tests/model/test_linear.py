"""Packed linear layers (oneDNN's and axon's bf16 kernel) and merged projections, by their invariants."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from axon.model.layers import linear as linear_mod
from axon.model.layers.linear import (
    CpuBf16Linear,
    MergedLinear,
    PackedLinear,
    onednn_linear_supported,
    pack_linears,
    resolve_linear_backend,
)
from axon.model.models.weights import load_by_name

CPU = torch.device("cpu")
needs_onednn = pytest.mark.skipif(
    not onednn_linear_supported(torch.float32, CPU), reason="oneDNN is not available in this torch build"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 100])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch_hint", [1, 16, 128])
def test_packed_equals_f_linear(rows: int, bias: bool, batch_hint: int) -> None:
    gen = torch.Generator().manual_seed(rows * 7 + batch_hint)
    layer = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(200, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    packed = PackedLinear(layer, batch_hint)
    with torch.inference_mode():
        got = packed(x)
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
        # Leading dims are kept, as nn.Linear keeps them.
        assert packed(x.view(1, rows, 96)).shape == (1, rows, 200)


@needs_onednn
def test_compiled_packed_linear_equals_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 32, bias=False))
    x = torch.randn(8, 64)
    with torch.inference_mode():
        expected = model(x)
    assert pack_linears(model, "onednn", batch_hint=8) == 2
    compiled = torch.compile(model, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), expected, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_tied_embeddings() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 16)
            self.qkv = MergedLinear(16, (16, 8, 8), bias=True)
            self.inner = nn.Sequential(nn.Linear(32, 16))
            self.head = nn.Linear(16, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tiny()
    assert pack_linears(model, "onednn", batch_hint=4) == 3
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.embed.weight, nn.Parameter)  # the embedding keeps the shared weight
    x = torch.randn(2, 16)
    with torch.inference_mode():
        torch.testing.assert_close(model.head(x), F.linear(x, model.embed.weight), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_registry_forgets_deleted_layers() -> None:
    layer = PackedLinear(nn.Linear(8, 8), batch_hint=1)
    handle = layer.handle
    assert linear_mod._layers[handle]() is layer
    del layer
    gc.collect()
    assert handle not in linear_mod._layers


def _bf16_layer(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 17, 32, 33, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96, 200), (64, 64), (128, 16), (2, 130), (40, 70)], ids=str)
def test_cpu_bf16_equals_f_linear(bf16_path: str, rows: int, bias: bool, shape: tuple[int, int]) -> None:
    # Column counts off the kernel's 64-column panels and 16-column blocks, row counts off its
    # 6-row passes, its 16- and 32-row tile blocks and past its 256-row chunks, input counts off
    # the tiles' 32 (40: a tile and a vector tail; 2: no tile at all): every edge of the tiling.
    in_features, out_features = shape
    layer = _bf16_layer(in_features, out_features, bias, seed=rows * 31 + out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())
    packed = CpuBf16Linear(layer)
    with torch.inference_mode():
        got_float = packed(x, float_out=True)
        got = packed(x)
        assert packed(x.view(1, rows, in_features)).shape == (1, rows, out_features)
        assert packed(x[:0]).shape == (0, out_features)
    assert got_float.dtype == torch.float32 and got.dtype == torch.bfloat16
    # float32 accumulation in another order: close to the float32 product; the bf16 output is
    # that result rounded once.
    torch.testing.assert_close(got_float, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, got_float.to(torch.bfloat16), rtol=0, atol=0)


def test_cpu_bf16_compiled_equals_eager_and_skips_odd_widths(bf16_kernel: None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.SiLU(), nn.Linear(128, 33), nn.Linear(33, 8)).to(
        torch.bfloat16
    )
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = model(x)
    assert pack_linears(model, "cpu_bf16", batch_hint=8) == 2  # 33 inputs: left as nn.Linear
    assert isinstance(model[3], nn.Linear) and isinstance(model[0], CpuBf16Linear)
    compiled = torch.compile(model, dynamic=False, fullgraph=True)
    with torch.inference_mode():
        eager = model(x)
        torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
        torch.testing.assert_close(eager, expected, rtol=2e-2, atol=2e-2)


def test_cpu_bf16_rejects_bad_input(bf16_kernel: None) -> None:
    packed = CpuBf16Linear(_bf16_layer(32, 16, False, 0))
    with pytest.raises(RuntimeError, match="bfloat16 input"):
        packed(torch.randn(2, 32))
    with pytest.raises(RuntimeError, match="does not match"):
        packed(torch.randn(2, 30, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="even number of inputs"):
        torch.ops.axon_cpu.pack_linear_weight(torch.randn(4, 7, dtype=torch.bfloat16))


def test_resolve_linear_backend() -> None:
    assert resolve_linear_backend("torch", torch.float32, CPU) == "torch"
    assert resolve_linear_backend("auto", torch.float32, torch.device("cuda")) == "torch"
    if onednn_linear_supported(torch.float32, CPU):
        assert resolve_linear_backend("auto", torch.float32, CPU) == "onednn"
    with pytest.raises(ValueError, match="linear_backend 'onednn'"):
        resolve_linear_backend("onednn", torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="linear_backend 'cpu_bf16'"):
        resolve_linear_backend("cpu_bf16", torch.float32, CPU, cpu_kernels=True)
    with pytest.raises(ValueError, match="linear_backend 'cpu_bf16'"):
        resolve_linear_backend("cpu_bf16", torch.bfloat16, CPU, cpu_kernels=False)


def test_resolve_auto_prefers_the_bf16_kernel(bf16_kernel: None) -> None:
    assert resolve_linear_backend("auto", torch.bfloat16, CPU, cpu_kernels=True) == "cpu_bf16"
    assert resolve_linear_backend("auto", torch.float32, CPU, cpu_kernels=True) != "cpu_bf16"


class _Stacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = MergedLinear(4, (3, 2), bias=True)
        self.out = nn.Linear(5, 4, bias=False)


STACKED = {"a_proj": ("proj", 0), "b_proj": ("proj", 1)}


def _checkpoint() -> dict[str, torch.Tensor]:
    return {
        "a_proj.weight": torch.full((3, 4), 1.0),
        "a_proj.bias": torch.full((3,), 10.0),
        "b_proj.weight": torch.full((2, 4), 2.0),
        "b_proj.bias": torch.full((2,), 20.0),
        "out.weight": torch.full((4, 5), 3.0),
    }


def test_stacked_checkpoint_tensors_fill_their_shards() -> None:
    model = _Stacked()
    load_by_name(model, _checkpoint().items(), lambda n: n, stacked=STACKED)
    assert torch.equal(model.proj.weight[:3], torch.full((3, 4), 1.0))
    assert torch.equal(model.proj.weight[3:], torch.full((2, 4), 2.0))
    assert model.proj.bias.tolist() == [10.0] * 3 + [20.0] * 2
    assert torch.equal(model.out.weight, torch.full((4, 5), 3.0))


def test_stacked_errors_name_the_tensor() -> None:
    ckpt = _checkpoint()
    missing = {k: v for k, v in ckpt.items() if not k.startswith("b_proj.weight")}
    with pytest.raises(ValueError, match=r"proj.weight \(shard 1\)"):
        load_by_name(_Stacked(), missing.items(), lambda n: n, stacked=STACKED)
    twice = [*ckpt.items(), ("a_proj.weight", ckpt["a_proj.weight"])]
    with pytest.raises(ValueError, match="'a_proj.weight' is given twice"):
        load_by_name(_Stacked(), twice, lambda n: n, stacked=STACKED)
    wrong = {**ckpt, "b_proj.weight": torch.zeros(3, 4)}
    with pytest.raises(ValueError, match=r"'b_proj.weight' has shape \(3, 4\), expected \(2, 4\)"):
        load_by_name(_Stacked(), wrong.items(), lambda n: n, stacked=STACKED)


def test_cpu_bf16_rows_do_not_depend_on_their_batch(bf16_path: str) -> None:
    # One reduction order per output element whatever the call's row count: a row's output is
    # bit-identical alone, in any batch size and at any position (a request's logits must not
    # depend on the requests batched with it).
    layer = _bf16_layer(272, 320, True, seed=5)  # 272 inputs: eight tiles and a vector tail
    packed = CpuBf16Linear(layer)
    x = torch.randn(300, 272, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.inference_mode():
        whole = packed(x, float_out=True)
        for start, size in [(0, 1), (7, 1), (3, 5), (250, 13), (100, 6), (0, 257), (5, 32), (9, 47)]:
            part = packed(x[start : start + size], float_out=True)
            assert torch.equal(part, whole[start : start + size]), (start, size)
