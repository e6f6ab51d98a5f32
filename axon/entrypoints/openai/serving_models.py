"""GET /v1/models: every served model name, each a card (the first name is the one reported)."""

from __future__ import annotations

from axon.entrypoints.openai.protocol import ModelCard, ModelList
from axon.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    def show_available_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=name, root=self.ctx.model_path, max_model_len=self.max_model_len)
                for name in self.ctx.served_model_names
            ]
        )
