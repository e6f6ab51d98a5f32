"""The attention interface: one description of a step, declared hooks, layers by index.

Every backend is an ``AttentionBackend``; the step is described once (``describe_step``) and
built into each backend's metadata once; layers find one another by index through the
``axon::attention`` op, in any order; speculative steps (several queries per request), sliding
windows, sinks and encoder-only layers are all shapes of the same interface, checked here
against a naive per-query computation.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from axon.forward_context import get_forward_context, set_forward_context
from axon.model.layers.attention import (
    AttentionBackend,
    AttentionSpec,
    AttentionType,
    Segment,
    describe_step,
    get_attention_backend,
)
from axon.model.layers.attention.layer import Attention
from axon.model.layers.attention.reference import ReferenceAttentionBackend
from axon.platforms.cpu_kernels import load_cpu_kernels

BLOCK = 4


def backends(kernel_cache_root: str) -> list[AttentionBackend]:
    out: list[AttentionBackend] = [ReferenceAttentionBackend(), get_attention_backend("cpu_paged")]
    if load_cpu_kernels(kernel_cache_root):
        out.append(get_attention_backend("cpu_flash", kernel_cache_root))
    return out


def naive(
    q: torch.Tensor,  # [H, D] one query
    keys: torch.Tensor,  # [S, KVH, D] every key of its sequence
    values: torch.Tensor,
    pos: int | None,  # the query's position: causal (and windowed) below it; None: bidirectional
    spec: AttentionSpec,
) -> torch.Tensor:  # [H, D]
    group = spec.num_heads // spec.num_kv_heads
    out = torch.empty_like(q, dtype=torch.float32)
    for h in range(spec.num_heads):
        k, v = keys[:, h // group].float(), values[:, h // group].float()
        scores = (k @ q[h].float()) * spec.scale  # [S]
        allowed = torch.ones(len(k), dtype=torch.bool)
        if pos is not None:
            j = torch.arange(len(k))
            allowed = j <= pos
            if spec.sliding_window is not None:
                allowed &= j > pos - spec.sliding_window
        scores = scores.masked_fill(~allowed, -math.inf)
        if spec.sinks is not None:
            scores = torch.cat([scores, spec.sinks[h : h + 1].float()])
        probs = torch.softmax(scores, 0)[: len(k)]
        out[h] = probs @ v
    return out


def test_every_backend_implements_the_declared_interface(kernel_cache_root: str) -> None:
    declared = ("build_metadata", "begin_step", "end_step", "forward", "forward_encoder", "check_spec")
    for backend in backends(kernel_cache_root):
        assert isinstance(backend, AttentionBackend)
        assert type(backend).forward is not AttentionBackend.forward, f"{backend.name} lacks forward"
        for hook in declared:
            assert hasattr(AttentionBackend, hook)
            assert callable(getattr(backend, hook))
    with pytest.raises(ValueError, match="unknown attention backend 'flash9'; supported: cpu_flash"):
        get_attention_backend("flash9")


def test_describe_step_by_its_invariants() -> None:
    # Request a: 3 new tokens after 5 cached (blocks 7, 2, 9); b: one decode at position 4.
    common = describe_step(
        [Segment([7, 2, 9], 5, 8), Segment([3, 5], 4, 5)], BLOCK, num_tokens=6, num_block_cols=4
    )
    assert common.num_actual_tokens == 4 and common.num_tokens == 6
    assert common.query_start_loc == [0, 3, 4] and common.seq_lens == [8, 5]
    # Position p lives at block_ids[p // B] * B + p % B; padding rows are written nowhere.
    assert common.slot_mapping.tolist() == [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, -1, -1]
    assert common.block_table.tolist() == [[7, 2, 9, 0], [3, 5, 0, 0]]
    empty = describe_step([], BLOCK, num_tokens=8)
    assert empty.num_actual_tokens == 0 and empty.slot_mapping.tolist() == [-1] * 8
    with pytest.raises(AssertionError, match="do not fit 1 blocks of 4"):
        describe_step([Segment([1], 0, 5)], BLOCK)


def _paged_case(seed: int, reqs: list[tuple[int, int]], spec: AttentionSpec):
    """A KV cache holding every request's keys, and the step that attends the last q_len of each."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 1 + sum(-(-s // BLOCK) for s, _ in reqs)
    ids = list(range(1, num_blocks))
    random.Random(seed).shuffle(ids)
    k_cache = torch.randn(num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim, generator=gen)
    v_cache = torch.randn_like(k_cache)
    segments = []
    for seq_len, q_len in reqs:
        n = -(-seq_len // BLOCK)
        segments.append(Segment(ids[:n], seq_len - q_len, seq_len))
        ids = ids[n:]
    common = describe_step(segments, BLOCK, num_tokens=sum(q for _, q in reqs) + 2)
    q = torch.randn(common.num_tokens, spec.num_heads, spec.head_dim, generator=gen)
    return q, k_cache, v_cache, common, segments


def _naive_paged(q, k_cache, v_cache, segments, spec) -> torch.Tensor:
    out = torch.zeros_like(q)
    row = 0
    for seg in segments:
        flat_k = k_cache[torch.tensor(seg.block_ids)].flatten(0, 1)[: seg.end]
        flat_v = v_cache[torch.tensor(seg.block_ids)].flatten(0, 1)[: seg.end]
        for pos in range(seg.start, seg.end):
            out[row] = naive(q[row], flat_k, flat_v, pos, spec)
            row += 1
    return out


def test_speculative_steps_fit_every_backend(kernel_cache_root: str) -> None:
    # Verification of k = 3 drafted tokens: 4 queries per request over a cached prefix, beside
    # plain decodes and a fresh prefill, in one step.
    spec = AttentionSpec(4, 2, 8, 8**-0.5)
    reqs = [(13, 4), (9, 4), (6, 1), (5, 5), (21, 4)]
    q, k_cache, v_cache, common, segments = _paged_case(1, reqs, spec)
    want = _naive_paged(q, k_cache, v_cache, segments, spec)
    for backend in backends(kernel_cache_root):
        got = backend.forward(q, k_cache, v_cache, backend.build_metadata(common), spec)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


@pytest.mark.parametrize(
    "head_dim", [8, 64]
)  # cpu_flash: its plain loops; its AVX-512 kernel where the CPU has it
@pytest.mark.parametrize("window, sinks", [(3, False), (None, True), (5, True), (20, True)])
def test_sliding_window_and_sinks(
    kernel_cache_root: str, window: int | None, sinks: bool, head_dim: int
) -> None:
    heads = 4
    spec = AttentionSpec(
        heads,
        2,
        head_dim,
        head_dim**-0.5,
        sliding_window=window,
        sinks=torch.linspace(-1.0, 2.0, heads) if sinks else None,
    )
    # Ragged: prefill segments past the window, decodes, a segment over a cached prefix, and a
    # 40-token prefill whose rows span several 16-key tiles on both sides of the window.
    reqs = [(13, 4), (9, 1), (7, 7), (11, 1), (40, 40), (37, 3)]
    q, k_cache, v_cache, common, segments = _paged_case(2, reqs, spec)
    want = _naive_paged(q, k_cache, v_cache, segments, spec)
    for backend in backends(kernel_cache_root):
        if backend.name == "cpu_paged":
            continue  # it has neither (test_backends_refuse_layer_features_they_lack)
        got = backend.forward(q, k_cache, v_cache, backend.build_metadata(common), spec)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


def test_backends_refuse_layer_features_they_lack() -> None:
    backend = get_attention_backend("cpu_paged")
    with pytest.raises(ValueError, match="'cpu_paged' does not implement sliding-window"):
        Attention(4, 2, 8, backend, sliding_window=128)
    with pytest.raises(ValueError, match="'cpu_paged' does not implement attention sinks"):
        Attention(4, 2, 8, backend, sinks=torch.zeros(4))


def test_encoder_only_layers_attend_each_sequence_whole(kernel_cache_root: str) -> None:
    spec = AttentionSpec(4, 4, 8, 8**-0.5, AttentionType.ENCODER_ONLY)
    lens = [5, 1, 9]
    common = describe_step([Segment(list(range(1, 4)), 0, n) for n in lens], BLOCK, num_tokens=sum(lens) + 3)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(common.num_tokens, 4, 8, generator=gen) for _ in range(3))
    want = torch.zeros_like(q)
    for a, b in zip(common.query_start_loc, common.query_start_loc[1:]):
        for row in range(a, b):
            want[row] = naive(q[row], k[a:b], v[a:b], None, spec)
    for backend in backends(kernel_cache_root):
        got = backend.forward_encoder(q, k, v, backend.build_metadata(common), spec)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=backend.name)


