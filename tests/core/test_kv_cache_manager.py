"""KVCacheManager on a fake geometry: exact block ids, ref counts, and invariants after random ops."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from axon.core.block_pool import KVCacheBlock
from axon.core.kv_cache_manager import KVCacheManager
from axon.core.kv_cache_utils import make_block_hasher, window_group_hash
from axon.core.request import Request
from axon.sampling_params import EngineSamplingParams

BLOCK_SIZE = 4
HASHER = make_block_hasher(BLOCK_SIZE)


def make_request(
    req_id: str, token_ids: list[int], cache_salt: str | None = None, prompt_logprobs: int | None = None
) -> Request:
    params = EngineSamplingParams(
        max_tokens=64, all_stop_token_ids=frozenset(), prompt_logprobs=prompt_logprobs
    )
    return Request(req_id, token_ids, params, cache_salt=cache_salt, block_hasher=HASHER)


def make_manager(
    num_blocks: int = 11, enable_caching: bool = True, max_model_len: int = 64
) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, max_model_len, enable_caching)


def ids(blocks: list[KVCacheBlock] | None) -> list[int]:
    assert blocks is not None
    return [block.block_id for block in blocks]


def schedule(
    manager: KVCacheManager, req: Request, num_new_tokens: int | None = None
) -> list[KVCacheBlock] | None:
    """Look up the prefix cache, allocate the rest of the prompt (or a chunk), and 'compute' it."""
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(req, num_new_tokens, num_hit_tokens, hits)
    if new_blocks is not None:
        req.num_computed_tokens += num_hit_tokens + num_new_tokens
    return new_blocks


def snapshot(manager: KVCacheManager) -> tuple:
    pool = manager.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        ids(pool.free_block_queue.get_all_free_blocks()),
        dict(pool.cached_block_hash_to_block),
        {req_id: ids(blocks) for req_id, blocks in manager.req_to_blocks.items()},
        dict(manager.num_cached_block),
    )


# ---------------------------------------------------------------- exact scenarios


def test_allocate_prompt_and_decode() -> None:
    manager = make_manager()
    req = make_request("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert ids(schedule(manager, req)) == [1, 2, 3]
    assert manager.get_block_ids("a") == [1, 2, 3] and manager.get_num_blocks("a") == 3
    # The two full blocks are cached; the partial one is not.
    assert manager.num_cached_block["a"] == 2
    assert manager.block_pool.blocks[3].block_hash is None

    # Decode: tokens 10, 11 fit in block 3; token 12 needs block 4.
    for token in (10, 11):
        req.append_output_token_ids(token)
        assert manager.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    assert manager.block_pool.blocks[3].block_hash == req.block_hashes[2]  # full now, registered
    req.append_output_token_ids(12)
    assert ids(manager.allocate_slots(req, 1)) == [4]
    manager.check_integrity()
    assert manager.usage == pytest.approx(0.4)
    assert manager.num_free_blocks == 6

    manager.free(req)
    assert manager.usage == 0.0
    assert manager.get_block_ids("a") == []
    manager.check_integrity()


def test_prefix_hit_returns_same_blocks_and_bumps_ref_counts() -> None:
    manager = make_manager()
    a = make_request("a", list(range(10)))
    schedule(manager, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_hit_tokens == 8
    assert [blk.block_hash for blk in hits] == b.block_hashes[:2]
    assert [blk.ref_cnt for blk in hits] == [1, 1]  # lookup alone takes no reference
    assert ids(manager.allocate_slots(b, 3, num_hit_tokens, hits)) == [4]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    manager.check_integrity()

    manager.free(a)
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    manager.free(b)
    assert manager.usage == 0.0
    manager.check_integrity()


def test_hit_is_capped_to_leave_one_token() -> None:
    manager = make_manager()
    schedule(manager, make_request("a", list(range(12))))
    # Exactly 2 blocks long: the last token's logits are needed, so only block 0 may hit.
    b = make_request("b", list(range(8)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1] and num_hit_tokens == 4
    # One more token: both full blocks may hit.
    c = make_request("c", list(range(9)))
    assert manager.get_computed_blocks(c)[1] == 8
    # The recomputed copy of block 1 is a duplicate: it stays uncached, the first mapping wins.
    assert ids(manager.allocate_slots(b, 4, num_hit_tokens, hits)) == [4]
    assert manager.block_pool.get_cached_block(b.block_hashes[1]).block_id == 2
    assert manager.block_pool.blocks[4].block_hash is None
    manager.check_integrity()


def test_same_step_hit_on_blocks_allocated_but_not_yet_computed() -> None:
    manager = make_manager()
    a = make_request("a", list(range(9)))
    assert ids(manager.allocate_slots(a, 9)) == [1, 2, 3]  # a.num_computed_tokens still 0
    b = make_request("b", list(range(9)))
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_hit_tokens == 8


def test_freed_cached_blocks_stay_findable_and_are_evicted_tail_first() -> None:
    manager = make_manager(num_blocks=6)  # 5 usable blocks
    a = make_request("a", list(range(12)))  # blocks 1, 2, 3, all full
    schedule(manager, a)
    manager.free(a)
    pool = manager.block_pool
    # Never-used blocks first, then a's blocks tail first.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1]
    b = make_request("b", list(range(13)))
    assert ids(manager.get_computed_blocks(b)[0]) == [1, 2, 3]

    # A 3-block request with a different prefix takes 4, 5 and then evicts a's tail block 3.
    c = make_request("c", [100 + i for i in range(12)])
    assert ids(schedule(manager, c)) == [4, 5, 3]
    assert pool.get_cached_block(a.block_hashes[2]) is None
    hits, _ = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2]  # a's head blocks survive
    manager.check_integrity()


def test_hit_on_free_cached_blocks_is_not_counted_as_free() -> None:
    manager = make_manager(num_blocks=4)  # 3 usable blocks
    a = make_request("a", list(range(8)))
    schedule(manager, a)  # blocks 1, 2
    manager.free(a)  # all 3 free; 1 and 2 cached
    b = make_request("b", list(range(8)) + [9, 9, 9, 9, 9])  # 13 tokens: 4 blocks, 2 of them hits
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert ids(hits) == [1, 2]
    # Needs 2 fresh blocks; 3 are free but 2 of those are the hit blocks themselves.
    before = snapshot(manager)
    assert manager.allocate_slots(b, 5, num_hit_tokens, hits) is None
    assert snapshot(manager) == before
    # 4 tokens past the hits need 1 fresh block: fits.
    assert ids(manager.allocate_slots(b, 4, num_hit_tokens, hits)) == [3]
    manager.check_integrity()


def test_failed_allocation_changes_nothing() -> None:
    manager = make_manager(num_blocks=6)
    a = make_request("a", list(range(10)))
    schedule(manager, a)
    manager.free(a)
    b = make_request("b", list(range(4)) + [7] * 20)  # 6 blocks; 4 missing, 3 free
    schedule(manager, b, num_new_tokens=4)
    manager.check_integrity()
    before = snapshot(manager)
    stats_before = manager.prefix_cache_stats
    c = make_request("c", list(range(8)) + [5] * 20)  # hits a's blocks 1, 2; needs 7 blocks
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert ids(hits) == [1, 2]
    assert manager.allocate_slots(c, c.num_tokens - num_hit_tokens, num_hit_tokens, hits) is None
    assert manager.allocate_slots(b, b.num_tokens - b.num_computed_tokens) is None
    assert snapshot(manager) == before
    assert "c" not in manager.req_to_blocks
    assert manager.prefix_cache_stats is stats_before
    manager.check_integrity()


def test_usage_returns_to_zero() -> None:
    manager = make_manager()
    reqs = [make_request(str(i), list(range(i, i + 7))) for i in range(4)]
    for req in reqs:
        schedule(manager, req)
    assert manager.usage > 0
    for req in reqs:
        manager.free(req)
    assert manager.usage == 0.0
    assert manager.num_free_blocks == 10
    manager.check_integrity()


def test_caching_off_never_hits() -> None:
    manager = make_manager(enable_caching=False)
    a = make_request("a", list(range(9)))
    schedule(manager, a)
    b = make_request("b", list(range(9)))
    assert manager.get_computed_blocks(b) == ([], 0)
    assert ids(schedule(manager, b)) == [4, 5, 6]
    assert manager.block_pool.cached_block_hash_to_block == {}
    stats = manager.make_prefix_cache_stats()
    assert (stats.queries, stats.hits) == (0, 0)
    manager.check_integrity()


def test_salts_never_share_blocks() -> None:
    manager = make_manager()
    schedule(manager, make_request("a", list(range(9)), cache_salt="x"))
    assert manager.get_computed_blocks(make_request("b", list(range(9)), cache_salt="y")) == ([], 0)
    assert manager.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)
    assert manager.get_computed_blocks(make_request("d", list(range(9)), cache_salt="x"))[1] == 8


def test_prompt_logprobs_skip_the_cache() -> None:
    manager = make_manager()
    schedule(manager, make_request("a", list(range(9))))
    assert manager.get_computed_blocks(make_request("b", list(range(9)), prompt_logprobs=1)) == ([], 0)


def test_prefix_cache_stats() -> None:
    manager = make_manager()
    schedule(manager, make_request("a", list(range(9))))  # 9 queried, 0 hit
    schedule(manager, make_request("b", list(range(10))))  # 10 queried, 8 hit
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 19, 8)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (0, 0, 0)


def test_preempt_and_resume_hits_own_blocks() -> None:
    manager = make_manager()
    req = make_request("a", list(range(10)))
    schedule(manager, req)
    for token in range(10, 14):
        req.append_output_token_ids(token)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    manager.free(req)  # preempted
    req.num_computed_tokens = 0
    # 14 tokens, 3 full blocks (the last full block holds generated tokens); all 3 may hit.
    hits, num_hit_tokens = manager.get_computed_blocks(req)
    assert ids(hits) == [1, 2, 3] and num_hit_tokens == 12
    # Its own partial block 4: freed without a hash, so handed out next.
    assert ids(manager.allocate_slots(req, 2, num_hit_tokens, hits)) == [4]
    manager.check_integrity()


def test_max_model_len_is_asserted() -> None:
    manager = make_manager(max_model_len=8)
    req = make_request("a", list(range(9)))
    with pytest.raises(AssertionError, match="max_model_len"):
        manager.allocate_slots(req, 9)


def test_manager_check_integrity_catches_lost_reference() -> None:
    manager = make_manager()
    schedule(manager, make_request("a", list(range(9))))
    manager.req_to_blocks["a"].pop()
    with pytest.raises(AssertionError, match="references"):
        manager.check_integrity()


def test_a_window_group_frees_what_no_query_reads_and_hits_need_the_window() -> None:
    """Window 8, blocks of 4: once 20 tokens are computed, queries read keys 13.. only, so the
    window group's blocks 0-2 are freed (null entries); a hit needs the window group's blocks of
    its window, and shrinks to the longest prefix whose window is still cached."""
    manager = KVCacheManager(40, BLOCK_SIZE, 64, enable_caching=True, window=8)
    a = make_request("a", list(range(24)))
    assert schedule(manager, a, 20) is not None  # 5 blocks in each group
    assert manager.get_num_blocks("a") == manager.get_num_window_blocks("a") == 5
    assert manager.allocate_slots(a, 4) is not None  # tokens 20..23: keys from 13 on
    a.num_computed_tokens += 4
    window_ids = manager.get_window_block_ids("a")
    assert window_ids[:3] == [0, 0, 0] and all(window_ids[3:]) and len(window_ids) == 6
    assert set(window_ids[3:]).isdisjoint(manager.get_block_ids("a"))
    manager.check_integrity()
    freed_window_block = manager.block_pool.blocks[manager.req_to_window_blocks["a"][3].block_id]
    manager.free(a)
    manager.check_integrity()
    assert manager.usage == 0.0

    # The same 24 tokens and more: the hit may cover 6 blocks (24 tokens), whose window starts
    # in block 4 (keys 17..): the window group still caches blocks 3-5.
    b = make_request("b", list(range(24)) + [99, 98])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 24
    # Without window block 3 (evicted), a hit of 6 blocks still works (it reads from block 4),
    # one of 5 (reading from block 3) would not.
    manager.block_pool.evict_blocks([freed_window_block.block_id])
    hits, num_hit_tokens = manager.get_computed_blocks(b)
    assert num_hit_tokens == 24
    c = make_request("c", list(range(21)))  # at most 5 blocks: its window reads block 3
    hits, num_hit_tokens = manager.get_computed_blocks(c)
    assert num_hit_tokens == 12  # 3 blocks: the window of 12 reads blocks 1-2, still cached
    assert manager.allocate_slots(c, 9, num_hit_tokens, hits) is not None
    window_ids = manager.get_window_block_ids("c")
    assert window_ids[0] == 0 and all(window_ids[1:])  # block 0 is out of the hit's window
    manager.check_integrity()


# ---------------------------------------------------------------- randomized


class Simulator:
    """A toy scheduler over a real KVCacheManager, with a shadow of what each block holds.

    ``content[block_id]`` is the hash of the prefix whose KV the fake worker wrote there; a hit
    must return blocks whose content is exactly the request's hashes. With a ``window`` the
    manager keeps a window group too: every block a step's queries read or write must be held
    (not the null block, not shared while written), and a hit's window blocks hold its prefix.
    """

    def __init__(
        self, rng: random.Random, num_blocks: int = 24, max_model_len: int = 48, window: int | None = None
    ) -> None:
        self.rng = rng
        self.max_model_len = max_model_len
        self.window = window
        self.manager = KVCacheManager(
            num_blocks, BLOCK_SIZE, max_model_len, enable_caching=True, window=window
        )
        self.prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 16))] for _ in range(4)]
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.content: dict[int, bytes] = {}
        self.next_id = 0
        self.num_hits = 0

    def new_request(self) -> None:
        prefix = self.rng.choice(self.prefixes)
        suffix = [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 12))]
        salt = self.rng.choice([None, None, None, "s"])
        self.waiting.append(make_request(f"r{self.next_id}", (prefix + suffix) or [1], cache_salt=salt))
        self.next_id += 1

    def admit(self) -> None:
        if not self.waiting:
            return
        req = self.waiting.pop(self.rng.randrange(len(self.waiting)))
        hits, num_hit_tokens = self.manager.get_computed_blocks(req)
        assert num_hit_tokens == len(hits) * BLOCK_SIZE < req.num_tokens
        for i, block in enumerate(hits):
            assert block.block_hash == req.block_hashes[i]
            assert self.content[block.block_id] == req.block_hashes[i], "hit on overwritten KV"
        self.num_hits += len(hits)
        remaining = req.num_tokens - num_hit_tokens
        chunk = self.rng.randint(1, remaining)
        if self.manager.allocate_slots(req, chunk, num_hit_tokens, hits) is None:
            self.waiting.append(req)
            return
        self.running.append(req)
        if self.window is not None and hits:
            window_blocks = self.manager.req_to_window_blocks[req.req_id]
            for i in range(self.manager.first_window_block(num_hit_tokens), len(hits)):
                assert self.content[window_blocks[i].block_id] == window_group_hash(req.block_hashes[i])
        self.compute(req, num_hit_tokens, chunk)

    def compute(self, req: Request, num_hit_tokens: int, num_new_tokens: int) -> None:
        """The fake worker writes KV for the new tokens; record which full blocks now hold what."""
        blocks = self.manager.req_to_blocks[req.req_id]
        start = req.num_computed_tokens + num_hit_tokens
        end = start + num_new_tokens
        assert len(blocks) * BLOCK_SIZE >= end, "allocated blocks do not cover the step's tokens"
        for block_idx in range(start // BLOCK_SIZE, end // BLOCK_SIZE):
            block = blocks[block_idx]
            assert block.ref_cnt == 1, f"writing into shared {block}"
            self.content[block.block_id] = req.block_hashes[block_idx]
        for block_idx in range(end // BLOCK_SIZE, len(blocks)):
            self.content.pop(blocks[block_idx].block_id, None)  # partial or empty: not a full prefix
        if self.window is not None:
            window_blocks = self.manager.req_to_window_blocks[req.req_id]
            assert len(window_blocks) == len(blocks)
            # Keys start - window + 1 .. end - 1 are read: their blocks are held.
            for block_idx in range(self.manager.first_window_block(start), len(window_blocks)):
                assert not window_blocks[block_idx].is_null, f"window block {block_idx} read but freed"
            for block_idx in range(start // BLOCK_SIZE, end // BLOCK_SIZE):
                block = window_blocks[block_idx]
                assert block.ref_cnt == 1, f"writing into shared {block}"
                self.content[block.block_id] = window_group_hash(req.block_hashes[block_idx])
            for block_idx in range(end // BLOCK_SIZE, len(window_blocks)):
                self.content.pop(window_blocks[block_idx].block_id, None)
        req.num_computed_tokens = end
        if end == req.num_tokens:
            req.append_output_token_ids(self.rng.randrange(50))  # sampled; its KV comes next step

    def step(self) -> None:
        if not self.running:
            return
        req = self.rng.choice(self.running)
        remaining = req.num_tokens - req.num_computed_tokens
        if req.num_computed_tokens + remaining > self.max_model_len:
            self.finish(req)
            return
        chunk = self.rng.randint(1, remaining)
        if self.manager.allocate_slots(req, chunk) is None:
            self.preempt(req)
            return
        self.compute(req, 0, chunk)

    def finish(self, req: Request | None = None) -> None:
        if not self.running:
            return
        req = req or self.rng.choice(self.running)
        self.running.remove(req)
        self.manager.free(req)

    def preempt(self, req: Request | None = None) -> None:
        if not self.running:
            return
        req = req or self.rng.choice(self.running)
        self.finish(req)
        req.num_computed_tokens = 0
        if req.num_tokens < self.max_model_len:
            self.waiting.append(req)

    def reset(self) -> None:
        if self.manager.reset_prefix_cache():
            assert not self.running
            assert self.manager.block_pool.cached_block_hash_to_block == {}

    def check(self) -> None:
        self.manager.check_integrity()
        for req in self.running:
            assert self.manager.get_num_blocks(req.req_id) >= self.manager.num_blocks_needed(
                req.num_computed_tokens
            )

    def random_op(self) -> None:
        op = self.rng.choices(
            [self.new_request, self.admit, self.step, self.finish, self.preempt, self.reset],
            weights=[3, 4, 10, 2, 1, 0.1],
        )[0]
        op()


@pytest.mark.parametrize("window", [None, 5, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_invariants(seed: int, window: int | None) -> None:
    sim = Simulator(random.Random(seed), window=window)
    for _ in range(3000):
        sim.random_op()
        sim.check()
    assert sim.num_hits > 0, "the workload should exercise prefix hits"
    for req in list(sim.running):
        sim.finish(req)
    sim.check()
    assert sim.manager.usage == 0.0


class KVCacheMachine(RuleBasedStateMachine):
    """Hypothesis picks the geometry, the workload seed and the order of operations."""

    @initialize(
        seed=st.integers(0, 2**16), num_blocks=st.integers(2, 12), window=st.sampled_from([None, 3, 8])
    )
    def start(self, seed: int, num_blocks: int, window: int | None) -> None:
        self.sim = Simulator(random.Random(seed), num_blocks=num_blocks, max_model_len=32, window=window)

    @rule()
    def new_request(self) -> None:
        self.sim.new_request()

    @rule()
    def admit(self) -> None:
        self.sim.admit()

    @rule()
    def step(self) -> None:
        self.sim.step()

    @rule()
    def finish(self) -> None:
        self.sim.finish()

    @rule()
    def preempt(self) -> None:
        self.sim.preempt()

    @rule()
    def reset(self) -> None:
        self.sim.reset()

    @invariant()
    def integrity(self) -> None:
        # Invariants also run before initialize; nothing to check then.
        if hasattr(self, "sim"):
            self.sim.check()


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
