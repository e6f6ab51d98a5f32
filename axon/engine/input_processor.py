"""InputProcessor: prompts and chat messages -> validated EngineCoreRequests.

Every check on user input lives here, before any engine state changes: a bad request is a
``ValueError`` that names the value, and nothing else is touched.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec

from axon.config import LoRAConfig, ModelConfig
from axon.engine.messages import EngineCoreRequest
from axon.engine.tokenizer import NO_TOKENIZER
from axon.lora.request import LoRAInput
from axon.model.layers.lora import decoder_layer_shapes, load_peft_adapter
from axon.multimodal.inputs import ImageInput, PromptEmbeds
from axon.multimodal.prompts import ImagePrompts
from axon.sampling_params import UINT64_MAX, EngineSamplingParams, SamplingParams
from axon.structured_output.backend_xgrammar import validate_structured_outputs

# A prompt: text, {"prompt": text}, or {"prompt_token_ids": [...]}.
PromptType = str | dict[str, Any]


class InputProcessor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: Any, lora_config: LoRAConfig | None = None
    ) -> None:
        assert model_config.max_model_len is not None and model_config.hf_config is not None
        self.max_model_len = model_config.max_model_len
        self.max_logprobs = model_config.max_logprobs
        self.vocab_size = int(model_config.hf_config["vocab_size"])
        self.enable_prompt_embeds = model_config.enable_prompt_embeds
        self.hf_config = model_config.hf_config
        self.lora_config = lora_config
        self._adapters: dict[int, LoRAInput] = {}  # checked adapters, by id
        self.hidden_size = int(model_config.hf_config.get("hidden_size") or 0)
        self.tokenizer = tokenizer
        self.eos_token_id = (
            tokenizer.eos_token_id if tokenizer is not None else _config_eos(model_config.hf_config)
        )
        # A multimodal model's images (None: a text-only model).
        self.images = ImagePrompts.for_model(
            model_config.hf_config,
            model_config.model_path or "",
            model_config.limit_mm_per_prompt,
            model_config.allowed_local_media_path,
        )

    def process(
        self, request_id: str, prompt: PromptType, params: SamplingParams, lora_request: Any = None
    ) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        """A prompt (text, token ids, with images, or as embeddings) -> its text, its token ids
        (a prompt given as embeddings has placeholders) and its validated core requests, run by
        ``lora_request``'s adapter (a LoRARequest) if given."""
        lora = self.lora(lora_request) if lora_request is not None else None
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            embeds = self.prompt_embeds(prompt)
            token_ids = [0] * embeds.num_tokens
            return (
                None,
                token_ids,
                self.process_n(request_id, token_ids, params, prompt_embeds=embeds, lora=lora),
            )
        text, token_ids, images = self.tokenize_multimodal(prompt)
        return text, token_ids, self.process_n(request_id, token_ids, params, images, lora=lora)

    def lora(self, request: Any) -> LoRAInput:
        """A LoRARequest's adapter, its folder checked against the model once per id."""
        if self.lora_config is None or not self.lora_config.enable_lora:
            raise ValueError("a LoRA adapter needs the engine started with enable_lora (--enable-lora)")
        known = self._adapters.get(request.lora_int_id)
        lora = LoRAInput(request.lora_name, request.lora_int_id, request.lora_path)
        if known is not None:
            if known != lora:
                raise ValueError(
                    f"lora_int_id {lora.int_id} already names adapter {known.name!r} at {known.path}"
                )
            return known
        load_peft_adapter(
            lora.path, lora.name, decoder_layer_shapes(self.hf_config), self.lora_config.max_lora_rank
        )
        self._adapters[lora.int_id] = lora
        return lora

    def tokenize_multimodal(
        self, prompt: PromptType
    ) -> tuple[str | None, list[int], list[ImageInput] | None]:
        """``tokenize``, and the images of ``{"multi_modal_data": {"image": ...}}`` (one image or a
        list: PIL images, bytes or data URLs) with their placeholders expanded in the token ids."""
        text, token_ids = self.tokenize(prompt)
        if isinstance(prompt, dict) and prompt.get("multi_modal_inputs"):
            # Already processed (the server expands a chat's images before it checks lengths).
            return text, token_ids, list(prompt["multi_modal_inputs"])
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return text, token_ids, None
        if not isinstance(data, dict):
            kind = type(data).__name__
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': ...}}, got {kind}")  # noqa: TRY004
        if self.images is None:
            raise ValueError("this model takes no images or other multimodal data (it has no vision tower)")
        unknown = sorted(set(data) - {"image"})
        if unknown:
            raise ValueError(f"multi_modal_data: {unknown} not supported; this model takes 'image'")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, list | tuple) else [images]
        token_ids, inputs = self.images.expand(token_ids, images)
        return text, token_ids, inputs or None

    def prompt_embeds(self, prompt: dict[str, Any]) -> PromptEmbeds:
        """A ``{"prompt_embeds": tensor [num_tokens, hidden]}`` prompt's embeddings, checked."""
        import torch

        embeds = prompt["prompt_embeds"]
        if not self.enable_prompt_embeds:
            raise ValueError(
                "prompt_embeds needs the engine started with enable_prompt_embeds (--enable-prompt-embeds)"
            )
        others = sorted(set(prompt) - {"prompt_embeds"})
        if others:
            raise ValueError(f"a prompt_embeds prompt takes nothing else, got {others}")
        if not isinstance(embeds, torch.Tensor):
            raise ValueError(  # noqa: TRY004 (a bad request: every input error is a ValueError)
                f"prompt_embeds must be a torch.Tensor [num_tokens, hidden], got {type(embeds).__name__}"
            )
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds[0]
        if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != self.hidden_size:
            raise ValueError(
                f"prompt_embeds must have shape [num_tokens, {self.hidden_size}] (the model's hidden size), "
                f"got {list(embeds.shape)}"
            )
        if embeds.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"prompt_embeds must be float32, bfloat16 or float16, got {embeds.dtype}")
        if not bool(torch.isfinite(embeds).all()):
            raise ValueError("prompt_embeds holds NaN or infinite values")
        data = embeds.detach().to("cpu").contiguous()
        raw = data.view(torch.int16) if data.dtype == torch.bfloat16 else data
        return PromptEmbeds(raw.numpy().tobytes(), str(data.dtype).removeprefix("torch."), *data.shape)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids)."""
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list | tuple) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"])
        raise ValueError(
            f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
            f"got {type(prompt).__name__}"
        )

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise ValueError("the prompt is empty")
        if self.tokenizer is None:
            raise ValueError(NO_TOKENIZER)
        check_valid_unicode(text, "the prompt")  # the tokenizer would raise a TypeError naming nothing
        return list(self.tokenizer.encode(text))

    def process_n(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list[ImageInput] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
        lora: LoRAInput | None = None,
    ) -> list[EngineCoreRequest]:
        """One core request per sample of ``params.n``, all validated before any is returned.

        Children get ids ``{index}_{request_id}`` and, when seeded, seeds ``seed + index``
        (wrapped into the seed's uint64 range).
        """
        engine_params = self.engine_params(prompt_token_ids, params)
        if prompt_embeds is not None and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot be computed for a prompt given as embeddings")
        kv_transfer_params = _kv_transfer_params(params)
        if images is not None and kv_transfer_params is not None:
            raise ValueError("kv_transfer_params cannot carry a prompt's images")
        if params.n == 1:
            return [
                self._request(
                    request_id,
                    prompt_token_ids,
                    engine_params,
                    kv_transfer_params,
                    images,
                    prompt_embeds,
                    lora,
                )
            ]
        if kv_transfer_params is not None:
            raise ValueError(f"kv_transfer_params needs n=1 (one sequence per transfer), got n={params.n}")
        return [
            self._request(
                f"{index}_{request_id}",
                prompt_token_ids,
                _child_params(engine_params, index),
                images=images,
                prompt_embeds=prompt_embeds,
                lora=lora,
            )
            for index in range(params.n)
        ]

    def engine_params(self, prompt_token_ids: list[int], params: SamplingParams) -> EngineSamplingParams:
        """Every check that needs the model, then the engine's resolved record of ``params``."""
        self.validate_prompt(prompt_token_ids)
        room = self.max_model_len - len(prompt_token_ids)
        if params.min_tokens > room:
            raise ValueError(
                f"min_tokens {params.min_tokens} cannot be reached: the prompt leaves {room} tokens "
                f"of max_model_len {self.max_model_len}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} {value} exceeds max_logprobs {self.max_logprobs}")
        if params.structured_outputs is not None:
            validate_structured_outputs(params.structured_outputs)
        if params.stop and not params.detokenize:
            raise ValueError(
                "stop strings need detokenize=True: they are found in the text (stop_token_ids work)"
            )
        if self.tokenizer is None and (params.stop or params.structured_outputs is not None):
            what = "stop strings" if params.stop else "structured outputs"
            raise ValueError(f"{what} need a tokenizer: {NO_TOKENIZER} (stop_token_ids work)")
        return params.for_engine(self.eos_token_id, self.vocab_size, default_max_tokens=room)

    def _request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: EngineSamplingParams,
        kv_transfer_params: dict[str, Any] | None = None,
        images: list[ImageInput] | None = None,
        prompt_embeds: PromptEmbeds | None = None,
        lora: LoRAInput | None = None,
    ) -> EngineCoreRequest:
        salt = "images:" + ",".join(i.digest for i in images) if images else None
        if prompt_embeds is not None:  # its placeholder ids hit only the same embeddings
            salt = "embeds:" + hashlib.sha256(prompt_embeds.data).hexdigest() + prompt_embeds.dtype
        if lora is not None:  # an adapter's KV is its own
            salt = f"lora:{lora.int_id}|{salt or ''}"
        return EngineCoreRequest(
            req_id=req_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time(),
            # The images' digests join the prefix-cache keys (as a salt of the first block, which
            # every later block's hash chains on): the same text with another image never hits.
            cache_salt=salt,
            kv_transfer_params=kv_transfer_params,
            images=images,
            prompt_embeds=prompt_embeds,
            lora=lora,
        )

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len}: it must be "
                f"shorter, to leave room for at least one generated token"
            )
        validate_token_ids(prompt_token_ids, self.vocab_size)


