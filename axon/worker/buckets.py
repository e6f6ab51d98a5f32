"""Static shapes: the bucket lists, their validation, and the choice of a step's bucket.

vllm-neuron's three dimensions, under its key names:

  num_batched_tokens_buckets     tokens of a step that prefills (default: powers of two from
                                 128 up to max_num_batched_tokens, which is the last)
  num_seqs_buckets               requests of a decode-only step (default: powers of two from 1
                                 up to max_num_seqs, which is the last)
  decode_context_length_buckets  optional: context lengths a decode step's block table is
                                 padded to (multiples of block_size, below max_model_len, which
                                 is the implicit last), so a step reads only the KV blocks its
                                 longest sequence needs

A step's flattened token count is padded up to the smallest bucket that fits it; a decode-only
step has one token per request, so both token lists are one set of graph shapes. With
speculative decoding a decode step verifies up to k drafts per request, k + 1 tokens each: its
buckets are num_seqs_buckets times (k + 1) besides num_seqs_buckets, so a verification pads to
a few rows, not to a prefill bucket. Padded rows
write no KV and are never sampled (``axon/model/layers/attention/backend.py``), so padding never
changes a result.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from axon.config import AxonConfig, CompilationConfig, replace

_KEYS = ("num_batched_tokens_buckets", "num_seqs_buckets", "decode_context_length_buckets")
_MIN_DEFAULT_PREFILL_BUCKET = 128


@dataclass(frozen=True)
class Buckets:
    num_batched_tokens: tuple[int, ...]
    num_seqs: tuple[int, ...]
    decode_context_length: tuple[int, ...]  # () when off; max_model_len is the implicit last
    block_size: int
    max_model_len: int
    num_speculative_tokens: int = 0

    @classmethod
    def from_config(cls, config: AxonConfig) -> Buckets:
        """The buckets of a config that resolve_config() resolved (every list concrete)."""
        comp = config.compilation_config
        tokens, seqs, contexts = (
            comp.num_batched_tokens_buckets,
            comp.num_seqs_buckets,
            comp.decode_context_length_buckets,
        )
        max_model_len = config.model_config.max_model_len
        assert tokens is not None and seqs is not None and contexts is not None, (
            "resolve_config() resolves the bucket lists"
        )
        assert max_model_len is not None, "resolve_config() sets max_model_len"
        spec = (config.speculative_config.speculative_config or {}).get("num_speculative_tokens", 0)
        return cls(tokens, seqs, contexts, config.cache_config.block_size, max_model_len, spec)

    @property
    def decode_sizes(self) -> tuple[int, ...]:
        """Token counts of decode steps: num_seqs_buckets, and each times (k + 1) with drafts
        (up to the largest prefill bucket, which bounds a step)."""
        k = self.num_speculative_tokens
        verify = {b * (k + 1) for b in self.num_seqs if b * (k + 1) <= self.num_batched_tokens[-1]}
        return tuple(sorted(set(self.num_seqs) | (verify if k else set())))

    @property
    def token_sizes(self) -> tuple[int, ...]:
        """Every padded token count a step can have: one compiled graph each."""
        return tuple(sorted(set(self.num_batched_tokens) | set(self.decode_sizes)))

    def pad_tokens(self, num_tokens: int, is_decode: bool) -> int:
        """The smallest bucket holding ``num_tokens``: from the decode sizes for a decode-only
        step, else from num_batched_tokens_buckets (either list if the first has none)."""
        first = self.decode_sizes if is_decode else self.num_batched_tokens
        for sizes in (first, self.token_sizes):
            i = bisect.bisect_left(sizes, num_tokens)
            if i < len(sizes):
                return sizes[i]
        raise ValueError(f"a step of {num_tokens} tokens exceeds the largest bucket {self.token_sizes[-1]}")

    def pad_context_blocks(self, num_blocks: int) -> int:
        """Block-table width for a step whose longest sequence spans ``num_blocks`` blocks."""
        if not self.decode_context_length:
            return num_blocks
        need = num_blocks * self.block_size
        i = bisect.bisect_left(self.decode_context_length, need)
        length = self.decode_context_length[i] if i < len(self.decode_context_length) else self.max_model_len
        return max(num_blocks, -(-length // self.block_size))


def bucket_name(num_tokens: int, is_decode: bool) -> str:
    """vllm-neuron's labels: ``decode_b8``, ``prefill_s1024``."""
    return f"decode_b{num_tokens}" if is_decode else f"prefill_s{num_tokens}"


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """low, 2*low, ... below high, then high itself."""
    out, n = [], low
    while n < high:
        out.append(n)
        n *= 2
    return (*out, high)


