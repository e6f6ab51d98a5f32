"""The holdback scheduler on a fake KV geometry and a fake model: exact block ids, token counts, invariants.

The fake model samples a token for a request only when the step's scheduled tokens reach the end
of the request's known tokens (``num_computed_tokens == num_tokens`` after ``schedule``); a partial
prefill segment samples nothing. Unless a test scripts its tokens, the token sampled at position
``p`` is ``1000 + p``, so a request's whole output is known in advance: a lost, duplicated or
reordered token after a preemption shows up as a mismatch.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from axon.config import CacheConfig, SchedulerConfig
from axon.core.kv_cache_utils import make_block_hasher
from axon.core.request import Request, RequestStatus
from axon.core.scheduler import Scheduler
from axon.sampling_params import SamplingParams
from axon.scheduler_output import ModelRunnerOutput, SchedulerOutput
from axon.step_outputs import EngineCoreOutput

EOS = 2
VOCAB = 100_000

TokenFn = Callable[[Request], int]


def position_token(req: Request) -> int:
    return 1000 + req.num_tokens


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    enable_prefix_caching: bool = True,
    admission_kv_limit: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            admission_kv_limit=admission_kv_limit,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len,
        num_blocks,
    )


def make_request(
    req_id: str,
    prompt_token_ids: list[int],
    *,
    max_tokens: int = 16,
    ignore_eos: bool = True,
    stop_token_ids: list[int] | None = None,
    min_tokens: int = 0,
    block_size: int = 4,
) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids, min_tokens=min_tokens
    ).for_engine(EOS, VOCAB, default_max_tokens=max_tokens)  # as the input processor does
    return Request(
        req_id, prompt_token_ids, params, eos_token_id=EOS, block_hasher=make_block_hasher(block_size)
    )


def prompt(n: int, start: int) -> list[int]:
    """n distinct prompt tokens; distinct starts keep requests from sharing a prefix by accident."""
    return list(range(start, start + n))


def fake_runner_output(
    scheduler: Scheduler, sched_out: SchedulerOutput, token_fn: TokenFn
) -> ModelRunnerOutput:
    req_ids = list(sched_out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        sampled.append([token_fn(req)] if req.num_computed_tokens == req.num_tokens else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


class Driver:
    """schedule -> fake model -> update, collecting what the engine would stream out."""

    def __init__(self, scheduler: Scheduler, token_fn: TokenFn = position_token) -> None:
        self.scheduler = scheduler
        self.token_fn = token_fn
        self.streamed: dict[str, list[int]] = {}
        self.finish: dict[str, tuple[str | None, int | str | None]] = {}
        self.max_running_seen = 0
        self.num_preempted_reported = 0

    def add(self, *reqs: Request) -> None:
        for req in reqs:
            self.scheduler.add_request(req)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        sched_out = self.scheduler.schedule()
        assert sched_out.total_num_scheduled_tokens <= self.scheduler.max_num_batched_tokens
        assert len(self.scheduler.running) <= self.scheduler.max_running
        self.max_running_seen = max(self.max_running_seen, len(self.scheduler.running))
        self.num_preempted_reported += len(sched_out.preempted_req_ids)
        runner_out = fake_runner_output(self.scheduler, sched_out, self.token_fn)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        for out in outputs:
            assert out.req_id not in self.finish, f"{out.req_id} reported after it finished"
            self.streamed.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finish[out.req_id] = (out.finish_reason, out.stop_reason)
        self.scheduler.kv_cache_manager.check_integrity()
        return sched_out, outputs

    def run_until_done(self, max_steps: int = 500) -> list[SchedulerOutput]:
        outs: list[SchedulerOutput] = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return outs
            outs.append(self.step()[0])
        raise AssertionError(
            f"not done after {max_steps} steps: {self.scheduler.running} {self.scheduler.waiting}"
        )


def new_ids(sched_out: SchedulerOutput) -> list[str]:
    return [new.req_id for new in sched_out.scheduled_new_reqs]


def ref_cnts(scheduler: Scheduler, block_ids: list[int]) -> list[int]:
    return [scheduler.kv_cache_manager.block_pool.blocks[i].ref_cnt for i in block_ids]


# ---------------------------------------------------------------- 1. FCFS admission


def test_fcfs_admission_in_arrival_order_capped_by_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2, max_model_len=32)  # 63 // 8 = 7 would fit; max_num_seqs caps
    assert sched.max_running == 2
    d = Driver(sched)
    a = make_request("a", prompt(5, 100), max_tokens=2)
    b = make_request("b", prompt(3, 200), max_tokens=5)
    c = make_request("c", prompt(4, 300), max_tokens=1)
    d.add(a, b, c)

    out, _ = d.step()
    assert new_ids(out) == ["a", "b"]
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[1, 2], [3]]
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    assert c.status == RequestStatus.WAITING

    out, _ = d.step()  # a's second token finishes it, but only after this step's admission
    assert new_ids(out) == [] and out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert d.finish["a"] == ("length", None)

    out, _ = d.step()
    assert out.finished_req_ids == {"a"}
    assert new_ids(out) == ["c"] and list(out.num_scheduled_tokens) == ["b", "c"]
    # b (scheduled first) crosses into its second block: a's partial block 2, which went to
    # the free queue's front (no hash: nothing can hit it); a's full block 1 went to its tail
    # (cached), so c gets the next never-used block.
    assert out.scheduled_cached_reqs.new_block_ids == [[2]]
    assert out.scheduled_new_reqs[0].block_ids == [4]
    d.run_until_done()
    assert {k: len(v) for k, v in d.streamed.items()} == {"a": 2, "b": 5, "c": 1}


def test_blocked_head_is_not_overtaken_by_a_smaller_request() -> None:
    # 5 usable blocks, max_model_len 20 = 5 blocks: optimistic admission, so only KV refuses.
    sched = make_scheduler(num_blocks=6, max_model_len=20, admission_kv_limit=False)
    assert sched.max_running == 16
    d = Driver(sched)
    a = make_request("a", prompt(12, 100), max_tokens=4)  # 3 blocks, grows to 4
    b = make_request("b", prompt(12, 200), max_tokens=1)  # 3 blocks: does not fit next to a
    c = make_request("c", prompt(4, 300), max_tokens=1)  # 1 block: would fit, must wait behind b
    d.add(a, b, c)

    out, _ = d.step()
    assert new_ids(out) == ["a"] and out.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    assert list(sched.waiting) == [b, c]
    for _ in range(3):
        out, _ = d.step()
        assert new_ids(out) == [] and list(out.num_scheduled_tokens) == ["a"]
        assert list(sched.waiting) == [b, c]
        if "a" not in d.finish:
            assert sched.kv_cache_manager.num_free_blocks == 1  # room for c all along
    assert d.finish["a"] == ("length", None)

    out, _ = d.step()
    assert new_ids(out) == ["b", "c"]
    # Free queue: a's partial block 4 (no hash) at the front, never-used 5, then a's cached
    # full blocks tail first (3, 2, 1).
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[4, 5, 3], [2]]
    assert sched.num_preemptions == 0


def test_holdback_admits_while_the_running_set_fits_at_its_worst_case() -> None:
    # 10 usable blocks of 4 tokens. Requests that may reach max_model_len (20 tokens, 5 blocks):
    # 2 run, though KV is mostly free.
    sched = make_scheduler(num_blocks=11, max_model_len=20, max_num_seqs=8)
    d = Driver(sched)
    reqs = [make_request(f"r{i}", prompt(4, 100 * (i + 1)), max_tokens=16) for i in range(3)]
    d.add(*reqs)
    out, _ = d.step()
    assert new_ids(out) == ["r0", "r1"] and list(sched.waiting) == [reqs[2]]
    assert sched.kv_cache_manager.num_free_blocks == 8
    d.run_until_done()
    assert sched.num_preemptions == 0 and {k: len(v) for k, v in d.streamed.items()} == dict.fromkeys(
        ["r0", "r1", "r2"], 16
    )

    # A request's own max_tokens bounds its worst case: 4 + 3 tokens hold 2 blocks at most, so 5
    # such requests run at once (vllm-neuron's cap at max_model_len would hold 2).
    sched = make_scheduler(num_blocks=11, max_model_len=20, max_num_seqs=8)
    d = Driver(sched)
    short = [make_request(f"s{i}", prompt(4, 100 * (i + 1)), max_tokens=3) for i in range(6)]
    d.add(*short)
    out, _ = d.step()
    assert new_ids(out) == [f"s{i}" for i in range(5)] and list(sched.waiting) == [short[5]]
    d.run_until_done()
    assert sched.num_preemptions == 0 and d.max_running_seen == 5

    optimistic = make_scheduler(num_blocks=11, max_model_len=20, max_num_seqs=8, admission_kv_limit=False)
    assert optimistic.max_running == 8
    d = Driver(optimistic)
    d.add(*[make_request(f"r{i}", prompt(4, 100 * (i + 1)), max_tokens=3) for i in range(3)])
    out, _ = d.step()
    assert new_ids(out) == ["r0", "r1", "r2"]


# ---------------------------------------------------------------- 2. worst-case KV admission, preemption


def run_workload(sched: Scheduler, rng: random.Random, num_requests: int, max_model_len: int) -> Driver:
    """Random arrivals of ignore_eos requests; returns the driver after everything finished."""
    d = Driver(sched)
    expected: dict[str, int] = {}
    for i in range(num_requests):
        n = rng.randint(1, 20)
        req = make_request(f"r{i}", prompt(n, 100 * (i + 1)), max_tokens=rng.randint(1, 32))
        expected[req.req_id] = min(req.max_tokens, max_model_len - n)
        d.add(req)
        for _ in range(rng.randint(0, 3)):
            d.step()
    d.run_until_done(max_steps=2000)
    assert {k: len(v) for k, v in d.streamed.items()} == expected
    return d


def test_kv_admission_limit_never_preempts() -> None:
    # 27 usable blocks, 8 per max_model_len sequence: 3 fit at max_model_len; requests of 1 to 20
    # prompt tokens and 1 to 32 new ones mostly hold fewer, so more run at once, never preempted.
    sched = make_scheduler(num_blocks=28, max_model_len=32, max_num_seqs=8)
    d = run_workload(sched, random.Random(0), num_requests=40, max_model_len=32)
    assert sched.num_preemptions == d.num_preempted_reported == 0
    assert d.max_running_seen > 3
    assert sched.kv_cache_manager.usage == 0.0

    # The same workload on the same pool without the limit does preempt, and reports each one.
    optimistic = make_scheduler(num_blocks=28, max_model_len=32, max_num_seqs=8, admission_kv_limit=False)
    d = run_workload(optimistic, random.Random(0), num_requests=40, max_model_len=32)
    assert optimistic.num_preemptions == d.num_preempted_reported > 0
    assert d.max_running_seen > 3
    assert optimistic.kv_cache_manager.usage == 0.0


def preemption_scenario(enable_prefix_caching: bool) -> tuple[Scheduler, Driver, Request, Request, Request]:
    """Two 6-token prompts fill a 4-block pool; a's 9th token then needs a block: b is preempted.

    c (one block) arrived before the preemption but finds no free block until then.
    """
    sched = make_scheduler(
        num_blocks=5, max_model_len=16, admission_kv_limit=False, enable_prefix_caching=enable_prefix_caching
    )
    d = Driver(sched)
    a = make_request("a", prompt(6, 100), max_tokens=6)
    b = make_request("b", prompt(6, 200), max_tokens=6)
    c = make_request("c", prompt(3, 300), max_tokens=1)
    d.add(a, b, c)
    out, _ = d.step()
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[1, 2], [3, 4]]
    for _ in range(2):
        out, _ = d.step()
        assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.preempted_req_ids == set()
    assert a.num_tokens == b.num_tokens == 9 and sched.kv_cache_manager.num_free_blocks == 0

    out, _ = d.step()
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs.new_block_ids == [[4]]  # b's tail block, freed first
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [1006, 1007, 1008] and b.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("b") == []
    assert list(sched.waiting) == [b, c] and sched.running == [a]  # back at the queue's head
    assert sched.num_preemptions == 1
    return sched, d, a, b, c


def test_preempted_request_is_recomputed_in_full() -> None:
    sched, d, _a, b, c = preemption_scenario(enable_prefix_caching=False)
    out, _ = d.step()  # b needs 3 blocks, 1 is free: it waits, and so does c, which would fit
    assert new_ids(out) == [] and out.num_scheduled_tokens == {"a": 1}
    assert list(sched.waiting) == [b, c]
    out, _ = d.step()
    assert d.finish["a"] == ("length", None)

    out, _ = d.step()
    assert out.finished_req_ids == {"a"}
    resumed, _ = out.scheduled_new_reqs
    assert new_ids(out) == ["b", "c"]
    assert resumed.prompt_token_ids == prompt(6, 200)
    assert resumed.output_token_ids == [1006, 1007, 1008]
    assert resumed.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {"b": 9, "c": 3}  # b: prompt and earlier outputs, recomputed
    # Free queue: without prefix caching no block has a hash, so each freed block went to the
    # front: a's, freed just now (tail first: 4, 2, 1), then those freed before them.
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[4, 2, 1], [3]]
    d.run_until_done()
    assert d.streamed == {"a": [1006 + i for i in range(6)], "b": [1006 + i for i in range(6)], "c": [1003]}
    assert b.num_cached_tokens == 0 and sched.num_preemptions == 1
    assert sched.kv_cache_manager.usage == 0.0


def test_preempted_request_reuses_its_own_cached_head_block() -> None:
    _, d, _, b, _ = preemption_scenario(enable_prefix_caching=True)
    d.step()
    d.step()
    out, _ = d.step()
    resumed, _ = out.scheduled_new_reqs
    # b's head block 3 survived in the free queue (its tail block 4 went to a and was evicted).
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[3, 4, 2], [1]]
    assert resumed.num_computed_tokens == 4
    assert out.num_scheduled_tokens == {"b": 5, "c": 3}
    assert b.num_cached_tokens == 0  # set at first admission only
    d.run_until_done()
    assert d.streamed["b"] == [1006 + i for i in range(6)]


# ---------------------------------------------------------------- 3-4. segmented prefill, token budget


def test_long_prompt_is_prefilled_over_several_steps() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    d = Driver(sched)
    req = make_request("a", prompt(21, 100), max_tokens=2)
    d.add(req)
    scheduled, streamed = [], []
    for _ in range(3):
        out, outputs = d.step()
        scheduled.append(out.num_scheduled_tokens["a"])
        streamed.append([o.new_token_ids for o in outputs])
    assert scheduled == [8, 8, 5] and sum(scheduled) == 21
    assert streamed == [[], [], [[1021]]]  # samples only on the last segment


def test_segment_uses_the_budget_left_by_running_requests() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    d = Driver(sched)
    a = make_request("a", prompt(3, 100), max_tokens=10)
    b = make_request("b", prompt(20, 200), max_tokens=1)
    d.add(a, b)

    out, outputs = d.step()
    assert out.num_scheduled_tokens == {"a": 3, "b": 5}
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[1], [2, 3]]
    assert [o.req_id for o in outputs] == ["a"]

    expected = [  # (num_scheduled_tokens, num_computed_tokens before, new block ids)
        ({"a": 1, "b": 7}, [3, 5], [[], [4]]),
        ({"a": 1, "b": 7}, [4, 12], [[5], [6, 7]]),
        ({"a": 1, "b": 1}, [5, 19], [[], []]),
    ]
    for num_scheduled, num_computed_before, new_block_ids in expected:
        out, outputs = d.step()
        assert out.num_scheduled_tokens == num_scheduled
        assert out.total_num_scheduled_tokens == sum(num_scheduled.values())
        assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
        assert out.scheduled_cached_reqs.num_computed_tokens == num_computed_before
        assert out.scheduled_cached_reqs.new_block_ids == new_block_ids
    assert b.num_computed_tokens == 20 and d.finish["b"] == ("length", None)
    assert d.streamed["b"] == [1020]
    assert sched.kv_cache_manager.get_block_ids("a") == [1, 5]


def test_running_requests_take_the_budget_before_waiting_ones() -> None:
    sched = make_scheduler(max_num_batched_tokens=2)
    d = Driver(sched)
    a = make_request("a", prompt(1, 100), max_tokens=2)
    b = make_request("b", prompt(1, 200), max_tokens=5)
    d.add(a, b)
    out, _ = d.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    c = make_request("c", prompt(3, 300), max_tokens=1)
    d.add(c)
    out, _ = d.step()  # both decodes spend the whole budget: c waits with seats free
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and new_ids(out) == []
    assert list(sched.waiting) == [c]
    out, _ = d.step()  # a finished: b's decode first, then one token of c's prompt
    assert list(out.num_scheduled_tokens.items()) == [("b", 1), ("c", 1)]
    out, _ = d.step()
    assert list(out.num_scheduled_tokens.items()) == [("b", 1), ("c", 1)]
    assert out.total_num_scheduled_tokens == 2


# ---------------------------------------------------------------- 5. SchedulerOutput diffs


def test_new_request_is_sent_whole_once_then_as_diffs() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    d.add(make_request("a", prompt(7, 100), max_tokens=3))

    out, _ = d.step()
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.prompt_token_ids, new.output_token_ids) == ("a", prompt(7, 100), [])
    assert new.block_ids == [1, 2] and new.num_computed_tokens == 0
    assert out.scheduled_cached_reqs.req_ids == []

    for num_computed_before, new_block_ids in ((7, [[]]), (8, [[3]])):
        out, _ = d.step()
        assert out.scheduled_new_reqs == []
        assert out.scheduled_cached_reqs.req_ids == ["a"]
        assert out.scheduled_cached_reqs.num_computed_tokens == [num_computed_before]
        assert out.scheduled_cached_reqs.new_block_ids == new_block_ids
        assert out.finished_req_ids == set()
    assert d.finish["a"] == ("length", None)

    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty
    assert sched.schedule().finished_req_ids == set()


# ---------------------------------------------------------------- 6. stops


@pytest.mark.parametrize(
    ("kwargs", "script", "expected_tokens", "expected_finish"),
    [
        pytest.param({"ignore_eos": False}, [7, 8, EOS, 9], [7, 8, EOS], ("stop", None), id="eos"),
        pytest.param({"stop_token_ids": [42]}, [7, 42, 9], [7, 42], ("stop", 42), id="stop_token"),
        pytest.param(
            {"ignore_eos": False, "min_tokens": 3}, [EOS] * 5, [EOS] * 3, ("stop", None), id="min_tokens_eos"
        ),
        pytest.param(
            {"stop_token_ids": [42], "min_tokens": 2},
            [42] * 5,
            [42, 42],
            ("stop", 42),
            id="min_tokens_stop_token",
        ),
        pytest.param(
            {"ignore_eos": True, "max_tokens": 4}, [EOS] * 5, [EOS] * 4, ("length", None), id="ignore_eos"
        ),
        pytest.param({"max_tokens": 3}, [7] * 5, [7] * 3, ("length", None), id="max_tokens"),
        pytest.param(
            {"ignore_eos": False, "max_tokens": 2}, [7, EOS], [7, EOS], ("stop", None), id="eos_at_max"
        ),
        pytest.param(
            {"ignore_eos": True, "stop_token_ids": [EOS]},
            [7, EOS],
            [7, EOS],
            ("stop", EOS),
            id="eos_as_stop_token",
        ),
    ],
)
def test_stop_conditions(
    kwargs: dict, script: list[int], expected_tokens: list[int], expected_finish: tuple
) -> None:
    sched = make_scheduler()
    d = Driver(sched, token_fn=lambda req: script[req.num_output_tokens])
    params = {"max_tokens": 10} | kwargs
    req = make_request("a", prompt(5, 100), **params)
    d.add(req)
    d.run_until_done()
    assert d.streamed["a"] == expected_tokens == req.output_token_ids
    assert d.finish["a"] == expected_finish
    assert req.get_finish_reason() == expected_finish[0] and req.stop_reason == expected_finish[1]
    assert "a" not in sched.requests and sched.kv_cache_manager.usage == 0.0


def test_reaching_max_model_len_stops_with_length() -> None:
    sched = make_scheduler(max_model_len=12)
    d = Driver(sched)
    req = make_request("a", prompt(10, 100), max_tokens=100)
    d.add(req)
    d.run_until_done()
    assert d.streamed["a"] == [1010, 1011] and d.finish["a"] == ("length", None)
    assert req.num_tokens == 12


# ---------------------------------------------------------------- 7. prefix caching


SHARED = prompt(8, 10)  # two full blocks


def test_shared_prefix_blocks_are_reused() -> None:
    sched = make_scheduler()
    d = Driver(sched)
    a = make_request("a", SHARED + [21, 22], max_tokens=1)
    b = make_request("b", SHARED + [31, 32, 33], max_tokens=1)
    d.add(a, b)
    out = sched.schedule()
    # a's full blocks are registered at allocation, so b hits them in the same step.
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[1, 2, 3], [1, 2, 4]]
    assert [new.num_computed_tokens for new in out.scheduled_new_reqs] == [0, 8]
    assert out.num_scheduled_tokens == {"a": 10, "b": 3}
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert ref_cnts(sched, [1, 2, 3, 4]) == [2, 2, 1, 1]
    sched.kv_cache_manager.check_integrity()
    outputs = sched.update_from_output(out, fake_runner_output(sched, out, position_token))
    assert [(o.req_id, o.num_cached_tokens) for o in outputs] == [("a", 0), ("b", 8)]
    assert sched.kv_cache_manager.usage == 0.0

    # The freed prefix stays cached: a later request revives blocks 1 and 2 from the free queue.
    c = make_request("c", SHARED + [41], max_tokens=1)
    d.add(c)
    out, _ = d.step()
    assert out.scheduled_new_reqs[0].block_ids == [1, 2, 4]  # 4: b's partial block, handed out next
    assert out.num_scheduled_tokens == {"c": 1} and c.num_cached_tokens == 8


def test_no_sharing_without_prefix_caching() -> None:
    sched = make_scheduler(enable_prefix_caching=False)
    d = Driver(sched)
    a = make_request("a", SHARED + [21, 22], max_tokens=1)
    b = make_request("b", SHARED + [31, 32, 33], max_tokens=1)
    d.add(a, b)
    out, outputs = d.step()
    assert [new.block_ids for new in out.scheduled_new_reqs] == [[1, 2, 3], [4, 5, 6]]
    assert out.num_scheduled_tokens == {"a": 10, "b": 11}
    assert b.num_cached_tokens == 0 and [o.num_cached_tokens for o in outputs] == [0, 0]
    assert ref_cnts(sched, [1, 2, 3, 4, 5, 6]) == [0] * 6


# ---------------------------------------------------------------- 8. aborts


def test_abort_waiting_and_running_requests_frees_blocks_and_drops_late_outputs() -> None:
    sched = make_scheduler(num_blocks=11, max_model_len=20)  # 2 may run
    d = Driver(sched)
    a = make_request("a", prompt(6, 100), max_tokens=10)
    b = make_request("b", prompt(5, 200), max_tokens=10)
    c = make_request("c", prompt(3, 300), max_tokens=10)
    d.add(a, b, c)
    d.step()
    assert list(sched.waiting) == [c]
    usage = sched.kv_cache_manager.usage
    assert usage == pytest.approx(0.4)

    assert sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED) == [c]
    assert c.status == RequestStatus.FINISHED_ABORTED and c.get_finish_reason() == "abort"
    assert sched.kv_cache_manager.usage == usage and not sched.waiting and "c" not in sched.requests

    # b is aborted while its step runs: its blocks go at once, its sampled token is dropped.
    out = sched.schedule()
    assert out.finished_req_ids == {"c"} and out.num_scheduled_tokens == {"a": 1, "b": 1}
    runner_out = fake_runner_output(sched, out, position_token)
    b_blocks = sched.kv_cache_manager.get_block_ids("b")
    assert b_blocks == [3, 4]
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert sched.kv_cache_manager.usage == pytest.approx(0.2)
    assert ref_cnts(sched, b_blocks) == [0, 0]
    outputs = sched.update_from_output(out, runner_out)
    assert [o.req_id for o in outputs] == ["a"]
    assert b.output_token_ids == [1005] and b.status == RequestStatus.FINISHED_ABORTED
    assert sched.running == [a]
    sched.kv_cache_manager.check_integrity()

    # Unknown and already finished ids are ignored.
    assert sched.finish_requests(["b", "nope"], RequestStatus.FINISHED_ABORTED) == []
    out = sched.schedule()
    assert out.finished_req_ids == {"b"}
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED) == [a]
    assert sched.kv_cache_manager.usage == 0.0 and not sched.has_unfinished_requests()


# ---------------------------------------------------------------- 9. random workloads


def random_token(req_id: str, pos: int) -> int:
    """Deterministic per (request, position), so a recomputed request samples the same tokens."""
    return EOS if zlib.crc32(f"{req_id}/{pos}".encode()) % 11 == 0 else 1000 + pos


def expected_output(req: Request, max_model_len: int) -> tuple[list[int], str]:
    params = req.sampling_params
    out: list[int] = []
    while True:
        tok = random_token(req.req_id, req.num_prompt_tokens + len(out))
        out.append(tok)
        if len(out) >= params.min_tokens and tok in params.all_stop_token_ids:
            return out, "stop"
        if len(out) >= req.max_tokens or req.num_prompt_tokens + len(out) >= max_model_len:
            return out, "length"


@dataclass
class WorkerMirror:
    """What a worker would know, rebuilt from the SchedulerOutput diffs alone."""

    block_ids: dict[str, list[int]] = field(default_factory=dict)
    num_computed_tokens: dict[str, int] = field(default_factory=dict)

    def apply(self, out: SchedulerOutput, reqs: dict[str, Request]) -> None:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.block_ids.pop(req_id, None)
            self.num_computed_tokens.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.block_ids, f"{new.req_id} sent whole twice"
            req = reqs[new.req_id]
            assert new.prompt_token_ids == req.prompt_token_ids
            assert new.output_token_ids == req.output_token_ids
            self.block_ids[new.req_id] = list(new.block_ids)
            self.num_computed_tokens[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, new_block_ids, num_kept, num_computed in zip(
            cached.req_ids,
            cached.new_block_ids,
            cached.num_kept_blocks,
            cached.num_computed_tokens,
            strict=True,
        ):
            assert req_id in self.block_ids, f"diff for {req_id}, which the worker does not hold"
            assert num_kept <= len(self.block_ids[req_id])
            assert num_computed <= self.num_computed_tokens[req_id]
            self.num_computed_tokens[req_id] = num_computed  # rejected drafts roll it back
            self.block_ids[req_id] = self.block_ids[req_id][:num_kept] + new_block_ids
        for req_id, n in out.num_scheduled_tokens.items():
            self.num_computed_tokens[req_id] += n


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("admission_kv_limit", [True, False], ids=["holdback", "optimistic"])
def test_random_workload_keeps_invariants(seed: int, block_size: int, admission_kv_limit: bool) -> None:
    rng = random.Random(seed)
    max_model_len = 6 * block_size
    blocks_per_seq = 6
    # Holdback: room for 3 full sequences and change. Optimistic: a tiny pool (1 sequence + 3 blocks).
    num_blocks = 1 + (3 * blocks_per_seq + 2 if admission_kv_limit else blocks_per_seq + 3)
    max_num_seqs = 5
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2 * block_size + 3,
        enable_prefix_caching=seed != 2,
        admission_kv_limit=admission_kv_limit,
    )
    assert sched.max_running == max_num_seqs
    kv = sched.kv_cache_manager
    prefixes = [[rng.randrange(10, 60) for _ in range(2 * block_size)] for _ in range(3)]

    reqs: dict[str, Request] = {}
    arrival_order: list[str] = []
    first_admitted: list[str] = []
    streamed: dict[str, list[int]] = {}
    finished: dict[str, str | None] = {}
    aborted: set[str] = set()
    reported_finished: Counter[str] = Counter()
    mirror = WorkerMirror()

    def abort(req_id: str) -> None:
        assert [r.req_id for r in sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)] == [req_id]
        assert req_id not in finished
        finished[req_id] = "abort"
        aborted.add(req_id)

    def unfinished_ids() -> list[str]:
        return [r.req_id for r in [*sched.running, *sched.waiting]]

    num_steps = 0
    while num_steps < 300 or sched.has_unfinished_requests():
        num_steps += 1
        assert num_steps < 3000, "the workload does not drain"
        if num_steps < 300 and rng.random() < 0.45:
            for _ in range(rng.randint(1, 2)):
                i = len(arrival_order)
                if rng.random() < 0.35:
                    tokens = rng.choice(prefixes) + [
                        rng.randrange(60, 90) for _ in range(rng.randint(0, block_size + 1))
                    ]
                else:
                    tokens = [rng.randrange(60, 90) for _ in range(rng.randint(1, 3 * block_size + 2))]
                max_tokens = rng.randint(1, 20)
                req = make_request(
                    f"r{i}",
                    tokens,
                    max_tokens=max_tokens,
                    ignore_eos=rng.random() < 0.5,
                    min_tokens=min(rng.choice([0, 0, 0, 2]), max_tokens),
                    block_size=block_size,
                )
                reqs[req.req_id] = req
                arrival_order.append(req.req_id)
                sched.add_request(req)
        if rng.random() < 0.03 and unfinished_ids():
            abort(rng.choice(unfinished_ids()))

        had_work = sched.has_unfinished_requests()
        out = sched.schedule()
        if had_work:
            assert not out.is_empty, "no progress with unfinished requests"
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        # Running requests first, then the newly admitted, each scheduled once.
        assert list(out.num_scheduled_tokens) == out.scheduled_cached_reqs.req_ids + new_ids(out)
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        assert len(sched.running) <= sched.max_running
        if admission_kv_limit:
            assert out.preempted_req_ids == set()
            # Holdback: the running set fits the cache with every request at its longest.
            longest = [min(max_model_len, r.num_prompt_tokens + r.max_tokens) for r in sched.running]
            assert sum(-(-n // block_size) for n in longest) <= num_blocks - 1 or len(sched.running) == 1
        for req_id in out.preempted_req_ids:
            req = reqs[req_id]
            assert req.status == RequestStatus.PREEMPTED and req.num_computed_tokens == 0
            assert req in sched.waiting and req_id not in out.num_scheduled_tokens
        reported_finished.update(out.finished_req_ids)
        first_admitted += [r for r in new_ids(out) if reqs[r].num_preemptions == 0]

        mirror.apply(out, reqs)
        assert set(kv.req_to_blocks) == {r.req_id for r in sched.running}
        for req in sched.running:
            block_ids = mirror.block_ids[req.req_id]
            assert block_ids == kv.get_block_ids(req.req_id)
            assert mirror.num_computed_tokens[req.req_id] == req.num_computed_tokens <= req.num_tokens
            assert len(block_ids) * block_size >= req.num_computed_tokens
        for req in sched.waiting:
            assert req.num_computed_tokens == 0 and req.status in (
                RequestStatus.WAITING,
                RequestStatus.PREEMPTED,
            )

        runner_out = fake_runner_output(sched, out, lambda r: random_token(r.req_id, r.num_tokens))
        if rng.random() < 0.03 and out.num_scheduled_tokens:
            abort(rng.choice(list(out.num_scheduled_tokens)))  # mid-step: its outputs must be dropped
        for o in sched.update_from_output(out, runner_out):
            assert o.req_id not in finished, f"{o.req_id} reported after it finished"
            assert o.new_token_ids, "an output with no tokens"
            streamed.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.req_id] = o.finish_reason
        kv.check_integrity()
        assert len(sched.running) <= sched.max_running

    reported_finished.update(sched.schedule().finished_req_ids)
    assert len(arrival_order) > 50
    assert first_admitted == [r for r in arrival_order if r in first_admitted], "admission was not FCFS"
    assert set(finished) == set(arrival_order)
    assert reported_finished == Counter(arrival_order), "each request reaches finished_req_ids exactly once"
    for req_id, req in reqs.items():
        assert streamed.get(req_id, []) == req.output_token_ids
        tokens, reason = expected_output(req, max_model_len)
        if req_id in aborted:
            assert tokens[: req.num_output_tokens] == req.output_token_ids
        else:
            assert (req.output_token_ids, finished[req_id]) == (tokens, reason)
    assert aborted
    assert sched.requests == {} and kv.req_to_blocks == {} and kv.usage == 0.0
    if admission_kv_limit:
        assert sched.num_preemptions == 0
    else:
        assert sched.num_preemptions > 0


# ---------------------------------------------------------------- 10. async scheduling


class PipelinedDriver:
    """The engine's async loop with a fake model: step N+1 is scheduled before step N's tokens
    are applied; a step's tokens are fixed when it is scheduled (as the worker, running the
    steps in order, samples them), by ``random_token`` of the sampled position."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.streamed: dict[str, list[int]] = {}
        self.finish: dict[str, str | None] = {}
        self.num_ahead = 0

    def _launch(self) -> tuple[SchedulerOutput, ModelRunnerOutput] | None:
        sched = self.scheduler
        placeholders = {r.req_id: r.num_output_placeholders for r in sched.requests.values()}
        out = sched.schedule()
        if out.is_empty:
            sched.finished_req_ids |= out.finished_req_ids
            return None
        sampled = []
        for req_id in out.num_scheduled_tokens:
            req = sched.requests[req_id]
            samples = req.num_output_placeholders > placeholders.get(req_id, 0)
            sampled.append([random_token(req_id, req.num_computed_tokens)] if samples else [])
        return out, ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)

    def step(self) -> None:
        sched = self.scheduler
        if self.in_flight is None:
            self.in_flight = self._launch()
            assert self.in_flight is not None, "no progress with unfinished requests"
        current, self.in_flight = self.in_flight, None
        if sched.has_unfinished_requests():
            self.in_flight = self._launch()
            self.num_ahead += self.in_flight is not None
        for out in sched.update_from_output(*current):
            assert out.req_id not in self.finish, f"{out.req_id} reported after it finished"
            self.streamed.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finish[out.req_id] = out.finish_reason
        sched.kv_cache_manager.check_integrity()

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self.in_flight is not None


