"""A GGUF tensor's quantized blocks -> a ``QuantizedWeight`` (codes, scales, mins), without rounding.

Each ggml block type is codes with one scale (and min) per run of inputs, so it re-lays as it is:

    type   bytes/256 weights   axon form (group = inputs per scale)
    Q8_0   272                 int8 codes, group 32, scale d
    Q4_0   144                 uint4 codes, group 32, scale d, min -8 d
    Q4_1   160                 uint4 codes, group 32, scale d, min m
    Q4_K   144                 uint4 codes, group 32, scale d * sc, min -dmin * m (6-bit sc, m)
    Q5_K   176                 int8 codes 0..31, group 32, scale d * sc, min -dmin * m
    Q6_K   210                 int8 codes -32..31, group 16, scale d * sc (8-bit sc)

A value is code * scale + min as ggml computes it (the scale of a K type is the float32 product
ggml forms). Q5_K and Q6_K codes take a byte each here (5.5 and 6.6 bits in the file).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from axon.model.layers.quant import KIND_INT8, KIND_UINT4, QuantizedWeight

_T = GGMLQuantizationType
QK_K = 256
KEPT_QUANTIZED = frozenset({_T.Q8_0, _T.Q4_0, _T.Q4_1, _T.Q4_K, _T.Q5_K, _T.Q6_K})


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[..., run // 2 * n] bytes -> [..., run * n]: each run of ``run`` codes is its bytes' low
    nibbles, then their high nibbles (ggml's order)."""
    shaped = qs.reshape(*qs.shape[:-1], -1, 1, run // 2)
    both = np.concatenate([shaped & 0x0F, shaped >> 4], axis=-2)
    return both.reshape(*qs.shape[:-1], -1)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int]:
    d = _f16(b[:, 0:2])
    return b[:, 2:].view(np.int8), d, None, 32, KIND_INT8


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:], 32), d, -8.0 * d, 32, KIND_UINT4


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:], 32), d, m, 32, KIND_UINT4


def _q4_k(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return _nibbles(b[:, 16:], 64), d * sc, -(dmin * mn), 32, KIND_UINT4


def _q5_k(b: np.ndarray):
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    low = _nibbles(qs, 64).reshape(-1, 8, 32)
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, 8, 32)
    codes = (low | (high << 4)).reshape(-1, QK_K).astype(np.int8)
    return codes, d * sc, -(dmin * mn), 32, KIND_INT8


def _q6_k(b: np.ndarray):
    ql, qh, scales, d = b[:, 0:128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = _nibbles(ql.reshape(-1, 2, 64), 128)  # per half of 128: 64 low nibbles then 64 high
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = (low.reshape(-1, 2, 4, 32) | (high << 4)).reshape(-1, QK_K).astype(np.int8) - 32
    return codes, d * scales.view(np.int8).astype(np.float32), None, 16, KIND_INT8


_PARSERS = {_T.Q8_0: _q8_0, _T.Q4_0: _q4_0, _T.Q4_1: _q4_1, _T.Q4_K: _q4_k, _T.Q5_K: _q5_k, _T.Q6_K: _q6_k}
_BLOCK = {_T.Q8_0: (32, 34), _T.Q4_0: (32, 18), _T.Q4_1: (32, 20), _T.Q4_K: (256, 144), _T.Q5_K: (256, 176)}
_BLOCK[_T.Q6_K] = (256, 210)


def quantized_weight(
    data: np.ndarray, tensor_type: GGMLQuantizationType, rows: int, cols: int
) -> QuantizedWeight:
    """A GGUF tensor's raw bytes (``ReaderTensor.data``) of ``rows`` x ``cols`` weights (ggml's
    ne[1] x ne[0]) -> its ``QuantizedWeight``."""
    if tensor_type not in _PARSERS:
        raise ValueError(
            f"GGUF type {tensor_type.name} is not kept quantized; supported: {sorted(t.name for t in _PARSERS)}"
        )
    block_weights, block_bytes = _BLOCK[tensor_type]
    if cols % block_weights:
        raise ValueError(f"a {tensor_type.name} row of {cols} weights is not whole blocks of {block_weights}")
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, block_bytes)
    if blocks.shape[0] != rows * cols // block_weights:
        raise ValueError(
            f"{tensor_type.name} data holds {blocks.shape[0]} blocks, not {rows} x {cols} weights"
        )
    codes, scales, mins, group, kind = _PARSERS[tensor_type](blocks)
    per_row = cols // group
    codes_t = torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, cols))
    codes_t = codes_t.to(torch.uint8) if kind == KIND_UINT4 else codes_t.view(torch.int8)
    table = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32).reshape(rows, per_row))
    return QuantizedWeight(codes_t, kind, table(scales), table(mins) if mins is not None else None, group)
