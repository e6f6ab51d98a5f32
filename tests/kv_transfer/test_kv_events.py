"""KV cache events (``--kv-events-config``): the block pool's events replay to exactly its prefix
cache, the bytes on the wire decode with vLLM's own struct definitions, and a real ``axon serve``
publishes a chat request's prompt blocks to a ZMQ subscriber."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from axon.core.kv_cache_manager import KVCacheManager
from axon.core.kv_cache_utils import BlockHash, hash_block_tokens
from axon.core.request import Request
from axon.kv_transfer.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventsConfig,
    NullEventPublisher,
    ZmqEventPublisher,
    external_block_hash,
    make_kv_event_publisher,
    offset_endpoint,
    parse_kv_events_config,
)
from tests.core.test_kv_cache_manager import BLOCK_SIZE, KVCacheMachine, Simulator, make_request
from tests.server.conftest import ServerProcess, free_port

# ---------------------------------------------------------------- vLLM's structs, as a subscriber has them
# Copied field for field from vllm/distributed/kv_events.py (after vllm-project/vllm#42892, which
# made each event a tagged map; the batch stays an array), so these tests decode axon's bytes
# the way vLLM's own subscribers do. Only the class names differ (a Vllm prefix), so each event
# class names its tag, which vLLM's take from their class names.

ExternalBlockHash = bytes | int


class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]


VLLM_DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


# ---------------------------------------------------------------- the pool's events replay to its cache


class EventReplay:
    """A subscriber's view: the set of hashes the events say are cached, checked event by event
    (a hash is stored only when absent, removed only when present), and each stored block's
    hash recomputed from its tokens and its parent, which an earlier event must have stored."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.full_hashes: dict[int, BlockHash] = {}  # every stored block's hash, by its wire form
        self.num_stored = self.num_removed = self.num_cleared = 0

    def apply(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._check_chain(event)
                assert not self.cached & set(event.block_hashes), f"stored twice: {event}"
                self.cached |= set(event.block_hashes)
                self.num_stored += 1
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.cached, f"removed while not stored: {event}"
                self.cached -= set(event.block_hashes)
                self.num_removed += 1
            else:
                assert isinstance(event, AllBlocksCleared), event
                self.cached.clear()
                self.num_cleared += 1

    def _check_chain(self, event: BlockStored) -> None:
        assert event.block_size == BLOCK_SIZE and event.medium == "GPU"
        assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
        assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)
        parent = None if event.parent_block_hash is None else self.full_hashes[event.parent_block_hash]
        for i, wire_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
            parent = hash_block_tokens(parent, tokens, event.extra_keys[i])
            assert external_block_hash(parent) == wire_hash, f"block {i} of {event} does not chain"
            self.full_hashes[wire_hash] = parent


class Workload(Simulator):
    """tests/core's toy scheduler (shared prefixes, hits, evictions, preemptions, resets) with
    events on, and one more operation: dropping a block's hash (``evict_blocks``)."""

    def __init__(self, rng: random.Random, num_blocks: int = 24, max_model_len: int = 48) -> None:
        super().__init__(rng, num_blocks, max_model_len)
        self.manager.enable_kv_cache_events()
        self.replay = EventReplay()

    def evict(self) -> None:
        pool = self.manager.block_pool
        pool.evict_blocks([self.rng.randrange(1, pool.num_blocks)])

    def check(self) -> None:
        super().check()
        self.replay.apply(self.manager.take_events())
        pool = self.manager.block_pool
        assert self.replay.cached == {external_block_hash(h) for h in pool.cached_block_hash_to_block}

    def random_op(self) -> None:
        self.rng.choices([super().random_op, self.evict], weights=[40, 1])[0]()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replayed_events_are_the_prefix_cache(seed: int) -> None:
    work = Workload(random.Random(seed))
    for _ in range(3000):
        work.random_op()
        work.check()
    for req in list(work.running):
        work.finish(req)
    work.reset()
    work.check()
    assert work.replay.cached == set() and work.num_hits > 0
    replay = work.replay
    assert replay.num_stored > 50 and replay.num_removed > 50 and replay.num_cleared > 0, vars(replay)