def random_requests(rng: random.Random, n: int, block_size: int) -> list[Request]:
    reqs = []
    for i in range(n):
        max_tokens = rng.randint(1, 20)
        reqs.append(
            make_request(
                f"r{i}",
                [rng.randrange(60, 90) for _ in range(rng.randint(1, 3 * block_size + 2))],
                max_tokens=max_tokens,
                ignore_eos=rng.random() < 0.5,
                min_tokens=min(rng.choice([0, 0, 2]), max_tokens),
                block_size=block_size,
            )
        )
    return reqs


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("admission_kv_limit", [True, False], ids=["holdback", "optimistic"])
def test_async_scheduling_streams_what_sync_streams(seed: int, admission_kv_limit: bool) -> None:
    # Random prompts, lengths, EOS stops, min_tokens, segmented prefills and (optimistic, on a
    # tiny pool) preemption of requests whose token is in flight: the same tokens and finish
    # reasons as one step at a time, and every block back in the pool.
    block_size = 4

    def scheduler() -> Scheduler:
        return make_scheduler(
            num_blocks=1 + (20 if admission_kv_limit else 9),
            block_size=block_size,
            max_model_len=6 * block_size,
            max_num_seqs=5,
            max_num_batched_tokens=2 * block_size + 3,
            admission_kv_limit=admission_kv_limit,
        )

    sync_sched = scheduler()
    sync = Driver(sync_sched, token_fn=lambda r: random_token(r.req_id, r.num_tokens))
    pipelined = PipelinedDriver(scheduler())
    arrivals = random_requests(random.Random(seed), 30, block_size)
    twins = random_requests(random.Random(seed), 30, block_size)
    rng = random.Random(seed + 100)
    schedule = [rng.randint(0, 2) for _ in arrivals]  # steps between arrivals
    for reqs, drive, busy in (
        (arrivals, sync.step, sync_sched.has_unfinished_requests),
        (twins, pipelined.step, pipelined.busy),
    ):
        for req, wait in zip(reqs, schedule, strict=True):
            drive.__self__.scheduler.add_request(req)
            for _ in range(wait):
                if busy():
                    drive()
        for _ in range(3000):
            if not busy():
                break
            drive()
        assert not busy(), "the workload does not drain"
    assert pipelined.streamed == sync.streamed
    assert pipelined.finish == {k: v[0] for k, v in sync.finish.items()}
    assert pipelined.num_ahead > 0, "no step was scheduled ahead"
    if not admission_kv_limit:
        assert pipelined.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for s in (sync_sched, pipelined.scheduler):
        assert s.kv_cache_manager.usage == 0.0
    # One step at a time, every placeholder is settled before the next schedule.
    assert all(r.num_output_placeholders == 0 for r in arrivals)


