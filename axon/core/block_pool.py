"""The physical KV blocks: a free LRU queue and a hash -> block map for prefix caching.

Pure Python, no torch: this module only does bookkeeping of block ids; the worker owns the KV
tensors they index.

Every non-null block is in exactly one of two states:

    in use   ref_cnt > 0, outside the free queue (held by one or more requests)
    free     ref_cnt == 0, inside the free queue; it may still carry a block hash, in which case
             it is a *cached* free block: a later request can revive it by a prefix-cache hit
             (``touch``) until it is handed out again and evicted (``get_new_blocks``).

A block carries a hash iff the hash map points to it: ``block.block_hash == h <=> map[h] is
block``. Block 0 is the null block: never handed out, never freed, never in the queue.

With KV cache events on (``enable_kv_cache_events``), every change of the hash map is recorded
as it happens: a hash added (BlockStored), a hash dropped (BlockRemoved), the map emptied
(AllBlocksCleared). Replaying them in order on a set gives exactly the map's keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from axon.core.kv_cache_utils import BlockHash, is_window_group_hash
from axon.kv_transfer.kv_events import KVCacheEvent, KVEventRecorder


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical KV block. Compared by identity; ``block_id`` indexes the worker's cache."""

    block_id: int
    ref_cnt: int = 0
    # Chained hash of the prefix ending at this block, set once it is full and cached.
    block_hash: BlockHash | None = None
    # Links of the free queue; both None iff the block is not in the queue.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        # Not the dataclass repr: it would walk the whole free list through the links.
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in eviction order, with O(1) removal from the middle.

        head sentinel <-> b_lru <-> ... <-> b_mru <-> tail sentinel
        popleft() takes from here ^              ^ append() puts here

    The front holds the least recently freed blocks, so ``get_new_blocks`` evicts those first.
    A ``deque`` would not do: a prefix-cache hit must pull a block out of the middle in O(1).
    Sentinels make every real block have both neighbours, so no operation special-cases ends.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self.fake_free_list_head.next_free_block
        assert first is not None, "free queue head sentinel lost its link"
        if first is self.fake_free_list_tail:
            raise ValueError("no free blocks left")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, only {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"{block} is already in the free queue"
        )
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None, "free queue tail sentinel lost its link"
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the front: the next one handed out."""
        assert block.prev_free_block is None and block.next_free_block is None, (
            f"{block} is already in the free queue"
        )
        first = self.fake_free_list_head.next_free_block
        assert first is not None, "free queue head sentinel lost its link"
        self.fake_free_list_head.next_free_block = block
        block.prev_free_block = self.fake_free_list_head
        block.next_free_block = first
        first.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks front (next evicted) to back. O(n): for tests and checks."""
        blocks = []
        cur = self.fake_free_list_head.next_free_block
        while cur is not None and cur is not self.fake_free_list_tail:
            blocks.append(cur)
            cur = cur.next_free_block
        return blocks