class KVEventsMachine(KVCacheMachine):
    """tests/core's machine over the workload with events on; its invariant replays them."""

    @initialize(seed=st.integers(0, 2**16), num_blocks=st.integers(2, 12))
    def start(self, seed: int, num_blocks: int) -> None:
        self.sim = Workload(random.Random(seed), num_blocks=num_blocks, max_model_len=32)

    @rule()
    def evict(self) -> None:
        self.sim.evict()


TestKVEventsMachine = KVEventsMachine.TestCase
TestKVEventsMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)


def test_a_duplicate_block_splits_the_stored_run() -> None:
    """A block whose content is cached already stays unregistered (one block per hash), so the
    blocks around it are reported in two events, each chained on the block before it."""
    manager = KVCacheManager(16, BLOCK_SIZE, 64, enable_caching=True)
    manager.enable_kv_cache_events()
    tokens = list(range(12))
    a = make_request("a", tokens[:8] + [99])
    manager.allocate_slots(a, a.num_tokens)  # caches blocks 0 and 1
    manager.block_pool.evict_blocks([manager.get_block_ids("a")[0]])  # block 0 no longer
    b = make_request("b", tokens + [99])
    manager.allocate_slots(b, b.num_tokens)  # registers its blocks 0 and 2; 1 is a's
    h = [external_block_hash(x) for x in b.block_hashes]
    *_, removed, first, second = manager.take_events()
    assert removed == BlockRemoved(block_hashes=[h[0]], medium="GPU", group_idx=0)
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == ([h[0]], None, tokens[:4])
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([h[2]], h[1], tokens[8:])


def test_events_off_record_nothing() -> None:
    manager = KVCacheManager(8, BLOCK_SIZE, 32, enable_caching=True)
    req = make_request("a", list(range(9)))
    manager.allocate_slots(req, 9)
    assert manager.block_pool.kv_events is None and manager.take_events() == []


def test_external_hash_is_vllms_default_conversion() -> None:
    digest = bytes(range(32))
    assert external_block_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert external_block_hash(digest) == int.from_bytes(digest[24:], "big")


# ---------------------------------------------------------------- the config


