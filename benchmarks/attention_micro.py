"""Microseconds per attention call: the reference backend beside cpu_paged, on fixed paged batches.

    python -m benchmarks.attention_micro [--reps 15] [--threads 2]

Each case is one layer's attention call (K/V already in the cache, bf16, head_dim 64, block size
16) on the tiny-llama shape (8 heads / 4 KV heads) and SmolLM2-135M's (9 heads / 3 KV heads).
``cpu_paged`` is timed twice: reusing its per-step plan, as every layer after a step's first does,
and with the plan built inside the call, as a step's first layer does. Reported numbers are
medians of ``--reps`` timed calls after two warm-up calls, the three timed round-robin.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from axon.model.layers.attention.backend import AttentionSpec, CommonAttentionMetadata
from axon.model.layers.attention.cpu_paged import CpuPagedAttentionBackend
from axon.model.layers.attention.reference import ReferenceAttentionBackend
from benchmarks.common import markdown_table

SHAPES = {"8h/4kv": (8, 4), "smollm2 9h/3kv": (9, 3)}
HEAD_DIM = 64
BLOCK_SIZE = 16


def workloads(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    """(seq_len, q_len) per request of each case."""
    return {
        "16 decodes, ctx 128..256": [(rng.randint(128, 256), 1) for _ in range(16)],
        "1 prefill of 512": [(512, 512)],
        "16 prefills of 128": [(128, 128)] * 16,
        "64 decodes, ctx 512..640": [(rng.randint(512, 640), 1) for _ in range(64)],
    }


def make_inputs(
    reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CommonAttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq_len // BLOCK_SIZE) for seq_len, _ in reqs]
    num_blocks = sum(blocks_per_req) + 1
    block_ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # 0 is the null block
    table = torch.zeros(len(reqs), max(blocks_per_req), dtype=torch.int64)
    for i, n in enumerate(blocks_per_req):
        table[i, :n] = torch.tensor(block_ids[:n])
        block_ids = block_ids[n:]
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).bfloat16()
    v_cache = torch.randn(shape, generator=gen).bfloat16()
    query_start_loc = [0]
    for _, q_len in reqs:
        query_start_loc.append(query_start_loc[-1] + q_len)
    num_tokens = query_start_loc[-1]
    q = torch.randn(num_tokens, num_heads, HEAD_DIM, generator=gen).bfloat16()
    metadata = CommonAttentionMetadata(
        num_actual_tokens=num_tokens,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=[seq_len for seq_len, _ in reqs],
        block_table=table,
        block_size=BLOCK_SIZE,
    )
    return q, k_cache, v_cache, metadata


def median_us_each(fns: Sequence[Callable[[], object]], reps: int) -> list[float]:
    """Median microseconds per call of each fn, timed round-robin so load drift hits all alike."""
    for fn in fns:
        fn(), fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, fn_times in zip(fns, times):
            start = time.perf_counter()
            fn()
            fn_times.append(time.perf_counter() - start)
    return [statistics.median(t) * 1e6 for t in times]


def time_case(reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, reps: int) -> list[float]:
    """[reference, cpu_paged with its plan reused (a layer), cpu_paged building its plan (the
    step's first layer)] microseconds."""
    q, k_cache, v_cache, common = make_inputs(reqs, num_heads, num_kv_heads, seed=0)
    spec = AttentionSpec(num_heads, num_kv_heads, HEAD_DIM, HEAD_DIM**-0.5)
    reference, fast = ReferenceAttentionBackend(), CpuPagedAttentionBackend()
    planned = fast.build_metadata(common)

    def first_layer() -> torch.Tensor:
        backend = CpuPagedAttentionBackend()
        return backend.forward(q, k_cache, v_cache, backend.build_metadata(common), spec)

    return median_us_each(
        [
            lambda: reference.forward(q, k_cache, v_cache, common, spec),
            lambda: fast.forward(q, k_cache, v_cache, planned, spec),
            first_layer,
        ],
        reps,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for shape_name, (num_heads, num_kv_heads) in SHAPES.items():
        for case_name, reqs in workloads(random.Random(0)).items():
            ref_us, fast_us, cold_us = time_case(reqs, num_heads, num_kv_heads, args.reps)
            speedup = f"{ref_us / fast_us:.1f}x"
            rows.append(
                [shape_name, case_name, f"{ref_us:,.0f}", f"{fast_us:,.0f}", f"{cold_us:,.0f}", speedup]
            )
    header = ["shape", "case", "reference us", "cpu_paged us", "cpu_paged +plan us", "speedup"]
    print(f"bf16, head_dim {HEAD_DIM}, block {BLOCK_SIZE}, {args.threads} threads, median of {args.reps}")
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
