"""The offline API: ``from axon import LLM, SamplingParams``, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from axon.engine.arg_utils import create_engine_config
from axon.engine.input_processor import PromptType
from axon.engine.llm_engine import LLMEngine
from axon.engine.output_processor import AnyRequestOutput
from axon.engine.pooling_inputs import score_outputs, score_pairs
from axon.engine.tokenizer import render_chat
from axon.lora.request import LoRARequest
from axon.multimodal.prompts import split_chat_images
from axon.outputs import EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
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
        self.llm_engine = LLMEngine(config)

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
        self._require_pooling("embed")
        prompt_list = _as_prompt_list(prompts)
        params = _params_per_prompt(pooling_params, len(prompt_list), PoolingParams, "PoolingParams")
        if truncate_prompt_tokens is not None:
            params = [dataclasses.replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        add = self.llm_engine.add_pooling_request
        adds = [functools.partial(add, p, q) for p, q in zip(prompt_list, params, strict=True)]
        return self._run_all(adds, use_tqdm)  # type: ignore[return-value]

    def score(
        self,
        text_1: str | Sequence[str],
        text_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score`` for a bi-encoder: the cosine similarity of each pair's embeddings,
        one text_1 against every text_2, or text_1[i] with text_2[i]."""
        self._require_pooling("score")
        texts_1 = [text_1] if isinstance(text_1, str) else list(text_1)
        texts_2 = [text_2] if isinstance(text_2, str) else list(text_2)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        score_pairs(len(texts_1), len(texts_2))  # a shape error before anything runs
        embedded = self.embed([*texts_1, *texts_2], params, use_tqdm)
        return score_outputs(embedded[: len(texts_1)], embedded[len(texts_1) :], "score")

    def _require_pooling(self, what: str) -> None:
        if self.runner_type != "pooling":
            raise ValueError(f"{what}() needs an embedding model (runner='pooling'); this LLM generates")

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """``lora_request``: the adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        params = _params_per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm, loras)

    def start_profile(self) -> None:
        """vLLM's ``LLM.start_profile``: profile the engine until ``stop_profile`` (needs
        ``profiler_config`` or $VLLM_TORCH_PROFILER_DIR)."""
        if not self.llm_engine.engine_core.start_profile():
            raise ValueError("profiling needs profiler_config (or $VLLM_TORCH_PROFILER_DIR)")

    def stop_profile(self) -> list[str]:
        """Stop profiling; the Chrome trace files written."""
        return self.llm_engine.engine_core.stop_profile()

    def sleep(self, level: int = 1) -> None:
        """vLLM's ``LLM.sleep``: release the KV cache's memory (level 1; the weights stay in host
        memory) until ``wake_up``. Needs ``enable_sleep_mode``."""
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        self.llm_engine.wake_up()

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
        prompts: list[PromptType] = []
        for conv in conversations:
            # Image parts ({"type": "image_url", ...} or {"type": "image", "image": ...}) go to
            # the template as {"type": "image"}, the images beside the prompt.
            conv, images = split_chat_images(list(conv))
            ids = self.apply_chat_template(conv, chat_template, add_generation_prompt, chat_template_kwargs)
            prompts.append(
                {"prompt_token_ids": ids, **({"multi_modal_data": {"image": images}} if images else {})}
            )
        params = _params_per_prompt(sampling_params, len(prompts), SamplingParams, "sampling_params")
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

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        self._require_generate()
        engine = self.llm_engine
        loras = loras or [None] * len(prompts)
        adds = [
            functools.partial(engine.add_request, p, q, lora_request=lo)
            for p, q, lo in zip(prompts, params, loras, strict=True)
        ]
        return self._run_all(adds, use_tqdm)  # type: ignore[return-value]

    def _run_all(self, adds: list[Callable[[], str]], use_tqdm: bool) -> list[AnyRequestOutput]:
        """Enqueue every request (``adds``), run the engine until all finish; outputs in order."""
        engine = self.llm_engine
        # The engine is idle between calls: buckets the last call reached compile now.
        engine.engine_core.compile_pending()
        # Validate every prompt before enqueuing any, so a bad one changes nothing.
        ids = []
        try:
            for add in adds:
                ids.append(add())
        except ValueError:
            engine.abort_request(ids)
            raise
        outputs: dict[str, AnyRequestOutput] = {}
        with _progress(len(ids), use_tqdm) as bar:
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


def _params_per_prompt(params: Any, num_prompts: int, kind: type, name: str) -> list[Any]:
    """One params record per prompt: a default, one for all, or one each (``name`` in errors)."""
    if params is None:
        return [kind()] * num_prompts
    if isinstance(params, kind):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} {name} for {num_prompts} prompts; pass one, or one per prompt")
    return list(params)


def _progress(total: int, use_tqdm: bool) -> tqdm:
    return tqdm(total=total, desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