def check_valid_unicode(text: str, what: str) -> None:
    """A ValueError if ``text`` holds a lone surrogate (JSON can carry one; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} holds a lone surrogate at character {e.start}: not valid Unicode") from None


def validate_token_ids(prompt_token_ids: list[int], vocab_size: int) -> None:
    """The checks every prompt passes, generated from or embedded: not empty, in the vocabulary."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty (0 tokens)")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _config_eos(hf_config: dict[str, Any]) -> int | None:
    """The end-of-sequence id of a model without a tokenizer: its config's (the first of a list)."""
    eos = hf_config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos if isinstance(eos, int) else None


def _child_params(params: EngineSamplingParams, index: int) -> EngineSamplingParams:
    """Sample ``index`` of n: its own seed when seeded, so the samples differ but repeat."""
    if params.seed is None:
        return params
    seed = params.seed + index
    if seed > UINT64_MAX:
        seed -= 2**64  # the same low 64 bits: torch's generator reads the seed modulo 2**64
    return msgspec.structs.replace(params, seed=seed)


def _kv_transfer_params(params: SamplingParams) -> dict[str, Any] | None:
    """``extra_args["kv_transfer_params"]``, checked to be a JSON object (vLLM's protocol)."""
    value = (params.extra_args or {}).get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object, got {value!r}")
    return value
