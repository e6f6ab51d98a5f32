"""LoRA adapters on a model's linear layers, several in one step (vLLM's multi-LoRA batching).

With ``enable_lora`` every adaptable linear layer of the decoder (q/k/v, o, gate/up, down) is
wrapped in a ``LoRALinear``, which keeps ``max_loras`` adapter slots: ``A [slots, S * rank, in]``
(the A of each of the layer's S output slices, q, k, v of the merged qkv layer or gate, up of
gate/up, one under another) and a block-diagonal ``B^T [slots, S * rank, out]`` (slice k's B in
its rank's rows and its output columns; the adapter's scaling folded in; ranks below
``max_lora_rank`` are zero-padded, so the sums do not change). A step's rows each name their
slot (-1: the base model) in the forward context (``lora_slots``). A step of few rows (decodes)
multiplies every row by every slot's A at once, keeps each row's own slot's part (a mask the
step builds once) and multiplies by every slot's B at once: two GEMMs per layer, whatever the
adapters. A larger step (prefills) multiplies each slot's rows alone: two GEMMs per adapter in
the step. Never a loop per request or slice. Compiled graphs see one opaque op per layer, ``torch.ops.axon.lora_add_(y, x, handle)``,
which finds its layer by handle (as ``packed_linear`` does) and reads the slots at run time.

PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``) load with
``load_peft_adapter``: the targets are checked against the layers, the rank against
``max_lora_rank``, every tensor's shape against its layer; scaling is ``lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import weakref
from dataclasses import dataclass, field

import torch
from safetensors.torch import load_file
from torch import nn

from axon.forward_context import get_forward_context

# PEFT's module names -> (axon's layer, the output slice it fills)
TARGETS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
_LAYER_NAMES = frozenset(layer for layer, _ in TARGETS.values())

# Steps of at most this many rows take the masked all-slots path (see the module docstring).
DENSE_ROWS = 64

_layers: dict[int, weakref.ReferenceType[LoRALinear]] = {}
_handles = itertools.count()


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        output_sizes: tuple[int, ...],
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.output_sizes = output_sizes
        self.offsets = [0, *itertools.accumulate(output_sizes)]
        kw = {"dtype": dtype, "device": device}
        self.max_rank = max_rank
        num_slices = len(output_sizes)
        self.width = num_slices * max_rank  # a slot's rank rows, all slices
        self.lora_a = torch.zeros(max_loras, self.width, in_features, **kw)
        self.lora_bt = torch.zeros(max_loras, self.width, sum(output_sizes), **kw)
        self.handle = next(_handles)
        _layers[self.handle] = weakref.ref(self)
        weakref.finalize(self, _layers.pop, self.handle, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if torch.compiler.is_compiling():
            torch.ops.axon.lora_add_(y, x, self.handle)
        else:
            self.add_lora(y, x)
        return y

    def add_lora(self, y: torch.Tensor, x: torch.Tensor) -> None:
        slots = get_forward_context().lora_slots
        if slots is None:
            return
        a, bt = self.lora_a, self.lora_bt
        xl = x.to(a.dtype)
        if x.shape[0] <= DENSE_ROWS:
            xa = xl @ a.view(-1, self.in_features).T  # [rows, slots * width]: every slot's
            xa *= slots.mask(self.width, a.dtype, xa.shape[0])
            if y.dtype == a.dtype:
                y.addmm_(xa, bt.view(-1, bt.shape[-1]))
            else:
                y += (xa @ bt.view(-1, bt.shape[-1])).to(y.dtype)
            return
        for slot, rows in slots.groups:
            if rows is None:  # every row of the step
                y += ((xl @ a[slot].T) @ bt[slot]).to(y.dtype)
            else:
                y.index_add_(0, rows, ((xl.index_select(0, rows) @ a[slot].T) @ bt[slot]).to(y.dtype))

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot ``slot`` holds ``weights`` (slice -> A [r, in], B scaled [out, r]); slices it
        lacks are zero (the adapter leaves them alone)."""
        self.lora_a[slot].zero_()
        self.lora_bt[slot].zero_()
        r = self.max_rank
        for k, (a, b) in weights.items():
            self.lora_a[slot, k * r : k * r + a.shape[0]].copy_(a)
            self.lora_bt[slot, k * r : k * r + b.shape[1], self.offsets[k] : self.offsets[k + 1]].copy_(b.T)


@torch.library.custom_op("axon::lora_add_", mutates_args=("y",))
def lora_add_(y: torch.Tensor, x: torch.Tensor, handle: int) -> None:
    layer = _layers[handle]()
    assert layer is not None, f"LoRA layer {handle} is gone"
    layer.add_lora(y, x)


@lora_add_.register_fake
def _(y: torch.Tensor, x: torch.Tensor, handle: int) -> None:
    return None


