"""The attention-backend interface: one description of a step, one builder, declared hooks.

Layout of one step's flattened batch (requests concatenated, no padding between them):

    tokens:          | req0 q0..q2 | req1 q0 | req2 q0..q5 | pad pad |   num_actual_tokens = 10
    query_start_loc:  0             3         4             10          num_tokens = 12
    seq_lens:         context + new tokens of each request (what attention reads)
    slot_mapping[t] = block_id * block_size + offset where token t's K/V is written; -1 = padding,
                      written nowhere.

Decode context parallelism (``dcp_world`` D > 1) shards each sequence's K/V across the D ranks of
a group by position: position p lives on rank p mod D, as that rank's key j = p // D, in the
block the scheduler gave for p (its blocks count block_size x D positions; each rank holds
block_size of them). A rank writes only its own positions (-1 for the others) and attends over
its own keys; the ranks' partial results merge by their log-sum-exps (context_parallel.py).

A model whose layers are partly sliding-window may hold its KV in two groups of blocks (the
scheduler's window group, axon/core/kv_cache_manager.py): then the step also carries
``window_block_table`` and ``window_slot_mapping`` for the sliding layers, built the same way
from each request's window-group block ids, and ``layer_view`` hands a sliding layer the step
with those in place of the full group's.

Any number of query tokens per request is one shape: a decode has 1, a prefill segment many, a
speculative verification step k + 1; each request's queries are the last ones of its sequence
(bottom-right causal over its cached prefix). Requests of every kind share one step.

Invariant: a step's new K/V are written into the cache before any query of that step reads it,
so a request that hit blocks being filled by another request in the same step reads them whole.

The step's life, once per forward (``axon/forward_context.py``):

    common = describe_step(segments, ...)          # the runner: one shared description
    metadata = backend.build_metadata(common)      # the backend's own per-step record
    backend.begin_step(metadata, layers)           # hand it to kernels that keep state
    ... each layer: backend.forward(q, k_cache, v_cache, metadata, layer.spec)   (decoder)
                    backend.forward_encoder(q, k, v, metadata, layer.spec)       (encoder-only)
    backend.end_step()
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from axon.model.layers.attention.encoder import encoder_attention

if TYPE_CHECKING:
    from axon.model.layers.attention.layer import Attention


class AttentionType(enum.Enum):
    DECODER = "decoder"  # causal over the request's paged KV cache, which it writes
    ENCODER_ONLY = "encoder_only"  # bidirectional within each sequence; no KV cache at all


@dataclass(frozen=True)
class AttentionSpec:
    """What one layer asks of its backend, beyond the step."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    attn_type: AttentionType = AttentionType.DECODER
    # A query at position p reads keys p - sliding_window + 1 .. p; None: every earlier key.
    sliding_window: int | None = None
    # [num_heads] learned logits that join every softmax's denominator and attend to nothing
    # (attention sinks, GPT-OSS); None: none.
    sinks: torch.Tensor | None = field(default=None, compare=False)


