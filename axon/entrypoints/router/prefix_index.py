"""The prefix index of ``axon router``'s ``prefix`` policy: per server, the KV blocks it holds,
learnt from its KV cache events (vLLM's ZMQ publisher format), keyed by content so that a prompt's
blocks can be looked up without the engines' block hashes.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

logger = logging.getLogger("axon.router")

# The chained content key of the empty prefix: the parent of every first block.
ROOT_KEY = 0


def next_key(parent_key: int, block_token_ids: Sequence[int]) -> int:
    return hash((parent_key, tuple(block_token_ids)))


def chain_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One key per full block of ``token_ids``: hash(parent block's key, the block's tokens), so
    that a key names the whole prefix up to its block's end. A trailing partial block has none."""
    keys = []
    key = ROOT_KEY
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = next_key(key, token_ids[start : start + block_size])
        keys.append(key)
    return keys


@dataclass
class ServerBlocks:
    """The blocks one server holds, by content.

    The router cannot compute the engine's block hashes (they are seeded per engine and include
    extra keys), so it keys blocks by content: each engine hash learnt from a BlockStored event
    maps to the chained content key of its block. Two engine blocks may hold the same content
    (another LoRA or cache salt), hence a count per content key: a key stays while any engine
    block with it does.
    """

    content_key: dict[Any, int] = field(default_factory=dict)  # engine block hash -> content key
    num_blocks: Counter[int] = field(default_factory=Counter)  # content key -> engine blocks

    def store(
        self, block_hashes: Sequence[Any], parent_hash: Any, token_ids: Sequence[int], block_size: int
    ) -> None:
        """``token_ids`` holds ``block_size`` tokens per hash of ``block_hashes``, in order; each
        block's parent is the one before it, the first one's is ``parent_hash``."""
        if parent_hash is None:
            key = ROOT_KEY
        elif parent_hash in self.content_key:
            key = self.content_key[parent_hash]
        else:
            return  # a chain whose start this router never saw cannot match from the root
        for i, block_hash in enumerate(block_hashes):
            block_token_ids = token_ids[i * block_size : (i + 1) * block_size]
            if len(block_token_ids) < block_size:
                return
            key = next_key(key, block_token_ids)
            self.remove([block_hash])  # a hash stored again replaces its old content
            self.content_key[block_hash] = key
            self.num_blocks[key] += 1

    def remove(self, block_hashes: Sequence[Any]) -> None:
        for block_hash in block_hashes:
            key = self.content_key.pop(block_hash, None)
            if key is not None:
                self.num_blocks[key] -= 1
                if not self.num_blocks[key]:
                    del self.num_blocks[key]

    def clear(self) -> None:
        self.content_key.clear()
        self.num_blocks.clear()

    def num_leading_blocks(self, keys: Sequence[int]) -> int:
        for n, key in enumerate(keys):
            if key not in self.num_blocks:
                return n
        return len(keys)


# The router's reading of vLLM's KV cache events (axon/kv_transfer/kv_events.py publishes the same):
# only the fields it uses. A message's payload is msgpack [ts, [event, ...], data_parallel_rank];
# an event is a map tagged by "type" (vLLM since vllm-project/vllm#42892, and axon), or, from older
# vLLM, an array: its tag, then its fields in order. Block hashes are integers (axon, vLLM's
# default) or bytes (older vLLM); the router only compares them.
class Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int


class Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[int | bytes]


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


KVEvent = Stored | Removed | Cleared
# The leading fields of each event in the array layout (the ones after them are not read).
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def decode_kv_events(payload: bytes) -> list[KVEvent]:
    """The events of one message's payload frame; raises msgspec.DecodeError (or its subclass
    ValidationError) on anything else."""
    batch = msgspec.msgpack.decode(payload)
    if not (isinstance(batch, list) and len(batch) >= 2 and isinstance(batch[1], list)):
        raise msgspec.DecodeError("a KV event batch is an array [ts, events, data_parallel_rank]")
    return [msgspec.convert(_as_map(event), KVEvent) for event in batch[1]]


def _as_map(event: Any) -> Any:
    if isinstance(event, list) and event and event[0] in _ARRAY_FIELDS:
        return {"type": event[0], **dict(zip(_ARRAY_FIELDS[event[0]], event[1:], strict=False))}
    return event


class PrefixIndex:
    """Per server (by its index among the routed backends), the blocks it holds by content."""

    def __init__(self, num_servers: int, block_size: int) -> None:
        self.block_size = block_size
        self.servers = [ServerBlocks() for _ in range(num_servers)]
        self._warned_block_size: set[int] = set()

    def apply(self, server: int, events: Sequence[KVEvent]) -> None:
        blocks = self.servers[server]
        for event in events:
            if isinstance(event, Stored):
                if event.block_size != self.block_size:
                    self._warn_block_size(server, event.block_size)
                    continue
                blocks.store(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size)
            elif isinstance(event, Removed):
                blocks.remove(event.block_hashes)
            else:
                blocks.clear()

    def num_leading_blocks(self, server: int, keys: Sequence[int]) -> int:
        return self.servers[server].num_leading_blocks(keys)

    def _warn_block_size(self, server: int, block_size: int) -> None:
        if server not in self._warned_block_size:
            self._warned_block_size.add(server)
            logger.warning(
                "server %d stores blocks of %d tokens, but the router splits prompts into blocks of "
                "%d (--block-size); its events are ignored",
                server,
                block_size,
                self.block_size,
            )


class KVEventSubscriber:
    """Feeds one server's KV events into the prefix index. Frames: [topic, 8-byte big-endian
    sequence number, payload]; a gap in the numbers (events lost, e.g. the server restarted) is
    logged, and the index goes on with what arrives."""

    def __init__(self, endpoint: str, server: int, index: PrefixIndex) -> None:
        self.endpoint = endpoint
        self.server = server
        self.index = index
        self._next_seq: int | None = None

    async def run(self, ctx: Any) -> None:
        import zmq

        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        try:
            while True:
                self.handle(await sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            logger.warning("KV events from %s: a message of %d frames, not 3", self.endpoint, len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        if self._next_seq is not None and seq != self._next_seq:
            logger.warning(
                "KV events from %s: expected message %d, got %d", self.endpoint, self._next_seq, seq
            )
        self._next_seq = seq + 1
        try:
            events = decode_kv_events(frames[2])
        except msgspec.DecodeError as e:
            logger.warning("KV events from %s: an undecodable message (%s)", self.endpoint, e)
            return
        self.index.apply(self.server, events)
