"""Data parallelism's front-end parts, without processes: the choice of the core a request goes
to (by its invariants), each core's config, the server's admission bound over N cores, and the
offline LLM's refusal (several cores are the server's). Through real servers:
tests/server/test_data_parallel.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from axon.engine.core_client import choose_engine, core_config
from axon.entrypoints.openai.errors import OpenAIError
from axon.entrypoints.openai.serving_engine import Admission

loads = st.integers(1, 6).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 4), min_size=n, max_size=n),
        st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=n, max_size=n),
    )
)


@given(loads)
def test_the_least_loaded_core_wins_then_kv_usage_then_index(load: tuple[list[int], list[float]]) -> None:
    num_inflight, kv_usage = load
    chosen = choose_engine(num_inflight, kv_usage)
    fewest = min(num_inflight)
    assert num_inflight[chosen] == fewest  # never a core with more requests in flight
    tied = [i for i in range(len(num_inflight)) if num_inflight[i] == fewest]
    emptiest = min(kv_usage[i] for i in tied)
    assert kv_usage[chosen] == emptiest  # among those, the lowest KV usage
    assert chosen == min(i for i in tied if kv_usage[i] == emptiest)  # then the lowest index


def test_tie_breaks_in_order() -> None:
    assert choose_engine([2, 1, 1], [0.0, 0.9, 0.1]) == 2  # in flight first, KV usage second
    assert choose_engine([1, 1], [0.3, 0.3]) == 0  # a full tie: the lowest index
    assert choose_engine([0, 3], [0.99, 0.0]) == 0  # KV usage never outweighs a request


@given(st.integers(1, 5), st.integers(0, 60))
def test_a_burst_spreads_evenly_before_any_core_reports(num_cores: int, num_requests: int) -> None:
    num_inflight, kv_usage = [0] * num_cores, [0.0] * num_cores
    for _ in range(num_requests):
        num_inflight[choose_engine(num_inflight, kv_usage)] += 1
    assert max(num_inflight) - min(num_inflight) <= 1


def test_each_core_gets_its_own_rank_and_nothing_else_changes() -> None:
    from axon.config import AxonConfig, ParallelConfig

    config = AxonConfig(parallel_config=ParallelConfig(data_parallel_size=3))
    for i in range(3):
        mine = core_config(config, i)
        assert mine.parallel_config.data_parallel_rank == i
        assert mine.parallel_config.data_parallel_size == 3
        assert mine.model_config == config.model_config
    assert config.parallel_config.data_parallel_rank == 0  # the front end's own copy is untouched


def test_admission_counts_every_cores_running_batch() -> None:
    admission = Admission(max_num_seqs=2, max_waiting_requests=1, num_engines=2)
    tickets = [admission.admit(1) for _ in range(5)]  # 2 cores x 2 running + 1 waiting
    assert admission.num_waiting == 1
    with pytest.raises(OpenAIError, match="overloaded"):
        admission.admit(1)
    tickets[0].release()
    admission.admit(1)
    with pytest.raises(OpenAIError, match=r"--max-num-seqs 2 times --data-parallel-size 2"):
        admission.admit(6)
    assert admission.max_num_seqs == 2  # n stays capped per core: a request's samples share one


def test_the_offline_llm_refuses_several_engine_cores(smollm2_path: str) -> None:
    from axon import LLM

    with pytest.raises(ValueError, match=r"axon serve --data-parallel-size 2"):
        LLM(model=smollm2_path, data_parallel_size=2)