@dataclass
class CommonAttentionMetadata:
    """One step, as every backend and the runner see it (layout above); host-side lengths."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padded rows
    query_start_loc: list[int]  # [num_reqs + 1], host side
    seq_lens: list[int]  # [num_reqs], host side
    block_table: torch.Tensor  # [num_reqs, max_num_blocks] int64, 0 (null block) past the end
    block_size: int
    dcp_world: int = 1  # decode context parallelism: this rank holds positions dcp_rank mod dcp_world
    dcp_rank: int = 0
    # The KV cache's window group, for the sliding-window layers (layout above); None: one group.
    window_block_table: torch.Tensor | None = None
    window_slot_mapping: torch.Tensor | None = None

    def window_view(self) -> CommonAttentionMetadata:
        """The step as a sliding-window layer reads it: the window group's table and slots."""
        assert self.window_block_table is not None and self.window_slot_mapping is not None
        return dataclasses.replace(
            self,
            block_table=self.window_block_table,
            slot_mapping=self.window_slot_mapping,
            window_block_table=None,
            window_slot_mapping=None,
        )

    @property
    def num_tokens(self) -> int:
        """Rows of the step, padding included."""
        return self.slot_mapping.shape[0]

    def length_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc, seq_lens) as int32 CPU tensors, for kernels."""
        return (
            torch.tensor(self.query_start_loc, dtype=torch.int32),
            torch.tensor(self.seq_lens, dtype=torch.int32),
        )


@dataclass(frozen=True)
class Segment:
    """One request's part of a step: positions ``start`` to ``end`` (exclusive) are computed,
    reading keys 0 .. end - 1 through ``block_ids``."""

    block_ids: Sequence[int]
    start: int
    end: int
    window_block_ids: Sequence[int] = ()  # the KV cache's window group; empty: none


def describe_step(
    segments: Sequence[Segment],
    block_size: int,
    device: torch.device | str = "cpu",
    num_tokens: int | None = None,
    num_block_cols: int | None = None,
    dcp: tuple[int, int] = (1, 0),
) -> CommonAttentionMetadata:
    """The step's description: the one place one is built. ``num_tokens`` pads the rows (padding
    writes nothing), ``num_block_cols`` the block table (with the null block); ``dcp``: (world,
    rank) of this rank's decode-context-parallel group."""
    world, rank = dcp
    slots: list[int] = []
    query_start_loc, seq_lens = [0], []
    for seg in segments:
        assert 0 <= seg.start < seg.end <= len(seg.block_ids) * block_size * world, (
            f"positions {seg.start}..{seg.end} do not fit {len(seg.block_ids)} blocks of {block_size * world}"
        )
        slots += _slots(seg.block_ids, seg.start, seg.end, block_size, world, rank)
        query_start_loc.append(query_start_loc[-1] + seg.end - seg.start)
        seq_lens.append(seg.end)
    num_actual = len(slots)
    num_tokens = num_actual if num_tokens is None else num_tokens
    assert num_tokens >= num_actual, f"{num_actual} tokens do not fit a step of {num_tokens} rows"
    cols = max((len(s.block_ids) for s in segments), default=1)
    cols = cols if num_block_cols is None else max(cols, num_block_cols)
    window_table, window_slots = None, None
    if segments and segments[0].window_block_ids:
        assert all(len(s.window_block_ids) == len(s.block_ids) for s in segments), (
            "one window entry per block"
        )
        assert world == 1, "decode context parallelism keeps one KV group"
        window_table = _block_table([s.window_block_ids for s in segments], cols).to(device)
        window_slots = [
            p for s in segments for p in _slots(s.window_block_ids, s.start, s.end, block_size, 1, 0)
        ]
        window_slots = torch.tensor(
            window_slots + [-1] * (num_tokens - num_actual), dtype=torch.int64, device=device
        )
    return CommonAttentionMetadata(
        num_actual_tokens=num_actual,
        slot_mapping=torch.tensor(slots + [-1] * (num_tokens - num_actual), dtype=torch.int64, device=device),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=_block_table([s.block_ids for s in segments], cols).to(device),
        block_size=block_size,
        dcp_world=world,
        dcp_rank=rank,
        window_block_table=window_table,
        window_slot_mapping=window_slots,
    )