@torch.inference_mode()
@pytest.mark.parametrize("name", ["reference", "cpu_paged", "cpu_flash"])
def test_layers_are_addressed_by_index_in_any_order(name: str, kernel_cache_root: str) -> None:
    # The compiled graph's door (torch.ops.axon.attention) names its layer: calling layer 2,
    # then 0, then 1 gives each layer's own answer, from its own cache.
    if name == "cpu_flash" and not load_cpu_kernels(kernel_cache_root):
        pytest.skip("no C++ compiler: cpu_flash cannot be built here")
    backend = get_attention_backend(name, kernel_cache_root)
    layers = [Attention(4, 2, 8, backend) for _ in range(3)]
    q, _, _, common, _ = _paged_case(4, [(9, 3), (6, 1)], layers[0].spec)
    gen = torch.Generator().manual_seed(5)
    caches = []
    for i, layer in enumerate(layers):
        kv = (torch.randn(8, BLOCK, 2, 8, generator=gen), torch.randn(8, BLOCK, 2, 8, generator=gen))
        caches.append(tuple(c.clone() for c in kv))
        layer.bind_kv_cache(i, kv)
    k_new = torch.randn(common.num_tokens, 2, 8, generator=gen)
    v_new = torch.randn(common.num_tokens, 2, 8, generator=gen)

    def run(order: list[int]) -> dict[int, torch.Tensor]:
        for layer, kv in zip(layers, caches, strict=True):
            layer.kv_cache[0].copy_(kv[0]), layer.kv_cache[1].copy_(kv[1])
        with set_forward_context(common, layers):
            return {i: torch.ops.axon.attention(q, k_new, v_new, i) for i in order}

    in_order, shuffled = run([0, 1, 2]), run([2, 0, 1])
    for i in range(3):
        torch.testing.assert_close(in_order[i], shuffled[i], rtol=0, atol=0)
    assert not torch.equal(in_order[0], in_order[1]), "each layer reads its own cache"


def test_the_step_is_built_once_per_forward() -> None:
    calls = []

    class Counting(ReferenceAttentionBackend):
        def build_metadata(self, common):
            calls.append(common)
            return super().build_metadata(common)

    backend = Counting()
    layers = [Attention(2, 2, 4, backend) for _ in range(4)]
    for i, layer in enumerate(layers):
        layer.bind_kv_cache(i, (torch.zeros(4, BLOCK, 2, 4), torch.zeros(4, BLOCK, 2, 4)))
    common = describe_step([Segment([1, 2], 0, 6)], BLOCK)
    x = torch.randn(6, 2, 4)
    with set_forward_context(common, layers) as metadata:
        for layer in layers:
            layer(x, x, x)
        assert get_forward_context().attn_metadata is metadata
    assert calls == [common]