def test_config_defaults_follow_vllm() -> None:
    assert parse_kv_events_config(None) is None
    on = parse_kv_events_config({"enable_kv_cache_events": True})
    assert on == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq") and on.publishes
    off = parse_kv_events_config({"endpoint": "tcp://*:6000"})
    assert off is not None and off.publisher == "null" and not off.publishes
    assert isinstance(make_kv_event_publisher(off), NullEventPublisher)
    assert not make_kv_event_publisher(None).enabled


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"enable_kv_cache_events": True, "publisher": "kafka"},
            "publisher must be one of null, zmq, got 'kafka'",
        ),
        ({"endpont": "tcp://*:5557"}, "unknown key 'endpont'; did you mean 'endpoint'?"),
        ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be true or false, got 'yes'"),
        ({"endpoint": "localhost:5557"}, "endpoint must be a ZMQ address"),
        ({"replay_endpoint": "udp://*:1"}, "replay_endpoint must be a ZMQ address"),
        ({"max_queue_size": 0}, "max_queue_size must be a whole number >= 1, got 0"),
        ({"hwm": True}, "hwm must be a whole number >= 0, got True"),
        ({"topic": 7}, "topic must be a string, got 7"),
        ("zmq", "kv_events_config must be a JSON object"),
    ],
)
def test_bad_config_names_the_key(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_kv_events_config(raw)


def test_data_parallel_ranks_offset_the_port() -> None:
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    with pytest.raises(ValueError, match="numeric port"):
        offset_endpoint("tcp://*:any", 1)


def test_llm_refuses_an_unknown_publisher() -> None:
    from axon import LLM

    with pytest.raises(ValueError, match="kv_events_config.publisher must be one of null, zmq, got 'kafka'"):
        LLM(kv_events_config={"enable_kv_cache_events": True, "publisher": "kafka"})


def test_serve_refuses_an_unknown_publisher_as_a_usage_error() -> None:
    bad = json.dumps({"enable_kv_cache_events": True, "publisher": "kafka"})
    proc = subprocess.run(
        [sys.executable, "-m", "axon.entrypoints.cli", "serve", "--kv-events-config", bad],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "axon serve: error: kv_events_config.publisher must be one of null, zmq, got 'kafka'" in proc.stderr
    )


# ---------------------------------------------------------------- the publisher and the wire


def subscriber(ctx: zmq.Context, port: int, topic: bytes = b"") -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # a PUB socket drops what it sends before the subscription reaches it
    return sub


def receive(sub: zmq.Socket, timeout_s: float = 10.0) -> tuple[bytes, int, bytes]:
    assert sub.poll(int(timeout_s * 1000)), "no KV event batch arrived"
    topic, seq, payload = sub.recv_multipart()
    assert len(seq) == 8
    return topic, int.from_bytes(seq, "big"), payload


def pool_events() -> tuple[list[KVCacheEvent], Request]:
    """Stored (salted, 2 blocks), removed (evicted for a new allocation), cleared."""
    manager = KVCacheManager(4, BLOCK_SIZE, 12, enable_caching=True)
    manager.enable_kv_cache_events()
    a = make_request("a", list(range(9)), cache_salt="tenant")
    manager.allocate_slots(a, 9)
    manager.free(a)
    b = make_request("b", list(range(50, 59)))
    manager.allocate_slots(b, 9)  # 3 blocks: both of a's cached blocks are evicted
    manager.free(b)
    assert manager.reset_prefix_cache()
    return manager.take_events(), a


def test_published_bytes_decode_with_vllms_structs() -> None:
    events, a = pool_events()
    port = free_port()
    config = parse_kv_events_config(
        {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv"}
    )
    publisher = make_kv_event_publisher(config)
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, port, b"kv")
        publisher.publish(events)
        publisher.publish(events[:1])
        (topic0, seq0, payload), (_, seq1, _) = receive(sub), receive(sub)
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert (topic0, seq0, seq1) == (b"kv", 0, 1)

    batch = VLLM_DECODER.decode(payload)
    assert abs(batch.ts - time.time()) < 60 and batch.data_parallel_rank == 0
    stored, removed, stored_b, cleared = batch.events
    h = [external_block_hash(x) for x in a.block_hashes]
    assert stored == VllmBlockStored(
        block_hashes=h,
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("tenant",), None],
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    assert stored_b.parent_block_hash is None and len(stored_b.block_hashes) == 2
    assert removed == VllmBlockRemoved(block_hashes=h[::-1], medium="GPU", group_idx=0)  # a freed tail first
    assert cleared == VllmAllBlocksCleared()

    # The raw layout a router without msgspec reads: the batch an array, each event a map.
    raw = msgspec.msgpack.decode(payload)
    assert isinstance(raw, list) and len(raw) == 3 and raw[2] == 0
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["block_hashes"] == h
    assert raw[1][3] == {"type": "AllBlocksCleared"}


def test_replay_sends_buffered_batches_then_the_end_marker() -> None:
    port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        buffer_steps=2,
    )
    publisher = ZmqEventPublisher(config)
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, port)
        for i in range(4):
            publisher.publish([AllBlocksCleared()] * (i + 1))
        assert [receive(sub)[1] for _ in range(4)] == [0, 1, 2, 3]
        # A DEALER takes every reply (a REQ socket takes only the first): it sends the empty
        # delimiter a REQ would add, then the first seq it wants.
        replay = ctx.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", (1).to_bytes(8, "big")])  # the buffer keeps only 2 and 3
        replies = []
        while not replies or replies[-1][1]:
            assert replay.poll(10_000), "no replay answer"
            empty, seq_bytes, payload = replay.recv_multipart()
            assert empty == b""
            replies.append((int.from_bytes(seq_bytes, "big", signed=True), payload))
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert [seq for seq, _ in replies] == [2, 3, -1]
    assert [len(VLLM_DECODER.decode(p).events) for _, p in replies[:-1]] == [3, 4]