@dataclass
class LoRASlots:
    """A step's rows by adapter slot: ``groups`` (slot, the rows' indices, or None when the slot
    has every row of the step), slots in the step only."""

    groups: list[tuple[int, torch.Tensor | None]]
    row_slots: list[int]  # each row's slot (-1: none), the step's rows in order
    num_slots: int
    device: torch.device
    _masks: dict[tuple[int, torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    def mask(self, width: int, dtype: torch.dtype, num_rows: int) -> torch.Tensor:
        """[num_rows, num_slots * width]: 1 in each row's own slot's ``width`` columns (rows past
        the step's, a bucket's padding, have none); built once per step and width."""
        key = (width, dtype, num_rows)
        if key not in self._masks:
            mask = torch.zeros(num_rows, self.num_slots, width, dtype=dtype)
            for row, slot in enumerate(self.row_slots):
                if slot >= 0:
                    mask[row, slot] = 1
            self._masks[key] = mask.view(num_rows, -1).to(self.device)
        return self._masks[key]

    @classmethod
    def from_rows(cls, row_slots: list[int], num_slots: int, device: torch.device) -> LoRASlots | None:
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if not by_slot:
            return None
        groups = [
            (s, None if len(r) == len(row_slots) else torch.tensor(r, dtype=torch.int64, device=device))
            for s, r in by_slot.items()
        ]
        return cls(groups, row_slots, num_slots, device)


def wrap_lora_layers(
    model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device
) -> dict[str, LoRALinear]:
    """Every adaptable linear layer of ``model`` in a ``LoRALinear`` (slots of ``dtype`` on
    ``device``, the model's); by module name."""
    wrapped: dict[str, LoRALinear] = {}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name not in _LAYER_NAMES or isinstance(child, LoRALinear):
                continue
            in_features = getattr(child, "in_features", None)
            out_features = getattr(child, "out_features", None)
            if in_features is None or out_features is None:
                continue
            sizes = tuple(getattr(child, "output_sizes", (out_features,)))
            layer = LoRALinear(child, in_features, sizes, max_loras, max_rank, dtype, device)
            setattr(module, child_name, layer)
            wrapped[f"{name}.{child_name}" if name else child_name] = layer
    if not wrapped:
        raise ValueError(f"{type(model).__name__} has no linear layers LoRA adapters can target")
    return wrapped


@dataclass
class LoRAAdapter:
    """A loaded adapter: per wrapped layer name, slice -> (A [r, in], B scaled [out, r])."""

    name: str
    rank: int
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


LayerShapes = dict[str, tuple[int, tuple[int, ...]]]  # layer name -> (in_features, output_sizes)


def layer_shapes(layers: dict[str, LoRALinear]) -> LayerShapes:
    return {name: (layer.in_features, layer.output_sizes) for name, layer in layers.items()}


def decoder_layer_shapes(hf_config: dict) -> LayerShapes:
    """The adaptable layers of a Llama-family decoder, from its config alone (the front end
    checks an adapter against them before any request carries it)."""
    h = int(hf_config["hidden_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or h // heads)
    inter = int(hf_config["intermediate_size"])
    shapes: LayerShapes = {}
    for i in range(int(hf_config["num_hidden_layers"])):
        pre = f"model.layers.{i}"
        shapes[f"{pre}.self_attn.qkv_proj"] = (
            h,
            (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
        )
        shapes[f"{pre}.self_attn.o_proj"] = (heads * head_dim, (h,))
        shapes[f"{pre}.mlp.gate_up_proj"] = (h, (inter, inter))
        shapes[f"{pre}.mlp.down_proj"] = (inter, (h,))
    return shapes


def load_peft_adapter(path: str, name: str, shapes: LayerShapes, max_rank: int) -> LoRAAdapter:
    """A PEFT adapter folder, checked against the model's adaptable layers (``shapes``) and
    ``max_rank``; a ValueError names what is wrong, and nothing is loaded then."""
    config_path = os.path.join(path, "adapter_config.json")
    weights_path = os.path.join(path, "adapter_model.safetensors")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            raise ValueError(f"LoRA adapter {name!r}: {needed} is missing (a PEFT adapter folder has it)")
    with open(config_path) as f:
        config = json.load(f)
    rank = int(config.get("r", 0))
    if not 1 <= rank <= max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(weights_path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, _, kind = key.removesuffix(".weight").rpartition(".")
        if kind not in ("lora_A", "lora_B"):
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a lora_A / lora_B weight")
        pairs.setdefault(module.removeprefix("base_model.model."), {})[kind] = tensor
    weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for module, pair in pairs.items():
        parent, _, leaf = module.rpartition(".")
        if leaf not in TARGETS:
            raise ValueError(
                f"LoRA adapter {name!r} targets {module!r}, which axon cannot adapt "
                f"(it adapts {', '.join(TARGETS)})"
            )
        layer_name, k = TARGETS[leaf]
        shape = shapes.get(f"{parent}.{layer_name}")
        if shape is None or "lora_A" not in pair or "lora_B" not in pair:
            raise ValueError(f"LoRA adapter {name!r} targets {module!r}, which this model does not have")
        a, b = pair["lora_A"], pair["lora_B"]
        want_a, want_b = (rank, shape[0]), (shape[1][k], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(
                f"LoRA adapter {name!r}: {module} has A {list(a.shape)} and B {list(b.shape)}, "
                f"this model needs {list(want_a)} and {list(want_b)}"
            )
        weights.setdefault(f"{parent}.{layer_name}", {})[k] = (a.float(), b.float() * scale)
    return LoRAAdapter(name, rank, weights)
