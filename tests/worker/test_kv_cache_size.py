"""kv_cache_space_gib "auto" is decided from the config and the machine's total memory, never
from free memory, so two starts with the same flags get the same KV cache."""

from __future__ import annotations

import os

import pytest
import torch

from axon.config import build_config
from axon.platforms import total_memory_bytes
from axon.worker.worker import decide_num_blocks

GIB = 1 << 30
BYTES_PER_BLOCK = 368_640  # SmolLM2-135M, bfloat16, 16-token blocks


def test_same_flags_same_blocks_whatever_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Free memory (SC_AVPHYS_PAGES) changes between the two resolutions; the answer does not."""
    free_pages = iter([3_000_000, 1_500_000, 700_000])
    real_sysconf = os.sysconf

    def sysconf(name: str) -> int:
        return next(free_pages) if name == "SC_AVPHYS_PAGES" else real_sysconf(name)

    monkeypatch.setattr(os, "sysconf", sysconf)
    config = build_config(max_model_len=8192)
    cpu = torch.device("cpu")
    first = decide_num_blocks(config, BYTES_PER_BLOCK, "cpu", total_memory_bytes(cpu))
    second = decide_num_blocks(config, BYTES_PER_BLOCK, "cpu", total_memory_bytes(cpu))
    assert first == second


def test_auto_is_need_capped_at_4_gib_and_a_quarter_of_memory() -> None:
    config = build_config(max_model_len=8192)  # 256 x 8192 tokens need 45 GiB
    capped = decide_num_blocks(config, BYTES_PER_BLOCK, "cpu", total_bytes=64 * GIB)
    assert capped.num_blocks == 4 * GIB // BYTES_PER_BLOCK
    assert "need 45.00 GiB" in capped.reason and "the 4 GiB cap" in capped.reason
    small_machine = decide_num_blocks(config, BYTES_PER_BLOCK, "cpu", total_bytes=8 * GIB)
    assert small_machine.num_blocks == 2 * GIB // BYTES_PER_BLOCK
    assert "0.25 of 8.0 GiB memory" in small_machine.reason
    few = decide_num_blocks(build_config(max_model_len=512, max_num_seqs=4), BYTES_PER_BLOCK, "cpu", 64 * GIB)
    assert few.num_blocks == 4 * 32 + 1  # 4 sequences of 32 blocks, and the null block
    assert "what they need" in few.reason
    # With a sliding-window group (window 128) a sequence also holds the blocks of its window and
    # of one step's tokens (max_num_batched_tokens 512 here): 32 + min(32, (128 + 512) / 16 + 1).
    windowed = decide_num_blocks(
        build_config(max_model_len=512, max_num_seqs=4), BYTES_PER_BLOCK, "cpu", 64 * GIB, window=128
    )
    assert windowed.num_blocks == 4 * (32 + 32) + 1
    config = build_config(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=256)
    windowed = decide_num_blocks(config, BYTES_PER_BLOCK, "cpu", 64 * GIB, window=128)
    assert windowed.num_blocks == 4 * (256 + 25) + 1


def test_explicit_sizes_say_where_they_came_from() -> None:
    space = decide_num_blocks(
        build_config(max_model_len=512, kv_cache_space_gib=1), BYTES_PER_BLOCK, "cpu", GIB
    )
    assert space.num_blocks == GIB // BYTES_PER_BLOCK and "kv_cache_space_gib 1 GiB" in space.reason
    override = decide_num_blocks(build_config(num_gpu_blocks_override=100), BYTES_PER_BLOCK, "cpu", GIB)
    assert override.num_blocks == 100 and "num_gpu_blocks_override" in override.reason
    cuda = decide_num_blocks(
        build_config(max_model_len=512), BYTES_PER_BLOCK, "cuda", 80 * GIB, used_bytes=8 * GIB
    )
    assert cuda.num_blocks == (72 * GIB - 8 * GIB) // BYTES_PER_BLOCK
    assert "gpu_memory_utilization 0.9" in cuda.reason
