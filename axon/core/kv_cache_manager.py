"""KVCacheManager: which blocks each request holds, prefix-cache lookups, slot allocation.

Pure Python, no torch. The scheduler asks two questions per request and step:

1. ``get_computed_blocks(request)`` (once, when a waiting request is first scheduled or resumed):
   which leading blocks of its prompt are already in the cache?
2. ``allocate_slots(request, num_new_tokens, ...)``: make room for this step's tokens, or say
   ``None`` (with nothing changed) so the scheduler can preempt or wait.

A request's blocks cover its token regions like this (vLLM V1's layout):

    ----------------------------------------------------------------
    | < computed > | < new computed > |      < new >      |  ...   |
    ----------------------------------------------------------------
    |          < required: num_computed + num_new_computed + num_new tokens >
    ------------------------------------------------------------
    |                 < full blocks, cached >          | partial |
    ----------------------------------------------------
                   | < newly cached this step >  |

    computed:      KV already in the cache from earlier steps (request.num_computed_tokens)
    new computed:  prefix-cache hits found this step (touched, not recomputed)
    new:           tokens the worker computes this step

With a sliding window (``window``: a model whose layers are partly sliding-window, GPT-OSS) a
request holds blocks in two groups of the one pool, vLLM's hybrid KV cache manager: the full
group for the full-attention layers, as above, and the window group for the sliding layers
(the worker's caches pair one full layer with one sliding layer per tensor, so a block id is
used by one group at a time). Both are indexed the same way (block i: tokens i * block_size ..),
but once the request has computed c tokens, no query reads a key before c - window + 1, so the
window group's blocks wholly before it go back to the pool and their entries become the null
block: a long conversation holds about window / block_size blocks for its sliding layers.

    full group:    | b0 | b1 | b2 | b3 | b4 | b5 |
    window group:  |null|null|null| w3 | w4 | w5 |   (c - window + 1 falls in block 3)

A prefix-cache hit of h blocks needs the full group's blocks 0..h-1 and the window group's
blocks from the one holding h * block_size - window + 1 (a window group block is cached under
its tagged hash, ``window_group_hash``); the longest h with both is the hit.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from axon.config import blocks_per_seq
from axon.core.block_pool import BlockPool, KVCacheBlock
from axon.core.kv_cache_utils import BlockHash, cdiv, window_group_hash
from axon.core.request import Request
from axon.kv_transfer.kv_events import KVCacheEvent

logger = logging.getLogger(__name__)


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats`` (tokens, not blocks)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class _WindowHashes(Sequence[BlockHash]):
    """A request's block hashes, tagged for the window group (computed per index: a long
    request's list is not copied every step)."""

    def __init__(self, hashes: Sequence[BlockHash]) -> None:
        self.hashes = hashes

    def __len__(self) -> int:
        return len(self.hashes)

    def __getitem__(self, i):  # type: ignore[override]
        assert isinstance(i, int), "window hashes are read one index at a time"
        return window_group_hash(self.hashes[i])


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # req_id -> its blocks in token order; block i holds tokens [i * block_size, (i+1) * block_size).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # req_id -> how many leading blocks have been through cache_full_blocks (registered, or
        # skipped as duplicates); blocks past it are not yet full.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        if window is not None and window <= 0:
            raise ValueError(f"a sliding window must be positive, got {window}")
        # The window group (module docstring); None: one group.
        self.window = window
        self.req_to_window_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_window_block: dict[str, int] = {}

    def first_window_block(self, num_computed_tokens: int) -> int:
        """The first block of the window group that a query at position ``num_computed_tokens``
        (or later) reads."""
        assert self.window is not None
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def max_blocks_per_seq(self, max_num_batched_tokens: int, num_tokens: int | None = None) -> int:
        """The most blocks one request of ``num_tokens`` tokens (default ``max_model_len``)
        holds (``blocks_per_seq``)."""
        length = self.max_model_len if num_tokens is None else num_tokens
        return blocks_per_seq(length, self.block_size, self.window, max_num_batched_tokens)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's full blocks, and its length in tokens.

        Never the whole sequence: at least one token is left to compute, because the last
        token's logits are needed to sample. A prompt of exactly 2 blocks hits at most 1.
        The blocks are not yet referenced; ``allocate_slots`` touches them.
        """
        # Prompt logprobs need logits at every prompt position, and a pooling request (MEAN,
        # MAX) the hidden state of every prompt token: a hit would skip them.
        if not self.enable_caching or request.is_pooling or request.wants_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        computed_blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                # Hashes are chained: past the first miss no block can belong to this prefix.
                break
            computed_blocks.append(block)
        if self.window is not None:
            # The longest hit whose window the window group holds too.
            while computed_blocks and not self._window_hits(request, len(computed_blocks)):
                computed_blocks.pop()
        num_computed_tokens = len(computed_blocks) * self.block_size
        self.prefix_cache_stats.requests += 1
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_computed_tokens
        return computed_blocks, num_computed_tokens

    def _window_hits(self, request: Request, num_hit_blocks: int) -> list[KVCacheBlock] | None:
        """The window group's cached blocks a hit of ``num_hit_blocks`` blocks needs (from
        ``first_window_block`` of its end), or None if one is missing."""
        hits = []
        for i in range(self.first_window_block(num_hit_blocks * self.block_size), num_hit_blocks):
            block = self.block_pool.get_cached_block(window_group_hash(request.block_hashes[i]))
            if block is None:
                return None
            hits.append(block)
        return hits

    def _free_out_of_window(self, request: Request) -> None:
        """Return the window group's blocks that no query of the request reads any more."""
        blocks = self.req_to_window_blocks.get(request.req_id)
        if not blocks:
            return
        end = min(self.first_window_block(request.num_computed_tokens), len(blocks))
        freed = [b for b in blocks[:end] if not b.is_null]
        if freed:
            for i in range(end):
                blocks[i] = self.block_pool.null_block
            self.block_pool.free_blocks(reversed(freed))

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Give the request blocks for all tokens up to the end of this step, and for
        ``num_lookahead_tokens`` more (the KV a draft model writes for its drafts).

        Returns the newly allocated fresh blocks (not the hit blocks), or ``None`` with nothing
        changed if the free pool cannot supply them. Free cached blocks count as free, except
        the hit blocks themselves: touching them takes them out of the free queue.
        """
        assert num_new_tokens >= 0, f"num_new_tokens must be >= 0, got {num_new_tokens}"
        new_computed_blocks = new_computed_blocks or []
        assert self.enable_caching or not new_computed_blocks, "prefix-cache hits with caching off"
        assert len(new_computed_blocks) * self.block_size <= num_new_computed_tokens, (
            f"{len(new_computed_blocks)} hit blocks but only {num_new_computed_tokens} new computed tokens"
        )
        req_id = request.req_id
        req_blocks = self.req_to_blocks.get(req_id, [])
        if new_computed_blocks:
            # Hits continue the request's fully computed blocks, block index for block index.
            assert request.num_computed_tokens == len(req_blocks) * self.block_size, (
                f"request {req_id}: hits must follow whole computed blocks, have "
                f"{len(req_blocks)} blocks for {request.num_computed_tokens} computed tokens"
            )

        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_tokens = num_computed_tokens + num_new_tokens
        assert num_required_tokens + num_lookahead_tokens <= self.max_model_len, (
            f"request {req_id}: {num_required_tokens} + {num_lookahead_tokens} lookahead tokens "
            f"exceed max_model_len {self.max_model_len}"
        )
        num_required_blocks = self.num_blocks_needed(num_required_tokens + num_lookahead_tokens)
        num_new_blocks = max(num_required_blocks - len(req_blocks) - len(new_computed_blocks), 0)
        hit_blocks = list(new_computed_blocks)
        window_entries: list[KVCacheBlock] = []  # the window group's hits, after nulls before its window
        num_new_window_blocks = 0
        if self.window is not None:
            self._free_out_of_window(request)
            window_blocks = self.req_to_window_blocks.get(req_id, [])
            if new_computed_blocks:
                num_hit = len(req_blocks) + len(new_computed_blocks)
                hits = self._window_hits(request, num_hit)
                assert hits is not None, (
                    f"request {req_id}: get_computed_blocks gave a hit without its window"
                )
                window_entries = [self.block_pool.null_block] * (
                    num_hit - len(hits) - len(window_blocks)
                ) + hits
                hit_blocks += hits
            num_new_window_blocks = max(num_required_blocks - len(window_blocks) - len(window_entries), 0)
        # Free hit blocks sit in the free queue now but leave it when touched.
        num_evictable_hit_blocks = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        num_free = self.block_pool.get_num_free_blocks() - num_evictable_hit_blocks
        if num_new_blocks + num_new_window_blocks > num_free:
            return None

        # Touch before allocating, so that get_new_blocks cannot evict a hit block.
        self.block_pool.touch(hit_blocks)
        req_blocks = self.req_to_blocks.setdefault(req_id, req_blocks)
        req_blocks.extend(new_computed_blocks)
        if new_computed_blocks:
            # Hit blocks are cached already; registration resumes after them.
            self.num_cached_block[req_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        if self.window is not None:
            window_blocks = self.req_to_window_blocks.setdefault(req_id, [])
            window_blocks.extend(window_entries)
            if window_entries:
                self.num_cached_window_block[req_id] = len(window_blocks)
            if num_new_window_blocks > 0:
                window_blocks.extend(self.block_pool.get_new_blocks(num_new_window_blocks))

        if not delay_cache_blocks:  # a KV connector's load caches them once it has ended
            self._cache_blocks(request, num_required_tokens)
        return new_blocks

    def _cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every block that is full once ``num_tokens`` tokens are computed.

        Done at allocation, before the worker computes them, as vLLM V1 does: the worker writes a
        step's KV before any attention reads it, so a request scheduled later in the same step
        may already hit these blocks. Speculative tokens have no hash, so are never cached.
        """
        if not self.enable_caching:
            return
        req_id = request.req_id
        num_cached_blocks = self.num_cached_block.get(req_id, 0)
        num_full_blocks = min(num_tokens // self.block_size, len(request.block_hashes))
        if num_full_blocks <= num_cached_blocks:
            return
        self.block_pool.cache_full_blocks(
            request.block_hashes,
            self.req_to_blocks[req_id],
            num_cached_blocks,
            num_full_blocks,
            request.all_token_ids,
            request.cache_salt,
        )
        self.num_cached_block[req_id] = num_full_blocks
        if self.window is not None:
            num_cached_window = self.num_cached_window_block.get(req_id, 0)
            if num_full_blocks > num_cached_window:
                self.block_pool.cache_full_blocks(
                    _WindowHashes(request.block_hashes),
                    self.req_to_window_blocks[req_id],
                    num_cached_window,
                    num_full_blocks,
                    report=False,
                )
                self.num_cached_window_block[req_id] = num_full_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_tokens`` tokens are computed
        (after a KV connector loaded them: ``allocate_slots(..., delay_cache_blocks=True)``)."""
        self._cache_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so its least shared blocks are evicted first."""
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self.num_cached_block.pop(request.req_id, None)
        self.block_pool.free_blocks(reversed(blocks))
        window_blocks = self.req_to_window_blocks.pop(request.req_id, [])
        self.num_cached_window_block.pop(request.req_id, None)
        self.block_pool.free_blocks(b for b in reversed(window_blocks) if not b.is_null)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Release the request's blocks past its first ``num_tokens`` tokens (rejected drafts'
        and unused lookahead slots). Such blocks never hold a full block of computed tokens, so
        none of them is in the prefix cache."""
        blocks = self.req_to_blocks.get(request.req_id)
        keep = self.num_blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return
        assert self.num_cached_block.get(request.req_id, 0) <= keep, (
            f"request {request.req_id}: trimming cached blocks ({keep} kept)"
        )
        tail = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(tail))
        window_blocks = self.req_to_window_blocks.get(request.req_id, [])
        if len(window_blocks) > keep:
            tail = [b for b in window_blocks[keep:] if not b.is_null]
            del window_blocks[keep:]
            self.block_pool.free_blocks(reversed(tail))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def enable_kv_cache_events(self) -> None:
        """Record every change of the prefix cache, for ``take_events`` (KV-aware routers)."""
        if not self.enable_caching:
            logger.warning(
                "KV cache events are on but prefix caching is off: no block will be reported stored"
            )
        self.block_pool.enable_kv_cache_events(self.block_size)

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix-cache changes since the last call, in order (none while events are off)."""
        return self.block_pool.take_events()

    def get_block_ids(self, req_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(req_id, [])]

    def get_num_blocks(self, req_id: str) -> int:
        return len(self.req_to_blocks.get(req_id, []))

    def get_window_block_ids(self, req_id: str) -> list[int]:
        """The window group's block ids (0, the null block, for those out of the window); empty
        without a window group."""
        return [block.block_id for block in self.req_to_window_blocks.get(req_id, [])]

    def get_num_window_blocks(self, req_id: str) -> int:
        return len(self.req_to_window_blocks.get(req_id, []))

    def check_integrity(self) -> None:
        """Assert the pool's invariants and that request references account for every ref_cnt."""
        self.block_pool.check_integrity()
        num_refs = 0
        for req_id, blocks in self.req_to_blocks.items():
            ids = [block.block_id for block in blocks]
            assert len(set(ids)) == len(ids), f"request {req_id} holds a block twice: {ids}"
            assert all(not block.is_null for block in blocks), f"request {req_id} holds the null block"
            assert self.num_cached_block.get(req_id, 0) <= len(blocks), (
                f"request {req_id}: {self.num_cached_block.get(req_id)} cached of {len(blocks)} blocks"
            )
            num_refs += len(blocks)
            window_blocks = self.req_to_window_blocks.get(req_id, [])
            held = [block for block in window_blocks if not block.is_null]
            assert not set(ids) & {b.block_id for b in held}, f"request {req_id} holds a block in both groups"
            assert len({b.block_id for b in held}) == len(held), (
                f"request {req_id} holds a window block twice"
            )
            if self.window is not None and window_blocks:
                assert len(window_blocks) == len(blocks), (
                    f"request {req_id}: {len(window_blocks)} window entries for {len(blocks)} blocks"
                )
                # Nulls only before the window: every entry a query still reads is a real block.
                first_held = next(
                    (i for i, b in enumerate(window_blocks) if not b.is_null), len(window_blocks)
                )
                assert all(not b.is_null for b in window_blocks[first_held:]), (
                    f"request {req_id}: a null window entry after a held one"
                )
            num_refs += len(held)
        assert set(self.num_cached_block) <= set(self.req_to_blocks), "num_cached_block has freed requests"
        assert set(self.req_to_window_blocks) <= set(self.req_to_blocks), "window blocks of freed requests"
        total_ref_cnt = sum(block.ref_cnt for block in self.block_pool.blocks if not block.is_null)
        assert num_refs == total_ref_cnt, (
            f"requests hold {num_refs} references but ref_cnts sum to {total_ref_cnt}"
        )
