"""The scheduler with a KV connector, both halves real (the shared-storage connector on small
cache tensors; the model is the fake of test_scheduler): a loaded request waits holding its
blocks and resumes with the loaded tokens computed; a failed load is tried once and the prompt
recomputed (or the request fails, under "fail"); an abort during a load frees the blocks when
the load ends; a producer's blocks are free once its prompt is saved. KV usage returns to 0."""

from __future__ import annotations

import os

import torch

from axon.config import CacheConfig, SchedulerConfig
from axon.core.kv_cache_utils import make_block_hasher
from axon.core.request import Request, RequestStatus
from axon.core.scheduler import Scheduler
from axon.kv_transfer.config import parse_kv_transfer_config
from axon.kv_transfer.factory import make_scheduler_connector, make_worker_connector
from axon.sampling_params import SamplingParams
from axon.scheduler_output import ModelRunnerOutput

BLOCK = 4
NUM_BLOCKS = 32
PROMPT = list(range(100, 110))  # 10 tokens: blocks 0 and 1 are full before the last token
EOS = 2


class Server:
    """One engine's scheduler and connector worker over a [NUM_BLOCKS, BLOCK, 2, 8] cache."""

    def __init__(
        self, role: str, path: str, policy: str = "recompute", seed: int = 0, model: str = "m"
    ) -> None:
        settings = parse_kv_transfer_config(
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": role,
                "kv_load_failure_policy": policy,
                "kv_connector_extra_config": {"shared_storage_path": path},
            }
        )
        assert settings is not None
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
            CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            64,
            NUM_BLOCKS,
            kv_connector=make_scheduler_connector(settings, BLOCK, 0),
            kv_load_failure_policy=policy,
        )
        gen = torch.Generator().manual_seed(seed)
        self.caches = [
            (
                torch.randn(NUM_BLOCKS, BLOCK, 2, 8, generator=gen),
                torch.randn(NUM_BLOCKS, BLOCK, 2, 8, generator=gen),
            )
            for _ in range(2)
        ]
        self.worker = make_worker_connector(settings, BLOCK, 0)
        self.worker.model_identity = model
        self.worker.register_kv_caches(self.caches)
        self.finish: dict[str, str | None] = {}
        self.params: dict[str, dict | None] = {}
        self.scheduled: list[dict[str, int]] = []
        self.block_ids: dict[str, list[int]] = {}  # each request's blocks when last scheduled

    def add(self, req_id: str, kv_transfer_params: dict | None = None, max_tokens: int = 3) -> Request:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True).for_engine(
            EOS, 1000, default_max_tokens=max_tokens
        )
        req = Request(
            req_id,
            list(PROMPT),
            params,
            eos_token_id=EOS,
            block_hasher=make_block_hasher(BLOCK),
            kv_transfer_params=kv_transfer_params,
        )
        self.scheduler.add_request(req)
        return req

    def step(self) -> None:
        sched = self.scheduler
        out = sched.schedule()
        self.scheduled.append(dict(out.num_scheduled_tokens))
        for req_id in out.num_scheduled_tokens:
            self.block_ids[req_id] = sched.kv_cache_manager.get_block_ids(req_id)
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv()
        sampled = []
        for req_id in out.num_scheduled_tokens:
            req = sched.requests[req_id]
            sampled.append([500 + req.num_tokens] if req.num_computed_tokens == req.num_tokens else [])
        self.worker.wait_for_save()
        runner = ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)
        runner.kv_connector_output = self.worker.get_finished(out.finished_req_ids)
        for o in sched.update_from_output(out, runner):
            if o.finished:
                self.finish[o.req_id] = o.finish_reason
                self.params[o.req_id] = o.kv_transfer_params
        sched.kv_cache_manager.check_integrity()

    def run(self, max_steps: int = 50) -> None:
        for _ in range(max_steps):
            if not (self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_transfers()):
                return
            self.step()
        raise AssertionError("did not settle")

    def blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        return [t[block_ids] for kv in self.caches for t in kv]

    @property
    def usage(self) -> float:
        return self.scheduler.kv_cache_manager.usage


