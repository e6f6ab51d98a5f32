"""Pooling requests in the scheduler: batched with generation within the token budget, finished
by their pooled vector, never sampled; an encoder's prompt is never split across steps."""

from __future__ import annotations

from axon.config import CacheConfig, SchedulerConfig
from axon.core.request import Request, RequestStatus
from axon.core.scheduler import Scheduler
from axon.pooling_params import EnginePoolingParams
from axon.sampling_params import SamplingParams
from axon.scheduler_output import ModelRunnerOutput, SchedulerOutput

POOL = EnginePoolingParams(dimensions=None, normalize=True)


def scheduler(budget: int, encoder_only: bool = False) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        CacheConfig(block_size=4, enable_prefix_caching=True),
        64,
        64,
        encoder_only=encoder_only,
    )


def pooling(req_id: str, n: int) -> Request:
    return Request(req_id, list(range(1, n + 1)), None, pooling_params=POOL)


def generating(req_id: str, n: int) -> Request:
    return Request(req_id, list(range(1, n + 1)), SamplingParams(max_tokens=4).for_engine(2, 1000, 32))


def run(s: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
    """A fake model: a pooling request whose prompt completed gets a vector; others sample 7."""
    req_ids = list(out.num_scheduled_tokens)
    pooled, sampled = {}, []
    for req_id in req_ids:
        req = s.requests[req_id]
        if req.is_pooling:
            sampled.append([])
            if req.num_computed_tokens == req.num_tokens:
                pooled[req_id] = [float(req.num_tokens)]
        else:
            sampled.append([7] if req.num_output_placeholders else [])  # it samples this step
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, pooler_output=pooled)


def test_pooling_batched_with_generation_and_finished_by_its_vector() -> None:
    s = scheduler(budget=64)
    s.add_request(generating("g", 5))
    s.add_request(pooling("p", 9))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"g": 5, "p": 9}
    outputs = {o.req_id: o for o in s.update_from_output(out, run(s, out))}
    assert outputs["p"].pooled == [9.0] and outputs["p"].finish_reason == "stop"
    assert outputs["p"].new_token_ids == []
    assert "p" not in s.requests and outputs["g"].new_token_ids == [7]
    assert s.kv_cache_manager.usage > 0  # g still holds its blocks; p freed its own


def test_decoder_pooling_prompt_is_segmented_like_any_prefill() -> None:
    s = scheduler(budget=4)
    s.add_request(pooling("p", 10))
    steps = []
    while s.has_unfinished_requests():
        out = s.schedule()
        steps.append(out.num_scheduled_tokens["p"])
        outputs = s.update_from_output(out, run(s, out))
    assert steps == [4, 4, 2]
    assert outputs[0].pooled == [10.0]
    assert s.kv_cache_manager.usage == 0


def test_encoder_prompt_is_never_split() -> None:
    s = scheduler(budget=8, encoder_only=True)
    for req_id, n in (("a", 5), ("b", 5), ("c", 20)):
        s.add_request(pooling(req_id, n))
    scheduled = []
    while s.has_unfinished_requests():
        out = s.schedule()
        scheduled.append(out.num_scheduled_tokens)
        s.update_from_output(out, run(s, out))
    # b waits for a step with room for its whole prompt; c, longer than the budget, runs alone.
    assert scheduled == [{"a": 5}, {"b": 5}, {"c": 20}]


def test_aborted_pooling_request_frees_its_blocks() -> None:
    s = scheduler(budget=4)
    s.add_request(pooling("p", 10))
    out = s.schedule()
    s.update_from_output(out, run(s, out))
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests() and s.kv_cache_manager.usage == 0
