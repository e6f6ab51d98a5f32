"""KV cache events (vLLM's ``--kv-events-config``): which prefixes this server's cache holds, for
KV-aware routers (llm-d, Dynamo, axon's own) that send each request where its prefix is cached.

The block pool records an event whenever its prefix cache changes (``KVEventRecorder``); the
engine drains them after each step and publishes them as one batch. Everything on the wire is
vLLM's, so a router reads axon as it reads vLLM:

    ZMQ PUB, multipart:  [ topic (utf-8) | seq (8 bytes, unsigned big-endian) | payload ]
    payload, msgpack:    [ ts, [event, ...], data_parallel_rank ]      (KVEventBatch: an array)
    event, msgpack map:  {"type": "BlockStored", "block_hashes": [...], ...}   (tagged by "type")

seq counts batches from 0 for the life of the publisher; a gap means batches were lost (dropped
when the queue was full, or by ZMQ past its high-water mark). Events are maps, not arrays, as
in vLLM since its KV-event structs dropped ``array_like`` (vllm-project/vllm#42892); the batch
stays an array. A block hash on the wire is vLLM's default ``ExternalBlockHash``: the low 64
bits of the 32-byte SHA-256 digest (its last 8 bytes read big-endian), as an unsigned integer.

Replay (with ``replay_endpoint``): a ROUTER socket. A client (REQ, or DEALER sending an empty
delimiter) sends one frame, the first seq it wants (8 bytes, big-endian); it gets back, one
message each, ``[seq, payload]`` for every buffered batch from that seq on (the last
``buffer_steps`` batches), then ``[-1 as 8 signed big-endian bytes, b""]``.

With data parallelism each engine core publishes its own stream: the endpoint's TCP port (and
the replay endpoint's) is offset by the core's data-parallel rank (an ipc/inproc endpoint gets
``_dp<rank>`` appended), and every batch carries the rank.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from axon.kv_transfer.config import check_keys

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the records (vLLM's layout)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change of a prefix cache; on the wire a map whose "type" names the class."""


# vLLM's block pool reports "GPU" for the engine's own KV cache whatever the device, its CPU
# backend included; "CPU" and "STORAGE" name offload tiers, which routers weigh lower.
MEDIUM_GPU = "GPU"
# The only KV cache group axon has: every layer attends to the whole context.
GROUP_IDX = 0
KV_CACHE_SPEC_KIND = "full_attention"


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one sequence became findable by a prefix hit.

    ``token_ids`` holds all their tokens (``block_size`` per block, in order);
    ``parent_block_hash`` is the hash of the block before the first one (None: it starts the
    sequence), so the hashes chain across events.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block, what besides its tokens went into its hash: (cache_salt,) for a salted
    # request's first block, else None.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """These blocks can no longer be hit (evicted for a new allocation, or dropped)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was forgotten (a reset)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(block_hash: bytes) -> int:
    """vLLM's default ``maybe_convert_block_hash``: ``int.from_bytes(h, "big") & (2**64 - 1)``."""
    return int.from_bytes(block_hash[-8:], "big")


class KVEventRecorder:
    """A block pool's prefix-cache changes since the last ``take()``, in order.

    The pool holds one only while events are on, so with events off recording costs nothing.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []

    def stored(
        self,
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        """Blocks ``start..end-1`` of a sequence (its ``block_hashes``, its ``token_ids``) were
        registered. The salt is mixed into block 0 only (``make_block_hasher``)."""
        assert len(token_ids) >= end * self.block_size, (
            f"{len(token_ids)} token ids cannot fill blocks up to {end} of {self.block_size} tokens"
        )
        self.events.append(
            BlockStored(
                block_hashes=[external_block_hash(h) for h in block_hashes[start:end]],
                parent_block_hash=external_block_hash(block_hashes[start - 1]) if start > 0 else None,
                token_ids=list(token_ids[start * self.block_size : end * self.block_size]),
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=[(cache_salt,) if i == 0 and cache_salt else None for i in range(start, end)],
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # one event for a run of evictions
            last.block_hashes.append(external_block_hash(block_hash))
        else:
            self.events.append(
                BlockRemoved(
                    block_hashes=[external_block_hash(block_hash)], medium=MEDIUM_GPU, group_idx=GROUP_IDX
                )
            )

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


# ---------------------------------------------------------------- the config (vLLM's keys)

PUBLISHERS = ("null", "zmq")
TRANSPORTS = ("tcp", "ipc", "inproc")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # absent: "zmq" when events are on, as in vLLM
    endpoint: str = "tcp://*:5557"  # a wildcard, ipc or inproc address binds; any other connects
    replay_endpoint: str | None = None  # always binds
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZMQ send high-water mark (messages), 0: none
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


_DEFAULTS = KVEventsConfig()
_KEYS = [f.name for f in fields(KVEventsConfig)]


def _is_endpoint(value: Any) -> bool:
    return (
        isinstance(value, str) and value.partition("://")[0] in TRANSPORTS and bool(value.partition("://")[2])
    )


def _is_count(minimum: int) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= minimum


_ENDPOINT = f"must be a ZMQ address ({', '.join(t + '://...' for t in TRANSPORTS)})"
_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "enable_kv_cache_events": (lambda v: isinstance(v, bool), "must be true or false"),
    "publisher": (lambda v: v in PUBLISHERS, f"must be one of {', '.join(PUBLISHERS)}"),
    "endpoint": (_is_endpoint, _ENDPOINT),
    "replay_endpoint": (lambda v: v is None or _is_endpoint(v), _ENDPOINT),
    "buffer_steps": (_is_count(0), "must be a whole number >= 0"),
    "hwm": (_is_count(0), "must be a whole number >= 0"),
    "max_queue_size": (_is_count(1), "must be a whole number >= 1"),
    "topic": (lambda v: isinstance(v, str), "must be a string"),
}


def parse_kv_events_config(raw: dict[str, Any] | None) -> KVEventsConfig | None:
    """The checked config, or None when none is given. Errors name the key and the value."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"kv_events_config must be a JSON object, got {raw!r}.")  # noqa: TRY004
    check_keys("kv_events_config", raw, list(_KEYS))
    values = {name: raw.get(name, getattr(_DEFAULTS, name)) for name in _KEYS}
    if raw.get("publisher") is None:
        values["publisher"] = "zmq" if values["enable_kv_cache_events"] else "null"
    for name, (valid, what) in _CHECKS.items():
        if not valid(values[name]):
            raise ValueError(f"kv_events_config.{name} {what}, got {values[name]!r}.")
    return KVEventsConfig(**values)


