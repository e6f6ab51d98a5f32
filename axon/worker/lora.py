"""The worker's LoRA adapters: ``max_loras`` slots in every adapted layer, filled from a host
cache of ``max_cpu_loras`` loaded adapters (least recently used out first), which reads an
adapter's folder the first time it is asked for."""

from __future__ import annotations

from collections import OrderedDict

from axon.lora.request import LoRAInput
from axon.model.layers.lora import LoRAAdapter, LoRALinear, layer_shapes, load_peft_adapter


class LoRAManager:
    def __init__(
        self, layers: dict[str, LoRALinear], max_loras: int, max_cpu_loras: int, max_rank: int
    ) -> None:
        self.layers = layers
        self.shapes = layer_shapes(layers)
        self.max_rank = max_rank
        self.slots: list[int | None] = [None] * max_loras  # slot -> adapter id
        self.slot_use: list[int] = [0] * max_loras  # the step that last used each slot
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.max_cpu_loras = max_cpu_loras
        self.step = 0

    def slot_for(self, lora: LoRAInput, in_step: set[int]) -> int:
        """The slot holding ``lora``, loading it into the least recently used slot that no
        adapter of this step (``in_step``, ids) holds; the scheduler admits no more adapters
        than slots, so one is free."""
        self.step += 1
        if lora.int_id in self.slots:
            slot = self.slots.index(lora.int_id)
        else:
            free = [s for s, held in enumerate(self.slots) if held is None or held not in in_step]
            assert free, "more adapters in a step than slots (the scheduler admits at most max_loras)"
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_use[s]))
            adapter = self._adapter(lora)
            for name, layer in self.layers.items():
                layer.set_slot(slot, adapter.weights.get(name, {}))
            self.slots[slot] = lora.int_id
        self.slot_use[slot] = self.step
        return slot

    def _adapter(self, lora: LoRAInput) -> LoRAAdapter:
        adapter = self.cpu.pop(lora.int_id, None)
        if adapter is None:
            adapter = load_peft_adapter(lora.path, lora.name, self.shapes, self.max_rank)
        self.cpu[lora.int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter
