"""The offline API: ``from axon import LLM, SamplingParams``, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from axon.engine.arg_utils import create_engine_config
from axon.engine.input_processor import PromptType
from axon.engine.llm_engine import LLMEngine
from axon.engine.tokenizer import render_chat
from axon.outputs import RequestOutput
from axon.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """``LLM(model=None, **vllm_options)``; no model means the bundled SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(create_engine_config(model=model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": self.apply_chat_template(
                    conv, chat_template, add_generation_prompt, chat_template_kwargs
                )
            }
            for conv in conversations
        ]
        params = self._params_per_prompt(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm)

    def apply_chat_template(
        self,
        conversation: ChatMessages,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        _, token_ids = render_chat(
            self.get_tokenizer(),
            conversation,
            chat_template,
            add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return token_ids

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if len(sampling_params) != num_prompts:
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {num_prompts} prompts; "
                "pass one, or one per prompt"
            )
        return list(sampling_params)

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate every prompt before enqueuing any, so a bad one changes nothing.
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(prompt, p))
        except ValueError:
            engine.abort_request(ids)
            raise
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out
                        bar.update(1)
        return [outputs[i] for i in ids]