def parse_bucket_list(name: str, value: Any) -> tuple[int, ...] | None:
    """A list option as given by a user: a list/tuple of ints, or text "1,2,4" / "[1, 2, 4]"."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().strip("[]")
        try:
            value = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"{name} must be a list of integers such as 1,2,4, got {value!r}") from None
    if not isinstance(value, Sequence) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return tuple(value)


def resolve_bucket_lists(config: AxonConfig) -> CompilationConfig:
    """The compilation config with every bucket list concrete (decode_context_length_buckets
    () when off): flags first, then additional_config.neuron_config (vllm-neuron's keys), then
    the defaults. Every list is checked; errors name the value. Called once, by resolve_config();
    everything after reads the lists from the config."""
    neuron = (config.additional_config or {}).get("neuron_config") or {}
    if not isinstance(neuron, dict):
        raise ValueError(  # noqa: TRY004 (user input: a ValueError, as every config check raises)
            f"additional_config.neuron_config must be a JSON object, got {neuron!r}"
        )
    comp, sched = config.compilation_config, config.scheduler_config
    max_model_len = config.model_config.max_model_len
    max_tokens = sched.max_num_batched_tokens
    assert max_model_len is not None and max_tokens is not None, "resolve_config() comes first"
    block_size = config.cache_config.block_size
    given = {}
    for key in _KEYS:
        flag = parse_bucket_list(key, getattr(comp, key))
        nested = parse_bucket_list(f"neuron_config.{key}", neuron.get(key))
        if flag is not None and nested is not None and flag != nested:
            raise ValueError(
                f"{key} is given twice, as {list(flag)} and as neuron_config.{key} {list(nested)}"
            )
        given[key] = flag if flag is not None else nested
    tokens = given["num_batched_tokens_buckets"] or powers_of_two(
        min(_MIN_DEFAULT_PREFILL_BUCKET, max_tokens), max_tokens
    )
    seqs = given["num_seqs_buckets"] or powers_of_two(1, sched.max_num_seqs)
    contexts = given["decode_context_length_buckets"] or ()
    _check_list("num_batched_tokens_buckets", tokens, last=max_tokens, last_name="max_num_batched_tokens")
    _check_list("num_seqs_buckets", seqs, last=sched.max_num_seqs, last_name="max_num_seqs")
    _check_list("decode_context_length_buckets", contexts, last=None, last_name="")
    for c in contexts:
        if c % block_size:
            raise ValueError(
                f"decode_context_length_buckets value {c} is not a multiple of block_size {block_size}"
            )
        if c >= max_model_len:
            raise ValueError(
                f"decode_context_length_buckets value {c} is not below max_model_len {max_model_len} "
                "(max_model_len is the implicit last bucket)"
            )
    return replace(
        comp,
        num_batched_tokens_buckets=tokens,
        num_seqs_buckets=seqs,
        decode_context_length_buckets=contexts,
    )


def _check_list(name: str, values: tuple[int, ...], last: int | None, last_name: str) -> None:
    for v in values:
        if v < 1:
            raise ValueError(f"{name} value {v} is not positive")
    for a, b in itertools.pairwise(values):
        if b <= a:
            raise ValueError(f"{name} must be strictly ascending, but {b} follows {a}")
    if last is not None and values and values[-1] != last:
        raise ValueError(f"{name} must end at {last_name} ({last}), but its last value is {values[-1]}")
