"""The CUDA KV budget: vLLM's gpu_memory_utilization, a share of the device's total memory."""

from __future__ import annotations

import pytest

from axon.platforms import kv_budget_within_share

GIB = 1 << 30


def test_share_of_total_less_what_is_in_use() -> None:
    # 141 GiB device, 3 GiB in use (weights): 0.9 * 141 - 3.
    assert kv_budget_within_share(138 * GIB, 141 * GIB, 0.9) == int(0.9 * 141 * GIB) - 3 * GIB


def test_second_engine_gets_what_the_share_leaves_not_a_share_of_free() -> None:
    # A first engine holds 60 of 100 GiB; a second at 0.8 may add 20 GiB, not 0.8 * 40.
    assert kv_budget_within_share(40 * GIB, 100 * GIB, 0.8) == 20 * GIB


def test_nothing_left_names_the_option() -> None:
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=0.5 allows 50.0 GiB .* 60.0 GiB are in use"
    ):
        kv_budget_within_share(40 * GIB, 100 * GIB, 0.5)
