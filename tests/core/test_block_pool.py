"""BlockPool, its free queue and block hashing, tested by exact block ids, ref counts and invariants."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from axon.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from axon.core.kv_cache_utils import (
    NONE_HASH,
    cdiv,
    hash_block_tokens,
    make_block_hasher,
    max_concurrency,
)
from axon.core.request import Request
from axon.sampling_params import EngineSamplingParams

BLOCK_SIZE = 4


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def make_request(req_id: str, token_ids: list[int], cache_salt: str | None = None) -> Request:
    return Request(
        req_id,
        token_ids,
        EngineSamplingParams(max_tokens=8, all_stop_token_ids=frozenset()),
        cache_salt=cache_salt,
        block_hasher=make_block_hasher(BLOCK_SIZE),
    )


# ---------------------------------------------------------------- free queue


def test_free_queue_operations() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    assert queue.num_free_blocks == 6
    assert ids(queue.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]

    assert queue.popleft() is blocks[0]
    assert ids(queue.popleft_n(2)) == [1, 2]
    assert queue.num_free_blocks == 3
    assert blocks[0].prev_free_block is None and blocks[0].next_free_block is None

    queue.remove(blocks[4])  # middle
    assert ids(queue.get_all_free_blocks()) == [3, 5]
    queue.remove(blocks[5])  # last
    queue.remove(blocks[3])  # first
    assert queue.num_free_blocks == 0 and queue.get_all_free_blocks() == []

    queue.append(blocks[2])
    queue.append_n([blocks[0], blocks[5]])
    assert ids(queue.get_all_free_blocks()) == [2, 0, 5]
    assert queue.num_free_blocks == 3
    assert queue.fake_free_list_tail.prev_free_block is blocks[5]
    assert queue.fake_free_list_head.next_free_block is blocks[2]


def test_free_queue_errors() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(1)])
    with pytest.raises(ValueError):
        queue.popleft_n(2)
    assert queue.num_free_blocks == 1
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(AssertionError):
        queue.remove(KVCacheBlock(7))
    block = KVCacheBlock(2)
    queue.append(block)
    with pytest.raises(AssertionError):
        queue.append(block)


def test_block_repr_does_not_walk_the_list() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])
    assert repr(queue.get_all_free_blocks()[1]) == "KVCacheBlock(id=1, ref_cnt=0, hash=None)"


# ---------------------------------------------------------------- pool


def test_fresh_pool_allocates_in_id_order_and_never_the_null_block() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    pool.check_integrity()
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    assert [b.ref_cnt for b in first] == [1, 1, 1]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert pool.null_block.is_null and pool.null_block.ref_cnt == 0
    pool.check_integrity()


def test_pool_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=1, enable_caching=True)


def test_not_enough_blocks_changes_nothing() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]


def test_free_appends_to_tail_in_given_order() -> None:
    pool = BlockPool(num_blocks=6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks([b"h1", b"h2", b"h3"], blocks, 0, 3)
    pool.free_blocks(reversed(blocks))
    # Untouched blocks 4, 5 first, then the freed (cached) ones in the given (reversed) order.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 5, 3, 2, 1]
    assert ids(pool.get_new_blocks(3)) == [4, 5, 3]
    pool.check_integrity()


def test_free_blocks_without_a_hash_are_handed_out_next() -> None:
    # Nothing can hit them: reusing them first keeps the cache's working set small and warm.
    pool = BlockPool(num_blocks=8, enable_caching=True)
    blocks = pool.get_new_blocks(4)  # 1, 2, 3, 4
    pool.cache_full_blocks([b"h1", b"h2"], blocks, 0, 2)
    pool.free_blocks(reversed(blocks))  # 4, 3 have no hash; 2, 1 are cached
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [4, 3, 5, 6, 7, 2, 1]
    assert ids(pool.get_new_blocks(3)) == [4, 3, 5]
    pool.check_integrity()


def test_shared_block_is_freed_only_at_zero() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    with pytest.raises(AssertionError):
        pool.free_blocks([block])
    pool.check_integrity()


def test_cache_full_blocks_registers_and_keeps_first_mapping() -> None:
    pool = BlockPool(num_blocks=8, enable_caching=True)
    h = [hash_block_tokens(None, [i]) for i in range(3)]
    blocks = pool.get_new_blocks(3)
    # Blocks 0 and 1 are full; block 2 is partial and stays uncached.
    pool.cache_full_blocks(h, blocks, num_cached_blocks=0, num_full_blocks=2)
    assert pool.get_cached_block(h[0]) is blocks[0]
    assert pool.get_cached_block(h[1]) is blocks[1]
    assert pool.get_cached_block(h[2]) is None
    assert blocks[2].block_hash is None

    # A second block with the same content as blocks[0]: the first mapping wins.
    dup = pool.get_new_blocks(1)
    pool.cache_full_blocks(h[:1], dup, num_cached_blocks=0, num_full_blocks=1)
    assert pool.get_cached_block(h[0]) is blocks[0]
    assert dup[0].block_hash is None
    pool.check_integrity()


def test_freed_cached_block_is_found_then_evicted_on_reuse() -> None:
    pool = BlockPool(num_blocks=3, enable_caching=True)
    h = [hash_block_tokens(None, [i]) for i in range(2)]
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(h, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == 2
    # Still findable while free; a hit revives it.
    assert pool.get_cached_block(h[0]) is blocks[0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.get_num_free_blocks() == 1
    pool.check_integrity()
    # Handing out block 2 (the only free one) evicts its hash.
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(h[1]) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(h[0]) is blocks[0]
    pool.check_integrity()


def test_caching_off_never_registers() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=False)
    h = [hash_block_tokens(None, [1])]
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(h, blocks, 0, 1)
    assert blocks[0].block_hash is None
    assert pool.get_cached_block(h[0]) is None
    assert pool.cached_block_hash_to_block == {}
    pool.check_integrity()


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = [hash_block_tokens(None, [1])]
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(h, blocks, 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h[0]) is None and blocks[0].block_hash is None
    pool.check_integrity()


def test_evict_blocks_forgets_content_but_keeps_references() -> None:
    pool = BlockPool(num_blocks=4, enable_caching=True)
    h = [hash_block_tokens(None, [i]) for i in range(2)]
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(h, blocks, 0, 2)
    pool.evict_blocks([blocks[1].block_id])
    assert pool.get_cached_block(h[1]) is None and blocks[1].ref_cnt == 1
    assert pool.get_cached_block(h[0]) is blocks[0]
    pool.check_integrity()


def test_usage() -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert pool.get_usage() == pytest.approx(0.5)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda pool: setattr(pool.blocks[1], "ref_cnt", 1),  # in the queue yet "in use"
        lambda pool: setattr(pool.free_block_queue, "num_free_blocks", 2),  # wrong count
        lambda pool: setattr(pool.blocks[2], "prev_free_block", pool.blocks[3]),  # broken back link
        lambda pool: pool.free_block_queue.append(pool.null_block),  # null block queued
        lambda pool: pool.cached_block_hash_to_block.__setitem__(b"x" * 32, pool.blocks[1]),  # bad key
        lambda pool: setattr(pool.blocks[3], "block_hash", b"y" * 32),  # hash not in map
        lambda pool: pool.free_block_queue.remove(pool.blocks[2]),  # neither free nor in use
    ],
)
def test_check_integrity_catches_corruption(corrupt) -> None:
    pool = BlockPool(num_blocks=5, enable_caching=True)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ---------------------------------------------------------------- hashing


def test_hash_block_tokens_is_chained_and_keyed() -> None:
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert len(h0) == 32
    assert h0 == hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert h0 != hash_block_tokens(h0, [1, 2, 3, 4])  # parent matters
    assert h0 != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))  # extra keys matter
    assert hash_block_tokens(None, [1], ("a",)) != hash_block_tokens(None, [1], ("b",))
    # Fixed-width serialisation: no collisions from regrouping tokens.
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [258])


def test_block_hasher_hashes_only_full_blocks_and_chains() -> None:
    tokens = list(range(10))
    req = make_request("a", tokens)
    assert len(req.block_hashes) == 2  # 10 tokens: 2 full blocks + 2 tokens
    h0 = hash_block_tokens(None, tokens[0:4])
    assert req.block_hashes == [h0, hash_block_tokens(h0, tokens[4:8])]

    # Same prefix, different tail: the shared full blocks hash the same.
    other = make_request("b", tokens[:8] + [99, 98, 97, 96])
    assert other.block_hashes[:2] == req.block_hashes
    assert len(other.block_hashes) == 3

    # A different first block changes every later hash (the chain).
    diverged = make_request("c", [7] + tokens[1:8])
    assert diverged.block_hashes[0] != req.block_hashes[0]
    assert diverged.block_hashes[1] != req.block_hashes[1]


def test_block_hasher_extends_as_tokens_arrive() -> None:
    req = make_request("a", list(range(6)))
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(6)
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7, 8])
    assert len(req.block_hashes) == 2
    assert req.block_hashes == make_request("b", list(range(9))).block_hashes


def test_cache_salt_changes_every_hash() -> None:
    tokens = list(range(8))
    plain = make_request("a", tokens)
    salted = make_request("b", tokens, cache_salt="tenant-1")
    salted_again = make_request("c", tokens, cache_salt="tenant-1")
    other_salt = make_request("d", tokens, cache_salt="tenant-2")
    assert salted.block_hashes == salted_again.block_hashes
    for i in range(2):
        assert len({plain.block_hashes[i], salted.block_hashes[i], other_salt.block_hashes[i]}) == 3


def test_hashes_are_deterministic_across_processes() -> None:
    code = (
        "from axon.core.kv_cache_utils import hash_block_tokens as h;"
        "print(h(h(None, [1, 2, 3], ('s',)), [4, 5]).hex())"
    )
    expected = hash_block_tokens(hash_block_tokens(None, [1, 2, 3], ("s",)), [4, 5]).hex()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": root}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == expected


def test_block_hasher_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        make_block_hasher(0)


def test_cdiv_and_max_concurrency() -> None:
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    # 17 blocks: 16 usable; 64 tokens / 16 per block = 4 blocks per request.
    assert max_concurrency(num_blocks=17, block_size=16, max_model_len=64) == 4
    assert max_concurrency(num_blocks=17, block_size=16, max_model_len=65) == 3
    assert max_concurrency(num_blocks=2, block_size=16, max_model_len=64) == 0