def test_in_flight_last_token_is_not_scheduled_ahead() -> None:
    sched = make_scheduler()
    req = make_request("a", prompt(5, 100), max_tokens=2)
    sched.add_request(req)
    first = sched.schedule()  # the prefill, sampling token 1 of 2
    assert first.num_scheduled_tokens == {"a": 5} and req.num_output_placeholders == 1
    ahead = sched.schedule()  # token 2 is sampled from the (unknown) token 1
    assert ahead.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    assert sched.schedule().is_empty  # token 2 is the last: nothing to schedule past it
    sched.update_from_output(first, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]]))
    outputs = sched.update_from_output(ahead, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[8]]))
    assert req.output_token_ids == [7, 8] and outputs[0].finish_reason == "length"
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.usage == 0.0


def test_grammar_requests_are_not_scheduled_ahead() -> None:
    sched = make_scheduler()
    plain = make_request("a", prompt(3, 100))
    sched.add_request(plain)
    assert sched.can_schedule_ahead()
    constrained = make_request("b", prompt(3, 200))
    constrained.structured_output_request = object()  # the grammar masks each token from the last
    sched.add_request(constrained)
    assert not sched.can_schedule_ahead()
    sched.schedule()
    assert not sched.can_schedule_ahead()  # running now


def _spec_scheduler(spec_config) -> Scheduler:
    """Two sequences at most, blocks of 4 tokens, no prefix caching, speculating as ``spec_config`` says."""
    return Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        64,
        64,
        spec_config=spec_config,
    )


