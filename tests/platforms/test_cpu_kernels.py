"""The C++ kernel library's build cache, and the huge-page helpers, by their invariants."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from axon.platforms import cpu_kernels, huge_page_zeros, move_to_huge_pages


def test_built_once_then_loaded_from_the_cache(kernel_cache_root: str) -> None:
    if not cpu_kernels.load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler")
    assert cpu_kernels.cpu_kernels_loaded()
    path = cpu_kernels.library_path(kernel_cache_root)
    assert path is not None and os.path.isfile(path)
    compiler = cpu_kernels._compiler()
    assert compiler is not None
    # The folder is named by the build key: same sources, compiler, flags, torch and CPU.
    assert os.path.basename(os.path.dirname(path)) == cpu_kernels.build_key(compiler)
    mtime = os.stat(path).st_mtime_ns
    assert cpu_kernels.library_path(kernel_cache_root) == path
    assert os.stat(path).st_mtime_ns == mtime  # found, not rebuilt
    assert hasattr(torch.ops.axon_cpu, "paged_attention")


def test_key_follows_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = cpu_kernels._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    key = cpu_kernels.build_key(compiler)
    monkeypatch.setattr(cpu_kernels, "_compile_flags", lambda: ["-O1"])
    assert cpu_kernels.build_key(compiler) != key


def test_failed_build_names_the_command_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike
) -> None:
    if cpu_kernels._compiler() is None:
        pytest.skip("no C++ compiler")
    flags = cpu_kernels._compile_flags()
    monkeypatch.setattr(cpu_kernels, "_compile_flags", lambda: [*flags, "-fno-such-flag-axon"])
    with pytest.raises(RuntimeError, match="no-such-flag-axon"):
        cpu_kernels.library_path(str(tmp_path))
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert leftovers == []  # no half-written library for a later start to load


def test_loading_keeps_the_process_floating_point_mode(kernel_cache_root: str) -> None:
    """Linked with -ffast-math, the library's crtfastmath.o constructor turned on flush-to-zero
    and denormals-are-zero for the whole process: 1e-310 * 1.0 became 0.0 in every library."""
    if not cpu_kernels.load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler")
    subnormal = 1e-310
    assert subnormal * 1.0 == subnormal
    assert torch.tensor([subnormal], dtype=torch.float64).mul(1.0).item() == subnormal


def test_no_compiler_means_no_library(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike) -> None:
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    assert cpu_kernels.library_path(str(tmp_path)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_huge_page_zeros(dtype: torch.dtype) -> None:
    t = huge_page_zeros((3, 1000, 7), dtype)
    assert t.shape == (3, 1000, 7) and t.dtype == dtype and t.is_contiguous()
    assert not bool(t.any())
    t[1, 2, 3] = 5
    assert int(t.sum()) == 5
    assert huge_page_zeros((0, 4), dtype).shape == (0, 4)


def test_move_to_huge_pages_keeps_values_and_ties() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=True))
    model[1].weight = model[0].weight  # tied, as an LM head to its embedding
    model.register_buffer("scale", torch.arange(5, dtype=torch.bfloat16))
    before = {name: t.clone() for name, t in model.state_dict().items()}
    x = torch.tensor([1, 2, 3])
    with torch.no_grad():
        expected = model(x)
    move_to_huge_pages(model)
    assert model[1].weight is model[0].weight
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
        assert t.data_ptr() % 64 == 0, name  # each tensor starts on a cache line
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
