"""Fixtures for the model layer's kernel tests."""

from __future__ import annotations

import pytest
import torch

from axon.model.layers.linear import cpu_bf16_linear_supported
from axon.platforms.cpu_kernels import load_cpu_kernels

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16_kernel(kernel_cache_root: str) -> None:
    if not (load_cpu_kernels(kernel_cache_root) and cpu_bf16_linear_supported(torch.bfloat16, CPU, True)):
        pytest.skip("axon's bf16 linear kernel needs a CPU with AVX-512 BF16 and a C++ compiler")


@pytest.fixture(params=["avx512", "amx"])
def bf16_path(request: pytest.FixtureRequest, bf16_kernel: None):
    """Each of the kernel's paths: AVX-512 BF16 everywhere it loads, AMX tiles where the CPU
    (and the OS) has them; the AMX machine runs both."""
    ops = torch.ops.axon_cpu
    if request.param == "amx" and not ops.linear_amx_available():
        pytest.skip("this CPU has no AMX tiles (AMX-BF16)")
    previous = ops.set_linear_amx(request.param == "amx")
    assert ops.linear_uses_amx() == (request.param == "amx")
    yield request.param
    ops.set_linear_amx(previous)
