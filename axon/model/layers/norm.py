"""RMSNorm, with the residual add before it fused in (vLLM's ``RMSNorm(x, residual)``).

On the CPU with axon's kernels loaded both run as ``torch.ops.axon_cpu.rms_norm`` /
``add_rms_norm`` (``axon/csrc/cpu_pointwise.cpp``) in eager steps and compiled graphs alike, so a
token's numbers do not change when its bucket compiles; elsewhere in torch, as Hugging Face
computes them.
"""

from __future__ import annotations

import torch
from torch import nn

from axon.platforms.cpu_kernels import use_cpu_kernels


class RMSNorm(nn.Module):
    """RMSNorm as Hugging Face computes it: statistics in float32, scale in the input dtype.

    ``forward(x)`` -> normed; ``forward(x, residual)`` -> (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_cpu_kernels(x):
            if residual is None:
                return torch.ops.axon_cpu.rms_norm(x, self.weight, self.eps)
            return torch.ops.axon_cpu.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
