"""What every endpoint family shares: model names, admission (the bounded waiting queue),
prompt checks with vLLM's messages, SamplingParams from a request, request logging, and
``OutputStream``, which runs engine generators so that a disconnect or a shutdown aborts them.

Chat-template rendering and tokenization run on ``ServingContext.prompt_pool``, never on the
event loop: one long prompt or heavy template must not freeze /health and every other client.
A prompt with more characters than ``max_model_len`` tokens can hold is refused before it is
tokenized, so a multi-megabyte prompt costs a length check, not seconds of tokenizer time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from axon.engine.async_llm import AsyncLLM
from axon.engine.pooling_inputs import PoolingInput
from axon.engine.tokenizer import NO_TOKENIZER, PromptTooLong, render_chat
from axon.entrypoints.openai.errors import bad_request, model_not_found, unavailable
from axon.entrypoints.openai.protocol import ChatMessage, SamplingFields, UsageInfo
from axon.entrypoints.openai.structured_outputs import structured_outputs_from_request
from axon.entrypoints.openai.tool_choice import tool_message_fields
from axon.lora.request import LoRARequest
from axon.multimodal.prompts import split_chat_images
from axon.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from axon.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("axon.entrypoints.openai")

T = TypeVar("T")


def _prompt_pool() -> ThreadPoolExecutor:
    """Threads for rendering and tokenizing, one per core: the tokenizers library releases the
    GIL while it encodes, and a jinja render, which holds it, still yields it to the event loop
    every switch interval (5 ms), so /health keeps answering within milliseconds."""
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="axon-prompt")


class Admission:
    """Bounds the requests waiting beyond what the engine runs (``--max-waiting-requests``).

    Counts sequences (n per request) from admission until their response ends; each of the
    ``num_engines`` engine cores (``--data-parallel-size``) runs at most ``max_num_seqs`` of
    them, so beyond ``max_running_seqs`` the rest are waiting.
    """

    def __init__(self, max_num_seqs: int, max_waiting_requests: int | None, num_engines: int = 1) -> None:
        self.max_num_seqs = max_num_seqs  # per core: a request's n samples run on one core
        self.max_running_seqs = max_num_seqs * num_engines
        self.max_waiting_requests = max_waiting_requests
        self.num_inflight_seqs = 0
        self._running_flags = f"--max-num-seqs {max_num_seqs}" + (
            f" times --data-parallel-size {num_engines}" if num_engines > 1 else ""
        )

    @property
    def num_waiting(self) -> int:
        return max(self.num_inflight_seqs - self.max_running_seqs, 0)

    def admit(self, num_seqs: int) -> Ticket:
        limit = self.max_waiting_requests
        if limit is not None and num_seqs > self.max_running_seqs + limit:
            # More than could ever be admitted: retrying cannot help, so this is the client's error.
            raise bad_request(
                f"The request asks for {num_seqs} sequences (n times the prompts); at most "
                f"{self.max_running_seqs + limit} can be admitted ({self._running_flags} "
                f"plus --max-waiting-requests {limit}).",
                param="n",
            )
        if limit is not None and self.num_inflight_seqs + num_seqs - self.max_running_seqs > limit:
            raise unavailable(
                f"The server is overloaded: {self.num_waiting} requests are waiting "
                f"(--max-waiting-requests {limit}). Retry later.",
                code="server_overloaded",
            )
        self.num_inflight_seqs += num_seqs
        return Ticket(self, num_seqs)


@dataclass
class Ticket:
    admission: Admission
    num_seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.num_inflight_seqs -= self.num_seqs


@dataclass
class ServingContext:
    engine: AsyncLLM
    served_model_names: list[str]
    model_path: str
    max_model_len: int
    admission: Admission
    shutdown_event: asyncio.Event
    log_requests: bool = False
    max_log_len: int | None = None
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    # Tool calling and reasoning (vLLM's --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    # LoRA adapters served as models of their own name (--lora-modules, /v1/load_lora_adapter)
    lora_modules: dict[str, LoRARequest] = field(default_factory=dict)
    prompt_pool: ThreadPoolExecutor = field(default_factory=_prompt_pool)

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """An upper bound on the characters of a prompt that fits in ``max_model_len`` tokens:
        no token stands for more characters than its vocabulary entry has (byte-level entries
        have one character per byte, SentencePiece ones one per character)."""
        vocab = self.engine.get_tokenizer().get_vocab()
        return self.max_model_len * max(8, max(map(len, vocab), default=0))


class ClientGone(Exception):
    """The client disconnected before its response was complete; the request was aborted."""


class ServerShutdown(Exception):
    """The server is shutting down; the request was aborted."""


class OpenAIServing:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.tokenizer = ctx.engine.get_tokenizer()
        self.max_model_len = ctx.max_model_len

    # ---- checks --------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.ctx.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if (
            model is not None
            and model not in self.ctx.served_model_names
            and model not in self.ctx.lora_modules
        ):
            raise model_not_found(model)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        return self.ctx.lora_modules.get(model) if model is not None else None

    def check_accepting(self) -> None:
        if self.ctx.shutdown_event.is_set():
            raise unavailable("The server is shutting down.", code="shutting_down")
        if self.engine.errored:
            # The cause (a traceback) is in the log, never in a response.
            raise unavailable("The engine is dead; the server is shutting down.", code="engine_dead")
        if self.engine.sleeping:
            raise unavailable("The engine is sleeping: POST /wake_up first.", code="engine_sleeping")

    def check_unsupported(self, request: SamplingFields) -> None:
        if request.use_beam_search:
            raise bad_request("beam search is not supported", param="use_beam_search")
        if request.best_of is not None and request.best_of != (request.n or 1):
            raise bad_request("best_of is not supported (it must equal n)", param="best_of")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options can only be set when stream is true", param="stream_options")
        if request.model_extra:
            logger.warning("ignored unknown request fields: %s", sorted(request.model_extra))

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, what: str = "messages") -> None:
        """vLLM's context-length messages (400, code ``context_length_exceeded``)."""
        limit = self.max_model_len
        if max_tokens is None and num_prompt_tokens >= limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens} tokens in the {what}, Please reduce the length of the {what}."
            )
        elif max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {what}, "
                f"{max_tokens} in the completion). Please reduce the length of the {what} or completion."
            )
        else:
            return
        raise bad_request(message, param=what, code="context_length_exceeded")

    # ---- prompts and parameters ------------------------------------------------------------
    def check_prompt_chars(self, num_chars: int, what: str) -> None:
        """Refuse, before tokenizing, a prompt too long to fit in ``max_model_len`` tokens."""
        if num_chars > self.ctx.max_prompt_chars:
            raise bad_request(
                f"The {what} has {num_chars} characters, more than {self.ctx.max_prompt_chars} "
                f"({self.max_model_len} tokens, the model's maximum context length, of at most "
                f"{self.ctx.max_prompt_chars // self.max_model_len} characters each). Please reduce "
                f"the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )

    def check_request_chat_template(self, chat_template: str | None) -> None:
        if chat_template is not None and not self.ctx.trust_request_chat_template:
            raise bad_request(
                "chat_template in a request is refused: a template is code the server runs. "
                "The server's operator can allow it with --trust-request-chat-template.",
                param="chat_template",
            )

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the prompt pool, so that the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.ctx.prompt_pool, fn, *args)

    async def encode(self, text: str, add_special_tokens: bool, what: str) -> list[int]:
        """Text -> token ids off the loop. The length bound holds with ``truncate_prompt_tokens``
        too: tokenizing a text that long costs a worker seconds to minutes, whatever is kept."""
        if self.tokenizer is None:
            raise bad_request(NO_TOKENIZER, param=what)
        self.check_prompt_chars(len(text), what)
        return await self.off_loop(_encode, self.tokenizer, text, add_special_tokens)

    async def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int], list[Any]]:
        """Chat messages -> (prompt text, token ids, image URLs) through the chat template, off the
        loop. Image parts reach the template as ``{"type": "image"}``, their URLs come back."""
        if self.tokenizer is None:
            raise bad_request(f"a chat needs a tokenizer: {NO_TOKENIZER}", param="messages")
        self.check_request_chat_template(chat_template)
        conversation, images = split_chat_images([_message_dict(m, i) for i, m in enumerate(messages)])
        # Messages already too long need no rendering; the rendered text is checked again.
        self.check_prompt_chars(sum(_text_chars(m["content"]) for m in conversation), "messages")
        try:
            text, token_ids = await self.off_loop(
                functools.partial(
                    render_chat,
                    self.tokenizer,
                    conversation,
                    chat_template,
                    add_generation_prompt,
                    continue_final_message,
                    chat_template_kwargs,
                    add_special_tokens,
                    max_chars=self.ctx.max_prompt_chars,
                )
            )
        except PromptTooLong as e:
            self.check_prompt_chars(e.num_chars, "messages")
            raise
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        return text, token_ids, images

    async def expand_images(
        self, token_ids: list[int], images: list[Any]
    ) -> tuple[list[int], list[Any] | None]:
        """A rendered chat's prompt with its images' placeholders expanded, and the processed
        images (fetched, decoded and cut into patches off the loop); a bad image is a 400."""
        if not images:
            return token_ids, None
        prompts = self.engine.input_processor.images
        if prompts is None:
            raise bad_request("this model takes no images (it has no vision tower)", param="messages")
        try:
            return await self.off_loop(prompts.expand, token_ids, images)
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e

    def sampling_params(
        self, request: SamplingFields, max_tokens: int | None, logprobs: int | None
    ) -> SamplingParams:
        try:
            params = SamplingParams(
                n=request.n if request.n is not None else 1,
                presence_penalty=_or(request.presence_penalty, 0.0),
                frequency_penalty=_or(request.frequency_penalty, 0.0),
                repetition_penalty=_or(request.repetition_penalty, 1.0),
                temperature=_or(request.temperature, 1.0),
                top_p=_or(request.top_p, 1.0),
                top_k=_or(request.top_k, 0),
                min_p=_or(request.min_p, 0.0),
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=request.prompt_logprobs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                logit_bias=_logit_bias(request.logit_bias),
                structured_outputs=structured_outputs_from_request(request),
                extra_args=(
                    None
                    if request.kv_transfer_params is None
                    else {"kv_transfer_params": request.kv_transfer_params}
                ),
            )
        except ValueError as e:  # SamplingParams' messages begin with the field's name
            name = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=name if name in type(request).model_fields else None) from e
        self.check_n(params.n)
        return params

    def check_n(self, n: int) -> None:
        """n is capped at ``--max-num-seqs``: one request's samples fit in the running batch
        (of the one engine core they all go to) together, and a client cannot hold the engine
        for minutes (or never be admitted)."""
        max_num_seqs = self.ctx.admission.max_num_seqs
        if n > max_num_seqs:
            raise bad_request(
                f"n must be at most {max_num_seqs} (--max-num-seqs, the most sequences an engine "
                f"core runs at once), got {n}.",
                param="n",
            )

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Every check the engine makes, before anything is queued or a stream begins."""
        try:
            self.engine.input_processor.process_n("validate", prompt_token_ids, params)
        except ValueError as e:
            raise bad_request(str(e)) from e

    def log_request(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams
    ) -> None:
        if not self.ctx.log_requests:
            return
        n = self.ctx.max_log_len
        logger.info(
            "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s",
            request_id,
            prompt if n is None or prompt is None else prompt[:n],
            params,
            ids if n is None else ids[:n],
        )

    # ---- running requests --------------------------------------------------------------------
    def open_stream(
        self,
        request_id: str,
        prompts: list[list[int]] | list[dict[str, Any]],
        params: SamplingParams,
        raw_request: Request | None,
        images: list[Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> OutputStream:
        """``prompts``: token-id lists, or engine prompts (``{"prompt_embeds": ...}``);
        ``images``: a chat prompt's processed images (``expand_images``)."""
        extra = {"multi_modal_inputs": images} if images else {}
        generators = [
            self.engine.generate(
                prompt if isinstance(prompt, dict) else {"prompt_token_ids": prompt, **extra},
                params,
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                RequestOutputKind.DELTA,
                lora_request=lora_request,
            )
            for i, prompt in enumerate(prompts)
        ]
        return OutputStream(generators, self.ctx.shutdown_event, raw_request)

    async def embed_all(
        self, items: list[PoolingInput], raw_request: Request | None
    ) -> list[EmbeddingRequestOutput]:
        """Every item embedded in the engine core, concurrently (batched there with everything
        else); a disconnect, a shutdown or one failure aborts them all."""
        outputs: list[Any] = [None] * len(items)
        stream = OutputStream(
            [_once(self.engine.encode(item)) for item in items], self.ctx.shutdown_event, raw_request
        )
        async for index, output in stream:
            outputs[index] = output
        return outputs