def test_draft_policy_sees_the_batch_that_can_run_not_the_queue() -> None:
    """A queue longer than max_num_seqs does not switch speculation off for the few that run."""
    from axon.spec_decode.config import SpecDecodeConfig

    seen: list[int] = []
    sched = _spec_scheduler(SpecDecodeConfig(method="ngram", num_speculative_tokens=2))
    assert sched.draft_policy is not None
    real = sched.draft_policy.num_drafts

    def spy(batch_size: int) -> int:
        seen.append(batch_size)
        return real(batch_size)

    sched.draft_policy.num_drafts = spy  # type: ignore[method-assign]
    for i in range(40):
        sched.add_request(make_request(f"r{i}", prompt(4, 100 * i)))
    sched.schedule()
    assert seen == [2]


def test_rejected_drafts_keep_the_block_of_the_next_token() -> None:
    """After a verification the next token's slot keeps its block: a model proposer has already
    written its draft KV there (the catch-up pass), and the next step computes that slot anyway.
    Freeing the block lost that KV and made the draft read another block's."""
    from axon.spec_decode.config import SpecDecodeConfig

    sched = _spec_scheduler(SpecDecodeConfig(method="draft_model", num_speculative_tokens=3, model="draft"))
    sched.draft_policy.num_drafts = lambda batch_size: 3  # type: ignore[method-assign,union-attr]
    req = make_request("r", prompt(7, 100))
    sched.add_request(req)
    out = sched.schedule()  # the prompt: positions 0-6, drafts' slots to 9
    sched.update_from_output(
        out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[50]], spec_token_ids={"r": [51, 52, 53]})
    )
    out = sched.schedule()  # verify 50, 51, 52, 53 at 7-10; the next drafts' slots to 13
    assert out.scheduled_spec_decode_tokens == {"r": [51, 52, 53]}
    blocks = sched.kv_cache_manager.get_block_ids("r")
    assert len(blocks) == 4
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[60]]))  # all rejected
    assert (req.num_computed_tokens, req.num_tokens) == (8, 9)
    # 60 sits at position 8, in the third block: kept, the rejected drafts' fourth released.
    assert sched.kv_cache_manager.get_block_ids("r") == blocks[:3]