def _prefill(path: str) -> tuple[Server, list[torch.Tensor], dict]:
    """A producer computes PROMPT and saves its full blocks: (it, their contents, the params)."""
    producer = Server("kv_producer", path, seed=1)
    producer.add("p", {"do_remote_decode": True}, max_tokens=1)
    producer.run()
    saved = producer.blocks(producer.block_ids["p"][:2])
    assert producer.finish["p"] == "length"
    assert producer.params["p"]["do_remote_prefill"] is True
    assert producer.usage == 0.0  # saved with the step: nothing waits for a reader
    return producer, saved, producer.params["p"]


def test_loaded_blocks_hold_the_producers_kv_and_only_the_rest_is_computed(tmp_path) -> None:
    _, saved, params = _prefill(str(tmp_path))
    decode = Server("kv_consumer", str(tmp_path), seed=2)
    req = decode.add("d", params)
    decode.step()  # admitted: blocks allocated, the load ran, nothing computed yet
    assert decode.scheduled[-1] == {}
    decode.step()  # loaded: 8 tokens computed, the last two prompt tokens run
    assert decode.scheduled[-1] == {"d": 2}
    assert req.num_cached_tokens == 8
    got = decode.blocks(decode.scheduler.kv_cache_manager.get_block_ids("d")[:2])
    assert all(torch.equal(a, b) for a, b in zip(got, saved, strict=True))
    decode.run()
    assert decode.finish["d"] == "length" and req.output_token_ids
    assert decode.usage == 0.0
    assert not os.listdir(tmp_path)  # made for this request, deleted once loaded
    # The loaded blocks are in the prefix cache: the same prompt hits them, with nothing to load.
    again = decode.add("d2")
    decode.step()
    assert decode.scheduled[-1] == {"d2": 2} and again.num_cached_tokens == 8


def test_a_failed_load_is_tried_once_and_the_prompt_recomputed(tmp_path) -> None:
    _prefill(str(tmp_path))
    (name,) = os.listdir(tmp_path)
    (tmp_path / name).write_bytes(b"not KV at all")
    decode = Server("kv_consumer", str(tmp_path))
    decode.add("d", {"do_remote_prefill": True})
    decode.run()
    assert decode.finish["d"] == "length"
    assert next(s for s in decode.scheduled if s) == {"d": len(PROMPT)}  # the whole prompt
    # Tried once: the file still looks like a source, but the request never loads again.
    assert decode.scheduler.kv_transfer_stats.num_failed_transfers == 1
    assert decode.usage == 0.0


def test_fail_policy_ends_the_request_with_an_error(tmp_path) -> None:
    _prefill(str(tmp_path))
    (name,) = os.listdir(tmp_path)
    (tmp_path / name).write_bytes(b"not KV at all")
    decode = Server("kv_consumer", str(tmp_path), policy="fail")
    decode.add("d", {"do_remote_prefill": True})
    decode.add("other", max_tokens=2)  # unharmed
    decode.run()
    assert decode.finish == {"d": "error", "other": "length"}
    assert decode.usage == 0.0


def test_an_abort_during_a_load_frees_the_blocks_when_it_ends(tmp_path) -> None:
    _, _, params = _prefill(str(tmp_path))
    decode = Server("kv_consumer", str(tmp_path))
    decode.add("d", params)
    sched = decode.scheduler
    out = sched.schedule()  # parked: its blocks are the load's target
    assert sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS and decode.usage > 0
    sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.has_pending_transfers()
    assert decode.usage > 0  # the load may still be writing them
    decode.worker.bind_connector_metadata(out.kv_connector_metadata)
    decode.worker.start_load_kv()
    runner = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    runner.kv_connector_output = decode.worker.get_finished(out.finished_req_ids)
    sched.update_from_output(out, runner)
    decode.run()
    assert not sched.has_pending_transfers() and decode.usage == 0.0


def test_kv_from_another_model_is_never_loaded(tmp_path) -> None:
    """Same cache layout, another model (or quantization): the load fails and the prompt is
    computed here."""
    _, _, params = _prefill(str(tmp_path))
    decode = Server("kv_consumer", str(tmp_path), model="another model")
    decode.add("d", params)
    decode.run()
    assert decode.finish["d"] == "length"
    assert next(s for s in decode.scheduled if s) == {"d": len(PROMPT)}
    assert decode.scheduler.kv_transfer_stats.num_failed_transfers == 1
