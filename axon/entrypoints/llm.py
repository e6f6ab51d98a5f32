"""The offline API: ``from axon import LLM, SamplingParams``, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from axon.engine.arg_utils import create_engine_config
from axon.engine.input_processor import PromptType
from axon.engine.llm_engine import LLMEngine
from axon.engine.pooling_engine import PoolingEngine
from axon.engine.tokenizer import render_chat
from axon.outputs import EmbeddingRequestOutput, RequestOutput
from axon.pooling_params import PoolingParams
from axon.sampling_params import SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """``LLM(model=None, **vllm_options)``; no model means the bundled SmolLM2-135M-Instruct.

    An embedding model (``runner="pooling"``, chosen by default for encoder architectures such as
    ``BertModel``) serves ``embed``; a generative one serves ``generate`` and ``chat``.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        config = create_engine_config(model=model, **kwargs)
        self.runner_type = config.model_config.runner
        self.llm_engine: Any = PoolingEngine(config) if self.runner_type == "pooling" else LLMEngine(config)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType] | Sequence[int] | Sequence[Sequence[int]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt: text, {"prompt": ...}, {"prompt_token_ids": [...]}, a list of
        token ids, or a list of any of these."""
        del use_tqdm  # accepted for vLLM's signature; the batches run without a progress bar
        if self.runner_type != "pooling":
            raise ValueError("embed() needs an embedding model (runner='pooling'); this LLM generates")
        prompt_list = _as_prompt_list(prompts)
        params = _params_per_prompt(pooling_params, len(prompt_list), PoolingParams)
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        return self.llm_engine.embed(prompt_list, params)

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

    def _require_generate(self) -> None:
        if self.runner_type != "generate":
            raise ValueError(
                "this LLM is an embedding model (runner='pooling'): use embed(), not generate/chat"
            )

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
        self._require_generate()
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


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    """Normalize ``embed``'s inputs: a bare token-id list is one prompt, a list of them several."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(  # noqa: TRY004 (a bad prompt is the user's ValueError, as in generate)
            f"prompts must be a string, a prompt dict, a list of token ids or a list of prompts; "
            f"got {type(prompts).__name__}"
        )
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given (an empty list)")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [{"prompt_token_ids": prompts}]
    return [
        {"prompt_token_ids": list(p)} if isinstance(p, list | tuple) else p  # type: ignore[misc]
        for p in prompts
    ]


def _params_per_prompt(params: Any, num_prompts: int, kind: type) -> list[Any]:
    if params is None:
        return [kind()] * num_prompts
    if isinstance(params, kind):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(
            f"got {len(params)} {kind.__name__} for {num_prompts} prompts; pass one, or one per prompt"
        )
    return list(params)