def test_a_full_queue_drops_batches_and_leaves_a_seq_gap() -> None:
    """The engine never waits on the publisher: a batch that finds the queue full is dropped,
    and its seq stays unused so that subscribers see they missed one."""
    port = free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}", max_queue_size=1
    )
    publisher = ZmqEventPublisher(config)
    entered, release = threading.Event(), threading.Event()
    send = publisher._send

    def held_send(*args: Any) -> None:
        entered.set()
        release.wait(10)
        send(*args)

    publisher._send = held_send  # type: ignore[method-assign]
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, port)
        publisher.publish([])  # seq 0: the thread takes it and is held sending it
        assert entered.wait(10)
        publisher.publish([])  # seq 1: fills the queue
        publisher.publish([])  # seq 2: dropped
        release.set()
        deadline = time.monotonic() + 10
        while publisher._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        publisher.publish([])  # seq 3
        seqs = [receive(sub)[1] for _ in range(3)]
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert seqs == [0, 1, 3]


def test_shutdown_stops_the_thread_and_frees_the_port() -> None:
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}")
    first = ZmqEventPublisher(config, data_parallel_rank=0)
    first.publish([AllBlocksCleared()])
    first.shutdown()
    first.shutdown()  # twice is harmless
    assert not first._thread.is_alive()
    second = ZmqEventPublisher(config)  # the port is free again: the sockets were closed
    second.shutdown()


def test_a_taken_port_fails_the_start() -> None:
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port}")
    first = ZmqEventPublisher(config)
    try:
        with pytest.raises(RuntimeError, match=f"cannot open tcp://\\*:{port}"):
            ZmqEventPublisher(config)
    finally:
        first.shutdown()


def test_each_data_parallel_rank_publishes_on_its_own_port() -> None:
    port = free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{port - 2}")
    publisher = ZmqEventPublisher(config, data_parallel_rank=2)
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, port)
        publisher.publish([AllBlocksCleared()])
        _, seq, payload = receive(sub)
    finally:
        publisher.shutdown()
        ctx.destroy(linger=0)
    assert publisher.endpoint == f"tcp://*:{port}" and seq == 0
    assert VLLM_DECODER.decode(payload).data_parallel_rank == 2


# ---------------------------------------------------------------- through a real server


def test_server_publishes_a_chat_prompts_blocks() -> None:
    port = free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": "kv",
    }
    server = ServerProcess("--kv-events-config", json.dumps(config)).wait_ready()
    ctx = zmq.Context()
    try:
        sub = subscriber(ctx, port, b"kv")
        client = server.client()
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "What is the capital of France?"}]  # ends at EOS
        response = client.chat.completions.create(model=model, messages=messages, temperature=0)
        assert response.choices[0].finish_reason == "stop"
        tokenized = httpx.post(f"{server.url}/tokenize", json={"model": model, "messages": messages}).json()
        prompt = tokenized["tokens"]
        assert len(prompt) == response.usage.prompt_tokens
        stored: list[VllmBlockStored] = []
        seqs: list[int] = []
        block_size = 16
        while sum(len(e.block_hashes) for e in stored) < len(prompt) // block_size:
            topic, seq, payload = receive(sub)
            assert topic == b"kv"
            seqs.append(seq)
            batch = VLLM_DECODER.decode(payload)
            assert batch.data_parallel_rank == 0
            stored += [e for e in batch.events if isinstance(e, VllmBlockStored)]
    finally:
        ctx.destroy(linger=0)
        server.stop()
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"seq numbers skip: {seqs}"
    # One request, so its blocks come in order, each event chained on the one before.
    parent = None
    tokens: list[int] = []
    for event in stored:
        assert event.parent_block_hash == parent and event.block_size == block_size and event.medium == "GPU"
        parent = event.block_hashes[-1]
        tokens += event.token_ids
    num_full = len(prompt) // block_size
    assert num_full >= 2 and tokens[: num_full * block_size] == prompt[: num_full * block_size]
