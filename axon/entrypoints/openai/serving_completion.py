"""POST /v1/completions: one or more prompts (text or token ids) -> text or SSE chunks.

Choice ``prompt_index * n + i`` is sample ``i`` of prompt ``prompt_index``, as in vLLM.
Logprobs take OpenAI's legacy shape (tokens, token_logprobs, top_logprobs, text_offset); with
``echo`` the prompt's tokens come first, the first of them without a logprob.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from axon.entrypoints.openai.errors import bad_request, from_exception
from axon.entrypoints.openai.protocol import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from axon.entrypoints.openai.serving_engine import (
    SSE_DONE,
    ChoiceState,
    OpenAIServing,
    OutputStream,
    ServerShutdown,
    Ticket,
    clamp_logprob,
    sse,
    token_text,
    usage,
)
from axon.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from axon.sampling_params import SamplingParams


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]  # a prompt given as embeddings: placeholders, one per row
    embeds: Any = None  # its [num_tokens, hidden] tensor

    def engine_prompt(self) -> dict[str, Any]:
        return (
            {"prompt_embeds": self.embeds}
            if self.embeds is not None
            else {"prompt_token_ids": self.token_ids}
        )


# One position's logprobs: token id -> Logprob (None: the first prompt token, which has none).
Row = dict[int, Logprob] | None


def _prompt_list(prompt: list[int] | list[list[int]] | str | list[str]) -> list[str | list[int]]:
    """The request's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [[int(t) for t in prompt]]  # type: ignore[arg-type]  # one prompt of token ids
    return list(prompt)  # type: ignore[arg-type]  # pydantic checked: all str or all list[int]


