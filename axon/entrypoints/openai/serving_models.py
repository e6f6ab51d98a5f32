"""GET /v1/models: every served model name, each a card (the first name is the one reported),
then the LoRA adapters (their parent the base model); runtime LoRA loading and unloading."""

from __future__ import annotations

from http import HTTPStatus

from axon.entrypoints.openai.errors import OpenAIError, bad_request
from axon.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from axon.entrypoints.openai.serving_engine import OpenAIServing
from axon.lora.request import LoRARequest


class OpenAIServingModels(OpenAIServing):
    def show_available_models(self) -> ModelList:
        base = [
            ModelCard(id=name, root=self.ctx.model_path, max_model_len=self.max_model_len)
            for name in self.ctx.served_model_names
        ]
        adapters = [
            ModelCard(id=name, root=lora.lora_path, parent=self.model_name, max_model_len=self.max_model_len)
            for name, lora in self.ctx.lora_modules.items()
        ]
        return ModelList(data=base + adapters)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """vLLM's runtime adapter loading: the folder is checked (and refused with a 400 that
        says why) before the name serves."""
        if request.lora_name in self.ctx.lora_modules or request.lora_name in self.ctx.served_model_names:
            raise bad_request(f"The model {request.lora_name!r} is already served", param="lora_name")
        lora = LoRARequest(request.lora_name, 1 + max(self._ids(), default=0), request.lora_path)
        try:
            await self.off_loop(self.engine.input_processor.lora, lora)
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        self.ctx.lora_modules[lora.lora_name] = lora
        return f"Success: LoRA adapter '{lora.lora_name}' added successfully."

    def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        if request.lora_name not in self.ctx.lora_modules:
            raise OpenAIError(
                f"The lora adapter '{request.lora_name}' cannot be found.",
                HTTPStatus.NOT_FOUND,
                param="lora_name",
            )
        del self.ctx.lora_modules[request.lora_name]
        return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

    def _ids(self) -> list[int]:
        return [lora.lora_int_id for lora in self.ctx.lora_modules.values()]
