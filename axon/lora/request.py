"""LoRA adapters as users name them (vLLM's ``LoRARequest``) and as requests carry them."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: a PEFT adapter folder by name and a positive id (the engine's key for it)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


class LoRAInput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request's adapter as it travels to the engine core and the worker."""

    name: str
    int_id: int
    path: str