def offset_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """Each data-parallel rank's own address: the TCP port plus the rank (vLLM's rule)."""
    if data_parallel_rank == 0:
        return endpoint
    transport, _, address = endpoint.partition("://")
    if transport != "tcp":
        return f"{endpoint}_dp{data_parallel_rank}"
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(
            f"kv_events_config endpoint {endpoint!r} needs a numeric port: data-parallel rank "
            f"{data_parallel_rank} publishes on that port + {data_parallel_rank}"
        )
    return f"tcp://{host}:{int(port) + data_parallel_rank}"


# ---------------------------------------------------------------- publishers


class EventPublisher(ABC):
    """Sends each step's events somewhere; never blocks the engine loop on the network."""

    # False: nothing is sent, so the block pool need not record events at all.
    enabled: ClassVar[bool] = True

    @abstractmethod
    def publish(self, events: list[KVCacheEvent]) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class NullEventPublisher(EventPublisher):
    enabled = False

    def publish(self, events: list[KVCacheEvent]) -> None:
        pass

    def shutdown(self) -> None:
        pass


class ZmqEventPublisher(EventPublisher):
    """A PUB socket (and a ROUTER for replay) that one background thread owns.

    ``publish`` stamps the batch (time, seq, rank) and queues it; the thread encodes and sends.
    A full queue drops the batch and leaves its seq unused, so subscribers see the gap. The
    sockets are bound here, so a taken port fails the engine's start, then used only by the
    thread, which closes them when ``shutdown`` stops it.
    """

    POLL_S = 0.05  # how long the idle thread waits before it looks at replay requests again
    SHUTDOWN_TIMEOUT_S = 2.0  # for the queued batches to go out
    LINGER_MS = 500  # for sent messages to leave the socket at close
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.data_parallel_rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (
            offset_endpoint(config.replay_endpoint, data_parallel_rank) if config.replay_endpoint else None
        )
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch]] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._dropping = False
        self._closed = False
        self._stopping = threading.Event()  # shutdown: send what is queued, then stop
        self._abandon = threading.Event()  # shutdown gave up waiting: stop now
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, self.LINGER_MS)
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            self._ctx.term()
            where = (
                self.endpoint
                if self.replay_endpoint is None
                else f"{self.endpoint} and {self.replay_endpoint}"
            )
            raise RuntimeError(f"kv_events_config: cannot open {where}: {e}") from e
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("publishing KV cache events on %s (replay: %s)", self.endpoint, self.replay_endpoint)

    def publish(self, events: list[KVCacheEvent]) -> None:
        assert not self._closed, "KV events published after shutdown"
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        try:
            self._queue.put_nowait((seq, batch))
        except queue.Full:
            if not self._dropping:
                logger.warning(
                    "KV events queue full (%d batches): dropping batches from seq %d on until the "
                    "publisher catches up; subscribers will see the gap",
                    self._queue.maxsize,
                    seq,
                )
            self._dropping = True
            return
        self._dropping = False

    def shutdown(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT_S), stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning(
                "KV events publisher: %d batches still queued at shutdown, dropped", self._queue.qsize()
            )
            self._abandon.set()
            self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():  # only a send stuck inside the ZMQ library gets here
            logger.error("KV events publisher thread did not stop; its sockets stay open")
            return
        self._ctx.term()

    # ---- the publisher thread: the only user of the sockets after __init__

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._abandon.is_set():
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    seq, batch = self._queue.get(timeout=self.POLL_S)
                except queue.Empty:
                    if self._stopping.is_set():
                        return
                    continue
                self._send(encoder, seq, batch)
        finally:
            self._close_sockets()

    def _send(self, encoder: msgspec.msgpack.Encoder, seq: int, batch: KVEventBatch) -> None:
        assert self._pub is not None
        try:
            payload = encoder.encode(batch)
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        except Exception:  # one lost batch is a gap subscribers see; the stream goes on
            logger.exception("KV events: batch %d not sent", seq)
            return
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        """[client, b"", start seq] -> [client, b"", seq, payload] per buffered batch, then END_SEQ."""
        assert self._replay is not None
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV events: ignored a replay request of %d frames, want 3", len(frames))
                return
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([client, b"", self.END_SEQ, b""])
        except Exception:  # a bad replay client must not stop the live stream
            logger.exception("KV events: replay request failed")

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, IPv6-any, ipc or inproc address; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def make_kv_event_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher ``config`` asks for ("zmq"), or one that sends nothing."""
    if config is None or not config.publishes:
        return NullEventPublisher()
    return ZmqEventPublisher(config, data_parallel_rank)
