"""POST /v1/chat/completions: messages -> chat template -> engine -> message or SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from axon.entrypoints.openai.errors import OpenAIError, bad_request
from axon.entrypoints.openai.protocol import (
    ChatCompletionLogprobs,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprob,
    ChatLogprobsContent,
    DeltaMessage,
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
    usage,
)
from axon.outputs import CompletionOutput, Logprob
from axon.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_model(request.model)
        self.check_accepting()
        self.check_unsupported(request)
        _check_chat_unsupported(request)
        _, prompt_token_ids = self.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            request.chat_template_kwargs,
            request.add_special_tokens,
        )
        if request.truncate_prompt_tokens is not None:
            prompt_token_ids = prompt_token_ids[-request.truncate_prompt_tokens :]
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(len(prompt_token_ids), max_tokens, "messages")
        params = self.sampling_params(request, max_tokens, _num_logprobs(request))
        self.validate(prompt_token_ids, params)
        request_id = f"chatcmpl-{request.request_id or random_uuid()}"
        self.log_request(request_id, None, prompt_token_ids, params)
        ticket = self.ctx.admission.admit(params.n)
        try:
            stream = self.open_stream(
                request_id, [prompt_token_ids], params, None if request.stream else raw_request
            )
        except Exception:
            ticket.release()
            raise
        if request.stream:
            chunks = self._stream(request, request_id, stream, params, len(prompt_token_ids), ticket)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            return await self._full(request, request_id, stream, params, len(prompt_token_ids))
        finally:
            ticket.release()

    async def _full(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        stream: OutputStream,
        params: SamplingParams,
        num_prompt_tokens: int,
    ) -> Response:
        states = [ChoiceState() for _ in range(params.n)]
        try:
            async for _, output in stream:
                for completion in output.outputs:
                    states[completion.index].add(completion)
        except ServerShutdown:
            for state in states:
                state.finish_reason = state.finish_reason or "abort"
        choices = [
            ChatCompletionResponseChoice(
                index=i,
                message=ChatCompletionMessage(content=s.text),
                logprobs=self._logprobs(s.token_ids, s.logprobs, request),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(states)
        ]
        response = ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=choices, usage=usage(num_prompt_tokens, states)
        )
        return Response(response.model_dump_json(), media_type="application/json")

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        stream: OutputStream,
        params: SamplingParams,
        num_prompt_tokens: int,
        ticket: Ticket,
    ) -> AsyncIterator[str]:
        chunk = _ChunkMaker(request_id, self.model_name, request, num_prompt_tokens)
        states = [ChoiceState() for _ in range(params.n)]
        try:
            for i in range(params.n):
                yield chunk(i, DeltaMessage(role="assistant", content=""), states)
            try:
                async for _, output in stream:
                    for c in output.outputs:
                        states[c.index].add(c)
                        logprobs = self._logprobs(c.token_ids, c.logprobs or [], request)
                        yield chunk(c.index, DeltaMessage(content=c.text), states, logprobs, c)
            except ServerShutdown:
                for i, state in enumerate(states):
                    if state.finish_reason is None:
                        state.finish_reason = "abort"
                        yield chunk(i, DeltaMessage(content=""), states, finish=state)
            if chunk.include_usage:
                yield chunk.usage_only(states)
        except OpenAIError as e:
            yield sse(_json(e.body()))
        except Exception as e:  # noqa: BLE001 (the engine died mid-stream: the stream says so)
            yield sse(
                _json({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
            )
        finally:
            ticket.release()
            stream.close()
        yield SSE_DONE

    def _logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]], request: ChatCompletionRequest
    ) -> ChatCompletionLogprobs | None:
        if not request.logprobs:
            return None
        top_n = request.top_logprobs or 0
        content = []
        for token_id, row in zip(token_ids, logprobs, strict=True):
            sampled = row[token_id]
            tops = sorted(row.items(), key=lambda item: _rank(item[1]))[:top_n]
            content.append(
                ChatLogprobsContent(
                    **_chat_logprob(self._token_str(token_id, sampled), sampled.logprob),
                    top_logprobs=[
                        ChatLogprob(**_chat_logprob(self._token_str(t, lp), lp.logprob)) for t, lp in tops
                    ],
                )
            )
        return ChatCompletionLogprobs(content=content)

    def _token_str(self, token_id: int, logprob: Logprob) -> str:
        if logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])


class _ChunkMaker:
    """Builds one SSE chunk of a chat stream (id, created and model fixed per request)."""

    def __init__(self, request_id: str, model: str, request: ChatCompletionRequest, num_prompt_tokens: int):
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.include_usage and options.continuous_usage_stats)

    def __call__(
        self,
        index: int,
        delta: DeltaMessage,
        states: list[ChoiceState],
        logprobs: ChatCompletionLogprobs | None = None,
        finish: ChoiceState | CompletionOutput | None = None,
    ) -> str:
        choice = ChatCompletionResponseStreamChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish.finish_reason if finish is not None else None,
            stop_reason=finish.stop_reason if finish is not None else None,
        )
        response = ChatCompletionStreamResponse(
            id=self.request_id, created=self.created, model=self.model, choices=[choice]
        )
        if self.continuous_usage:
            response.usage = usage(self.num_prompt_tokens, states)
        return sse(response.model_dump_json())

    def usage_only(self, states: list[ChoiceState]) -> str:
        response = ChatCompletionStreamResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage(self.num_prompt_tokens, states),
        )
        return sse(response.model_dump_json())


def _check_chat_unsupported(request: ChatCompletionRequest) -> None:
    if request.tools:
        raise bad_request("tool calling is not supported yet", param="tools")
    if request.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tools, which are not supported yet", param="tool_choice")
    if request.response_format is not None and request.response_format.get("type") != "text":
        raise bad_request("response_format other than text is not supported yet", param="response_format")
    if request.echo:
        raise bad_request("echo is not supported for chat completions", param="echo")
    if request.top_logprobs and not request.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true", param="top_logprobs")
    if request.top_logprobs is not None and request.top_logprobs < 0:
        raise bad_request("top_logprobs must be non-negative", param="top_logprobs")


def _num_logprobs(request: ChatCompletionRequest) -> int | None:
    return (request.top_logprobs or 0) if request.logprobs else None


def _rank(logprob: Logprob) -> int:
    return logprob.rank if logprob.rank is not None else 1 << 30


def _chat_logprob(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": clamp_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def _json(body: dict) -> str:
    return json.dumps(body)