# ---- the encoder budget (multimodal requests) ----


def _with_images(req: Request, *num_tokens: int) -> Request:
    """``req`` with images of ``num_tokens`` image tokens each (the scheduler reads only their size)."""
    from axon.multimodal.inputs import ImageInput

    req.images = [ImageInput(b"", 1, (1, 2, 2), 0, n, f"{i:x}") for i, n in enumerate(num_tokens)]
    return req


def _encoder_scheduler(budget: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_num_encoder_input_tokens=budget),
        CacheConfig(block_size=4),
        64,
        64,
    )


def test_a_step_encodes_at_most_the_encoder_budget_in_fcfs_order() -> None:
    driver = Driver(_encoder_scheduler(budget=10))
    a = _with_images(make_request("a", prompt(8, 0)), 4, 4)
    b = _with_images(make_request("b", prompt(8, 100)), 6)  # 8 + 6 > 10: the next step
    c = make_request("c", prompt(8, 200))  # no images, but FCFS: behind b
    driver.add(a, b, c)
    first, _ = driver.step()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["a"]
    second, _ = driver.step()
    assert [r.req_id for r in second.scheduled_new_reqs] == ["b", "c"]


def test_images_past_the_whole_encoder_budget_run_in_a_step_without_other_images() -> None:
    driver = Driver(_encoder_scheduler(budget=10))
    text = make_request("text", prompt(4, 0))
    big = _with_images(make_request("big", prompt(8, 100)), 12)
    small = _with_images(make_request("small", prompt(8, 200)), 2)
    driver.add(text, big, small)
    first, _ = driver.step()
    assert [r.req_id for r in first.scheduled_new_reqs] == ["text", "big"]  # big alone among images
    second, _ = driver.step()
    assert [r.req_id for r in second.scheduled_new_reqs] == ["small"]
    while driver.scheduler.has_unfinished_requests():
        driver.step()
    assert set(driver.finish) == {"text", "big", "small"}