class BlockPool:
    """All KV blocks of one cache: allocation, ref counting, LRU eviction, prefix-cache map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        # Block 0 pads block tables on the worker; it never holds real KV.
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # One block per hash: a second block with the same content stays uncached.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # Changes of the hash map since the last take_events(); None while events are off.
        self.kv_events: KVEventRecorder | None = None

    def enable_kv_cache_events(self, block_size: int) -> None:
        self.kv_events = KVEventRecorder(block_size)

    def take_events(self) -> list[KVCacheEvent]:
        return self.kv_events.take() if self.kv_events is not None else []

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out ``num_blocks`` fresh blocks (ref_cnt 1), evicting the least recently freed."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.get_num_free_blocks()} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"{block} was in the free queue while in use"
            # Its KV is about to be overwritten, so its old prefix must no longer be findable.
            self._evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        assert self.cached_block_hash_to_block.get(block_hash) is block, (
            f"{block} carries a hash the map does not point back to it"
        )
        del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None
        if self.kv_events is not None and not is_window_group_hash(block_hash):
            self.kv_events.removed(block_hash)
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit).

        A hit on a free cached block revives it: it leaves the free queue so it cannot be evicted.
        """
        for block in blocks:
            assert not block.is_null, "the null block cannot be touched"
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        request_block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int] = (),
        cache_salt: str | None = None,
        report: bool = True,
    ) -> None:
        """Register blocks ``[num_cached_blocks, num_full_blocks)`` of a request under its hashes.

        blocks:  | cached earlier | newly full (registered here) | partial / not yet full |
                 0        num_cached_blocks             num_full_blocks

        ``token_ids`` (the request's, at least up to ``num_full_blocks``) and ``cache_salt`` are
        read only by KV cache events, which report what each block holds; ``report`` False: no
        event (the sliding-window group's copies of blocks the events already report).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        assert num_full_blocks <= len(request_block_hashes), (
            f"{num_full_blocks} full blocks but only {len(request_block_hashes)} hashes"
        )
        assert num_full_blocks <= len(blocks), f"{num_full_blocks} full blocks but only {len(blocks)} blocks"
        registered: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            assert block.block_hash is None, f"{block} is already cached; a block is registered once"
            block_hash = request_block_hashes[i]
            if block_hash in self.cached_block_hash_to_block:
                # Same content as a block already cached (e.g. a prompt whose last block was capped
                # off the hit): keep the first mapping, this copy is never found.
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            registered.append(i)
        if self.kv_events is not None and report:
            self._record_stored(request_block_hashes, registered, token_ids, cache_salt)

    def _record_stored(
        self,
        request_block_hashes: Sequence[BlockHash],
        registered: list[int],
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        """One BlockStored per run of consecutive registered blocks: a skipped duplicate ends a
        run, so that each event's hashes chain on its parent and each hash is stored once."""
        assert self.kv_events is not None
        run_start = 0
        for k in range(1, len(registered) + 1):
            if k == len(registered) or registered[k] != registered[k - 1] + 1:
                start, end = registered[run_start], registered[k - 1] + 1
                self.kv_events.stored(request_block_hashes, start, end, token_ids, cache_salt)
                run_start = k

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; those reaching 0 join the queue tail in this order,
        except blocks without a hash, which go to the front.

        The caller passes eviction order: a request's blocks reversed, so that its tail blocks
        (the least shareable: only requests with the longest common prefix reuse them) go first.
        A block without a hash (prefix caching off, or a partial block) can never be hit, so
        nothing is lost by handing it out next: the KV cache's working set stays the few blocks
        in use, warm in the CPU's caches, where handing out the least recently freed first
        would walk the whole cache (on the CPU its pages become resident as first written: 4
        GiB of page faults and zeroing before the cycle closes).
        """
        ordered_blocks = list(ordered_blocks)
        for block in ordered_blocks:
            assert not block.is_null, "the null block is never freed"
            assert block.ref_cnt > 0, f"{block} freed more often than it was taken"
            block.ref_cnt -= 1
        for block in ordered_blocks:
            if block.ref_cnt == 0 and block.block_hash is not None:
                self.free_block_queue.append(block)
        for block in reversed(ordered_blocks):  # the first freed is handed out first
            if block.ref_cnt == 0 and block.block_hash is None:
                self.free_block_queue.appendleft(block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the cached content of these blocks (e.g. their KV failed to load).

        A block in use keeps its references; it just can no longer be found by a hit.
        """
        for block_id in block_ids:
            self._evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible when no block is in use; returns success."""
        num_used_blocks = self.num_blocks - 1 - self.get_num_free_blocks()
        if num_used_blocks != 0:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block = {}
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks in use; 0.0 when idle."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def check_integrity(self) -> None:
        """Assert every invariant of the pool. O(num_blocks): for tests and debugging."""
        queue = self.free_block_queue
        head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
        assert head.prev_free_block is None and tail.next_free_block is None, "sentinels have outer links"
        seen_ids: set[int] = set()
        prev, cur = head, head.next_free_block
        while cur is not tail:
            assert cur is not None, "free queue forward chain ends before the tail sentinel"
            assert cur.prev_free_block is prev, f"{cur}: backward link does not match forward link"
            assert not cur.is_null, "the null block is in the free queue"
            assert cur.block_id not in seen_ids, f"block {cur.block_id} appears twice in the free queue"
            assert 0 < cur.block_id < self.num_blocks and self.blocks[cur.block_id] is cur, (
                f"{cur} in the free queue is not one of this pool's blocks"
            )
            assert cur.ref_cnt == 0, f"{cur} is in the free queue with ref_cnt {cur.ref_cnt}"
            seen_ids.add(cur.block_id)
            prev, cur = cur, cur.next_free_block
        assert tail.prev_free_block is prev, "tail sentinel's backward link does not match"
        assert len(seen_ids) == queue.num_free_blocks, (
            f"free queue holds {len(seen_ids)} blocks but counts {queue.num_free_blocks}"
        )

        null = self.null_block
        assert null.is_null and null.block_id == 0, "block 0 must be the null block"
        assert null.prev_free_block is None and null.next_free_block is None, "null block linked"
        assert null.block_hash is None, "the null block is cached"
        for block in self.blocks[1:]:
            assert not block.is_null, f"{block} marked null"
            in_queue = block.block_id in seen_ids
            if not in_queue:
                assert block.ref_cnt > 0, f"{block} is neither in the free queue nor in use"
                assert block.prev_free_block is None and block.next_free_block is None, (
                    f"{block} is outside the free queue but still linked"
                )
            if block.block_hash is not None:
                assert self.cached_block_hash_to_block.get(block.block_hash) is block, (
                    f"{block} carries a hash the map does not point back to it"
                )

        for block_hash, block in self.cached_block_hash_to_block.items():
            assert self.enable_caching, "caching is off but a block hash is registered"
            assert self.blocks[block.block_id] is block and not block.is_null, (
                f"map points at foreign {block}"
            )
            assert block.block_hash == block_hash, f"map key {block_hash.hex()[:8]} points at {block}"
