"""Block hashing and KV-cache arithmetic shared by the block pool and the KV cache manager.

Pure Python, no torch. A block hash identifies the *whole prefix* ending at that block, not just
the block's own tokens: each hash is chained on its parent's, so two requests share block ``i``
only if they agree on every token of blocks ``0..i`` (and on the extra keys, such as the cache
salt, that were mixed into block 0).

    tokens:  | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 |        (block_size = 4)
    hashes:    h0 = H(NONE_HASH, t0..t3, salt)
               h1 = H(h0,        t4..t7)
               (t8 t9: partial block, never hashed until it is full)

Hashes are SHA-256 over a fixed byte serialisation, so they are equal across processes and runs
(Python's ``hash()`` is salted per process and would not be).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from axon.core.request import Request

BlockHash = bytes

# The parent of a request's first block. Fixed, so that hashes agree across processes.
NONE_HASH: BlockHash = hashlib.sha256(b"axon").digest()


# The sliding-window KV group's blocks are cached under their hash tagged with this byte: the
# same prefix has one block in each group (the window group's copy for the windowed layers).
WINDOW_GROUP_TAG = b"W"


def window_group_hash(block_hash: BlockHash) -> BlockHash:
    return WINDOW_GROUP_TAG + block_hash


def is_window_group_hash(block_hash: BlockHash) -> bool:
    return len(block_hash) == len(NONE_HASH) + 1 and block_hash[:1] == WINDOW_GROUP_TAG


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ``a`` by positive ``b``."""
    return -(a // -b)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """SHA-256 of (parent hash, token ids, extra keys), deterministic across processes.

    Layout of the hashed bytes (every field has a fixed or prefixed length, so no two different
    inputs serialise to the same bytes):

        | parent (32 B) | n (u32) | n x token id (i64, little endian) | repr(extra_keys) |
    """
    hasher = hashlib.sha256()
    hasher.update(parent_hash if parent_hash is not None else NONE_HASH)
    hasher.update(struct.pack("<I", len(token_ids)))
    hasher.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys is not None:
        # repr of a tuple of str/int/bytes is stable across processes (unlike hash()).
        hasher.update(repr(extra_keys).encode())
    return hasher.digest()


def make_block_hasher(block_size: int) -> Callable[[Request], list[BlockHash]]:
    """A function returning the hashes of a request's *new* full blocks.

    "New" means the full blocks of ``request.all_token_ids`` past ``len(request.block_hashes)``;
    the caller (``Request``) extends ``block_hashes`` with the result, so each block is hashed
    exactly once as tokens arrive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def hash_new_full_blocks(request: Request) -> list[BlockHash]:
        token_ids = request.all_token_ids
        num_hashed_blocks = len(request.block_hashes)
        num_full_blocks = len(token_ids) // block_size
        parent = request.block_hashes[-1] if request.block_hashes else None
        new_hashes: list[BlockHash] = []
        for block_idx in range(num_hashed_blocks, num_full_blocks):
            start = block_idx * block_size
            # The salt is mixed into block 0 only; the chain carries it to every later block.
            extra_keys = (request.cache_salt,) if block_idx == 0 and request.cache_salt else None
            parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
            new_hashes.append(parent)
        return new_hashes

    return hash_new_full_blocks


def max_concurrency(
    num_blocks: int, block_size: int, max_model_len: int, blocks_per_seq: int | None = None
) -> int:
    """How many requests of ``max_model_len`` tokens fit in the cache at once (each holding
    ``blocks_per_seq`` blocks, by default one per ``block_size`` tokens).

    Block 0 is the null block and never holds KV, so ``num_blocks - 1`` blocks are usable.
    """
    return max(num_blocks - 1, 0) // (blocks_per_seq or cdiv(max_model_len, block_size))