def fim_tokens(tokenizer: Any) -> tuple[str, str, str] | None:
    """The tokenizer's fill-in-the-middle markers (prefix, suffix, middle), if it has a set."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for style in ("<|fim_{}|>", "<fim_{}>", "<fim-{}>"):
        names = tuple(style.format(part) for part in ("prefix", "suffix", "middle"))
        if all(name in vocab for name in names):
            return names  # type: ignore[return-value]
    return None


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_accepting()
        self.check_unsupported(request)
        if request.suffix is not None:
            request.prompt = self._fill_in_the_middle(request.prompt, request.suffix)
        prompts = await self._prompts(request)
        if request.echo and request.logprobs is not None and request.prompt_logprobs is None:
            request.prompt_logprobs = request.logprobs
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        request_id = f"cmpl-{request.request_id or random_uuid()}"
        for prompt in prompts:
            self.check_length(len(prompt.token_ids), request.max_tokens, "prompt")
            self.validate(prompt.token_ids, params)
            self.log_request(request_id, prompt.text, prompt.token_ids, params)
        ticket = self.ctx.admission.admit(params.n * len(prompts))
        try:
            engine_prompts = [p.engine_prompt() for p in prompts]
            stream = self.open_stream(
                request_id,
                engine_prompts,
                params,
                None if request.stream else raw_request,
                lora_request=self.lora_request(request.model),
            )
        except Exception:
            ticket.release()
            raise
        run = _Run(self, request, request_id, prompts, params)
        if request.stream:
            return StreamingResponse(run.stream(stream, ticket), media_type="text/event-stream")
        try:
            return await run.full(stream)
        finally:
            ticket.release()

    def _fill_in_the_middle(self, prompt: Any, suffix: str) -> str | list[str]:
        """``suffix``: the prompt is the text before a gap and the suffix the text after it,
        written in the tokenizer's fill-in-the-middle tokens (prefix, suffix, middle: Qwen's
        ``<|fim_prefix|>`` or StarCoder's ``<fim_prefix>``), so the model writes the middle."""
        tokens = fim_tokens(self.tokenizer)
        if tokens is None:
            raise bad_request(
                "suffix needs a model whose tokenizer has fill-in-the-middle tokens (<|fim_prefix|>, "
                "<|fim_suffix|>, <|fim_middle|> or <fim_prefix>, ...); this model's has none",
                param="suffix",
            )
        texts = [prompt] if isinstance(prompt, str) else prompt
        if not all(isinstance(t, str) for t in texts):
            raise bad_request("suffix needs text prompts, not token ids", param="suffix")
        pre, suf, mid = tokens
        out = [f"{pre}{text}{suf}{suffix}{mid}" for text in texts]
        return out[0] if isinstance(prompt, str) else out

    async def _prompts(self, request: CompletionRequest) -> list[_Prompt]:
        out = []
        if request.prompt_embeds is not None:
            if request.echo:
                raise bad_request("echo cannot repeat a prompt given as embeddings", param="echo")
            if request.truncate_prompt_tokens is not None:
                raise bad_request(
                    "truncate_prompt_tokens cannot cut a prompt given as embeddings",
                    param="truncate_prompt_tokens",
                )
            items = (
                [request.prompt_embeds] if isinstance(request.prompt_embeds, str) else request.prompt_embeds
            )
            out += [self._embeds_prompt(item, i) for i, item in enumerate(items)]
        elif request.prompt is None:
            raise bad_request("give prompt (or prompt_embeds)", param="prompt")
        if request.prompt is not None:
            out += [
                await self._prompt(item, request.add_special_tokens) for item in _prompt_list(request.prompt)
            ]
        if request.truncate_prompt_tokens is not None:
            for p in out:
                p.token_ids = p.token_ids[-request.truncate_prompt_tokens :]
        return out

    def _embeds_prompt(self, item: str, index: int) -> _Prompt:
        """One base64 ``torch.save``d tensor (vLLM's format), loaded without running code."""
        param = "prompt_embeds"
        try:
            tensor = torch.load(io.BytesIO(base64.b64decode(item, validate=True)), weights_only=True)
        except Exception as e:  # noqa: BLE001 (any undecodable input is the client's 400)
            raise bad_request(
                f"prompt_embeds[{index}] is not a base64 torch.save'd tensor: {e}", param=param
            ) from None
        try:
            embeds = self.engine.input_processor.prompt_embeds({"prompt_embeds": tensor})
        except ValueError as e:
            raise bad_request(f"prompt_embeds[{index}]: {e}", param=param) from None
        return _Prompt(None, [0] * embeds.num_tokens, tensor)

    async def _prompt(self, item: str | list[int], add_special_tokens: bool) -> _Prompt:
        if not item:
            raise bad_request("the prompt is empty", param="prompt")
        if isinstance(item, str):
            return _Prompt(item, await self.encode(item, add_special_tokens, "prompt"))
        return _Prompt(None, list(item))

    def prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is None:
            prompt.text = "" if self.tokenizer is None else self.tokenizer.decode(prompt.token_ids)
        return prompt.text

    def token_str(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return token_text(self.tokenizer, token_id)


class _Run:
    """One completion request's responses, full or streamed."""

    def __init__(
        self,
        serving: OpenAIServingCompletion,
        request: CompletionRequest,
        request_id: str,
        prompts: list[_Prompt],
        params: SamplingParams,
    ) -> None:
        self.serving = serving
        self.request = request
        self.request_id = request_id
        self.prompts = prompts
        self.n = params.n
        self.echo = bool(request.echo)
        self.created = int(time.time())
        self.states = [ChoiceState() for _ in range(len(prompts) * params.n)]
        self.prompt_logprobs: dict[int, PromptLogprobs | None] = {}
        self.num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        self.kv_transfer_params: dict[str, Any] | None = None

    async def full(self, stream: OutputStream) -> Response:
        try:
            async for prompt_index, output in stream:
                self.prompt_logprobs[prompt_index] = output.prompt_logprobs
                self.kv_transfer_params = output.kv_transfer_params or self.kv_transfer_params
                for c in output.outputs:
                    self.states[prompt_index * self.n + c.index].add(c)
        except ServerShutdown:
            for state in self.states:
                state.finish_reason = state.finish_reason or "abort"
        choices = [self._choice(i, s) for i, s in enumerate(self.states)]
        response = CompletionResponse(
            id=self.request_id,
            model=self.serving.model_name,
            choices=choices,
            usage=usage(self.num_prompt_tokens, self.states),
            kv_transfer_params=self.kv_transfer_params,
        )
        return Response(response.model_dump_json(), media_type="application/json")

    def _choice(self, index: int, state: ChoiceState) -> CompletionResponseChoice:
        prompt_index = index // self.n
        text, logprobs = state.text, None
        echo = self.echo
        if self.request.logprobs is not None:
            ids, rows = self._echo_logprobs(prompt_index) if echo else ([], [])
            rows += state.logprobs
            logprobs = self._legacy_logprobs(ids + state.token_ids, rows, 0)
        if echo:
            text = self.serving.prompt_text(self.prompts[prompt_index]) + text
        return CompletionResponseChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )

    async def stream(self, stream: OutputStream, ticket: Ticket) -> AsyncIterator[str]:
        try:
            try:
                async for prompt_index, output in stream:
                    for c in output.outputs:
                        yield self._chunk(prompt_index, output, c)
            except ServerShutdown:
                for i, state in enumerate(self.states):
                    if state.finish_reason is None:
                        state.finish_reason = "abort"
                        yield self._send(
                            CompletionResponseStreamChoice(index=i, text="", finish_reason="abort")
                        )
            options = self.request.stream_options
            if options is not None and options.include_usage:
                yield self._send(None, with_usage=True)
        except Exception as e:  # noqa: BLE001 (e.g. the engine died mid-stream: the stream says so)
            yield sse(json.dumps(from_exception(e).body()))
        finally:
            ticket.release()
            stream.close()
        yield SSE_DONE

    def _chunk(self, prompt_index: int, output: RequestOutput, c: CompletionOutput) -> str:
        index = prompt_index * self.n + c.index
        state = self.states[index]
        first = not state.texts
        self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        state.add(c)
        text, ids = c.text, list(c.token_ids)
        rows: list[Row] = list(c.logprobs or [])
        if first and self.echo:
            text = self.serving.prompt_text(self.prompts[prompt_index]) + text
            echo_ids, echo_rows = self._echo_logprobs(prompt_index)
            ids, rows = echo_ids + ids, echo_rows + rows
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self._legacy_logprobs(ids, rows, state.num_chars_sent)
        state.num_chars_sent += len(text)
        choice = CompletionResponseStreamChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return self._send(choice)

    def _send(self, choice: CompletionResponseStreamChoice | None, with_usage: bool = False) -> str:
        options = self.request.stream_options
        continuous = bool(options and options.include_usage and options.continuous_usage_stats)
        response = CompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.serving.model_name,
            choices=[choice] if choice is not None else [],
            usage=usage(self.num_prompt_tokens, self.states) if with_usage or continuous else None,
        )
        return sse(response.model_dump_json())

    def _echo_logprobs(self, prompt_index: int) -> tuple[list[int], list[Row]]:
        ids = self.prompts[prompt_index].token_ids
        rows = list(self.prompt_logprobs.get(prompt_index) or [])
        rows += [None] * (len(ids) - len(rows))
        return list(ids), rows[: len(ids)]

    def _legacy_logprobs(
        self, token_ids: list[int], rows: list[Row], initial_offset: int
    ) -> CompletionLogprobs:
        top_n = self.request.logprobs or 0
        out = CompletionLogprobs()
        offset = initial_offset
        for token_id, row in zip(token_ids, rows, strict=True):
            sampled = row.get(token_id) if row is not None else None
            token = self.serving.token_str(token_id, sampled)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            out.token_logprobs.append(clamp_logprob(sampled.logprob) if sampled is not None else None)
            out.top_logprobs.append(self._top(row, token_id, top_n) if row is not None else None)
        return out

    def _top(self, row: dict[int, Logprob], token_id: int, top_n: int) -> dict[str, float]:
        """The top ``top_n`` tokens, plus the sampled one (as vLLM and OpenAI include it)."""
        chosen = [(t, lp) for t, lp in row.items() if t == token_id or (lp.rank or 0) <= top_n]
        return {self.serving.token_str(t, lp): clamp_logprob(lp.logprob) for t, lp in chosen}