def _slots(ids: Sequence[int], start: int, end: int, block_size: int, world: int, rank: int) -> list[int]:
    """Where positions start .. end - 1 write their K/V (-1: another context-parallel rank's)."""
    return [
        ids[p // world // block_size] * block_size + p // world % block_size if p % world == rank else -1
        for p in range(start, end)
    ]


def _block_table(rows: Sequence[Sequence[int]], cols: int) -> torch.Tensor:
    """[len(rows), cols] int64, the null block (0) past each row's end."""
    table = torch.zeros(len(rows), cols, dtype=torch.int64)
    for i, ids in enumerate(rows):
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return table


class AttentionBackend:
    """Every hook a backend has. A backend implements ``forward``; the others have defaults.

    A backend serves every layer of a model and every step; ``build_metadata`` is called once a
    step, so whatever a backend derives from the step (plans, masks, kernel-side state) is
    derived there, once, not found again by each layer.
    """

    name: ClassVar[str]
    # Layer features beyond plain causal attention that ``forward`` implements; a layer that
    # needs one the backend lacks is refused when the model is built (``check_spec``).
    supports_sliding_window: ClassVar[bool] = False
    supports_sinks: ClassVar[bool] = False
    # ``forward_partial`` is implemented (decode context parallelism).
    supports_context_parallel: ClassVar[bool] = False
    # A torch op (q, k, v, layer_idx, scale) -> out that writes K/V and attends a decoder layer in
    # one call, reading the step handed over by ``begin_step``: no Python per layer, inside
    # compiled graphs too. None: layers go through ``forward``.
    fused_layer_op: ClassVar[Callable[..., torch.Tensor] | None] = None

    def check_spec(self, spec: AttentionSpec, context_parallel: bool = False) -> None:
        """Refuse, naming the feature, a layer this backend cannot attend (``context_parallel``:
        with its KV sharded across a decode-context-parallel group)."""
        if context_parallel and spec.attn_type is AttentionType.DECODER:
            if not self.supports_context_parallel:
                raise ValueError(
                    f"attention backend {self.name!r} does not implement decode context parallelism; "
                    "use 'cpu_flash' or 'reference'"
                )
            if spec.sliding_window is not None or spec.sinks is not None:
                raise ValueError(
                    "decode context parallelism does not support sliding-window attention or attention "
                    "sinks (a window or a sink would be counted on every rank of the group)"
                )
        if spec.sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(
                f"attention backend {self.name!r} does not implement sliding-window attention "
                f"(window {spec.sliding_window}); use attention_backend='reference'"
            )
        if spec.sinks is not None and not self.supports_sinks:
            raise ValueError(
                f"attention backend {self.name!r} does not implement attention sinks; "
                "use attention_backend='reference'"
            )

    def build_metadata(self, common: CommonAttentionMetadata) -> Any:
        """The backend's record of this step, read by every layer; by default the description."""
        return common

    def begin_step(self, metadata: Any, layers: Sequence[Attention]) -> None:
        """Before the step's forward: hand the step to state kept outside Python (kernels)."""

    def end_step(self) -> None:
        """After the step's forward, also when it failed."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], num_tokens >= num_actual_tokens
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: Any,  # what build_metadata returned for this step
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zeros
        """Attend every query to its request's cached keys (this step's already written)."""
        raise NotImplementedError

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: Any
    ) -> None:
        """Write this step's K/V into the cache at its slots (a backend may do it in one op)."""
        write_kv(k, v, k_cache, v_cache, self.common(metadata).slot_mapping)

    def forward_partial(
        self,
        q: torch.Tensor,  # [num_tokens, heads, head_dim]: any number of heads sharing the cache's
        k_cache: torch.Tensor,  # KV heads (a decode-context-parallel group's query heads)
        v_cache: torch.Tensor,
        metadata: Any,
        spec: AttentionSpec,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over this rank's keys only (positions dcp_rank mod dcp_world, see the top of
        this file): ([num_tokens, heads, head_dim] out, [num_tokens, heads] float32 log-sum-exp of
        each row's scaled scores). A row that reads no key here (and padding) has out 0 and
        log-sum-exp -1e30, never an infinity."""
        raise NotImplementedError

    def forward_encoder(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        metadata: Any,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are zeros
        """Encoder-only attention: each sequence of the step attends to itself, whole."""
        common = self.common(metadata)
        n = common.num_actual_tokens
        out = encoder_attention(q[:n], k[:n], v[:n], common.query_start_loc, spec.scale)
        if n == q.shape[0]:
            return out
        return torch.cat([out, out.new_zeros((q.shape[0] - n, *out.shape[1:]))])

    @staticmethod
    def common(metadata: Any) -> CommonAttentionMetadata:
        """The description a backend's record was built from."""
        return metadata if isinstance(metadata, CommonAttentionMetadata) else metadata.common

    def layer_view(self, metadata: Any, spec: AttentionSpec) -> Any:
        """The step as the layer with ``spec`` reads it: a sliding-window layer's, when the KV
        cache has a window group, is built on the window group's table and slots."""
        common = self.common(metadata)
        if spec.sliding_window is None or common.window_block_table is None:
            return metadata
        view = common.window_view()
        return view if metadata is common else dataclasses.replace(metadata, common=view)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens], -1 = do not write
) -> None:
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    n = slot_mapping.shape[0]
    slots, k, v = slot_mapping, k[:n], v[:n]
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, v.to(flat_v.dtype))