async def _once(result: Any) -> AsyncIterator[Any]:
    """An awaitable as a one-item async generator (``OutputStream`` runs generators)."""
    yield await result


_DONE = object()
_SHUTDOWN = object()
_DISCONNECTED = object()


class OutputStream:
    """Merges engine generators into one stream of (prompt index, RequestOutput).

    Each generator runs in its own task, so aborting never depends on the cancellation scope of
    the HTTP response: ``close()`` cancels the tasks, and a cancelled ``AsyncLLM.generate``
    aborts its request in the engine. The stream ends with ``ServerShutdown`` when the server
    stops, and with ``ClientGone`` when ``raw_request`` (given for non-streaming responses,
    whose disconnects nothing else notices) disconnects.
    """

    def __init__(
        self,
        generators: list[AsyncIterator[RequestOutput]],
        shutdown_event: asyncio.Event,
        raw_request: Request | None,
    ) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.num_open = len(generators)
        self.tasks = [asyncio.create_task(self._pump(i, g)) for i, g in enumerate(generators)]
        self.tasks.append(asyncio.create_task(self._on(shutdown_event.wait(), _SHUTDOWN)))
        if raw_request is not None:
            self.tasks.append(asyncio.create_task(self._on(_wait_disconnect(raw_request), _DISCONNECTED)))

    async def _pump(self, index: int, generator: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in generator:
                self.queue.put_nowait((index, output))
        except Exception as e:  # noqa: BLE001 (delivered to the handler, which answers with it)
            self.queue.put_nowait(e)
        self.queue.put_nowait(_DONE)

    async def _on(self, event: Any, marker: object) -> None:
        await event
        self.queue.put_nowait(marker)

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while self.num_open:
                item = await self.queue.get()
                if item is _DONE:
                    self.num_open -= 1
                elif item is _SHUTDOWN:
                    raise ServerShutdown
                elif item is _DISCONNECTED:
                    raise ClientGone
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            self.close()

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


async def _wait_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token as a logprobs entry names it: its text, or without a tokenizer (skip_tokenizer_init)
    ``token_id:N`` (vLLM's form for tokens as ids)."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as the chat template reads it: text parts joined into one string, or with image
    parts a list of ``{"type": "text", ...}`` and ``{"type": "image_url", ...}`` parts."""
    content = message.content
    if isinstance(content, list):
        texts, parts = [], []
        for part in content:
            if part.type == "image_url" and part.image_url is not None:
                parts.append({"type": "image_url", "image_url": {"url": part.image_url.url}})
                continue
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{index}]: content part type {part.type!r} is not supported "
                    "(only {'type': 'text', 'text': ...} and {'type': 'image_url', 'image_url': {'url': ...}})",
                    param="messages",
                )
            texts.append(part.text)
            parts.append({"type": "text", "text": part.text})
        content = parts if len(parts) > len(texts) else "\n".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    out.update(tool_message_fields(message))
    return out


def _text_chars(content: str | list[dict[str, Any]]) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content)


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    if logit_bias is None:
        return None
    out = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        out[token_id] = value  # SamplingParams rejects values outside [-100, 100], as OpenAI does
    return out


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


@dataclass
class ChoiceState:
    """One choice's output so far, gathered from DELTA outputs."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_chars_sent: int = 0  # text already streamed (the legacy text_offset continues from it)

    def add(self, output: CompletionOutput) -> None:
        self.texts.append(output.text)
        self.token_ids += output.token_ids
        if output.logprobs is not None:
            self.logprobs += output.logprobs
        self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


def usage(num_prompt_tokens: int, states: list[ChoiceState]) -> UsageInfo:
    num_completion_tokens = sum(len(s.token_ids) for s in states)
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt_tokens + num_completion_tokens,
    )


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def clamp_logprob(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf
