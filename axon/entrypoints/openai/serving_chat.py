"""POST /v1/chat/completions: messages -> chat template -> engine -> message or SSE chunks."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from axon.entrypoints.openai.chat_output import ChatOutputParser, ChoiceStreamer
from axon.entrypoints.openai.errors import bad_request, from_exception
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
    token_text,
    usage,
)
from axon.entrypoints.openai.tool_choice import ToolPlan, plan_tools
from axon.outputs import CompletionOutput, Logprob
from axon.reasoning import ReasoningParser, get_reasoning_parser
from axon.sampling_params import SamplingParams
from axon.structured_output.backend_xgrammar import validate_structured_outputs


@dataclasses.dataclass
class ChatRun:
    """A chat request running in the engine, for the endpoint that shapes its answer (chat
    completions here; the Responses and Messages APIs translate to a chat and read it too)."""

    request_id: str
    stream: OutputStream
    params: SamplingParams
    num_prompt_tokens: int
    ticket: Ticket
    parser: ChatOutputParser


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        run = await self.start_chat(request, raw_request, f"chatcmpl-{request.request_id or random_uuid()}")
        if request.stream:
            chunks = self._stream(
                request, run.request_id, run.stream, run.params, run.num_prompt_tokens, run.ticket, run.parser
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            return await self._full(
                request, run.request_id, run.stream, run.params, run.num_prompt_tokens, run.parser
            )
        finally:
            run.ticket.release()

    async def start_chat(
        self, request: ChatCompletionRequest, raw_request: Request | None, request_id: str
    ) -> ChatRun:
        """Check, render and admit ``request`` and start it in the engine. The caller releases
        ``ticket`` when done; ``raw_request`` (None for a streamed or background answer) aborts
        the request if its client leaves."""
        self.check_model(request.model)
        self.check_accepting()
        self.check_unsupported(request)
        _check_chat_unsupported(request)
        prompt_token_ids, images, plan = await self.chat_prompt(request)
        max_tokens = request.max_completion_tokens or request.max_tokens
        self.check_length(len(prompt_token_ids), max_tokens, "messages")
        params = self.sampling_params(request, max_tokens, _num_logprobs(request))
        _constrain_tool_calls(params, plan)
        parser = ChatOutputParser(plan, self._reasoning_parser())
        if parser.needs_special_tokens:  # the parsers read markers that are special tokens
            params.skip_special_tokens = False
        self.validate(prompt_token_ids, params)
        self.log_request(request_id, None, prompt_token_ids, params)
        ticket = self.ctx.admission.admit(params.n)
        try:
            watch = None if request.stream else raw_request
            lora = self.lora_request(request.model)
            stream = self.open_stream(request_id, [prompt_token_ids], params, watch, images, lora)
        except Exception:
            ticket.release()
            raise
        return ChatRun(request_id, stream, params, len(prompt_token_ids), ticket, parser)

    async def chat_prompt(
        self, request: ChatCompletionRequest
    ) -> tuple[list[int], list[Any] | None, ToolPlan]:
        """The request's prompt token ids (images expanded), its images and its tool plan."""
        plan = plan_tools(request, self.ctx.enable_auto_tool_choice, self.ctx.tool_call_parser)
        _, prompt_token_ids, image_urls = await self.render_chat(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            plan.template_kwargs(_template_kwargs(request)),
            request.add_special_tokens,
        )
        if request.truncate_prompt_tokens is not None:
            if image_urls:
                raise bad_request(
                    "truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens"
                )
            prompt_token_ids = prompt_token_ids[-request.truncate_prompt_tokens :]
        prompt_token_ids, images = await self.expand_images(prompt_token_ids, image_urls)
        return prompt_token_ids, images, plan

    async def deltas(self, run: ChatRun) -> AsyncIterator[tuple[DeltaMessage, ChoiceState]]:
        """The first choice's answer as parsed deltas (content, reasoning, tool calls), each with
        the choice's state so far (its finish reason, as OpenAI reports it, on the last)."""
        state, streamer = ChoiceState(), ChoiceStreamer(run.parser)
        try:
            async for _, output in run.stream:
                for c in output.outputs:
                    state.add(c)
                    if run.parser.is_plain:
                        yield DeltaMessage(content=c.text), state
                        continue
                    parsed = _parsed_chunk(streamer, c, run.parser)
                    if parsed is not None:
                        delta, finish = parsed
                        if finish is not None:
                            state.finish_reason = finish.finish_reason
                        yield delta, state
        except ServerShutdown:
            state.finish_reason = state.finish_reason or "abort"
            yield DeltaMessage(), state

    async def message(self, run: ChatRun) -> tuple[ChatCompletionMessage, ChoiceState]:
        """The first choice's whole answer: its message and state (finish reason as OpenAI's)."""
        state = ChoiceState()
        try:
            async for _, output in run.stream:
                for completion in output.outputs:
                    state.add(completion)
        except ServerShutdown:
            state.finish_reason = state.finish_reason or "abort"
        message = _message(state.text, run.parser)
        state.finish_reason = _finish_reason(state.finish_reason, len(message.tool_calls), run.parser)
        return message, state

    async def _full(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        stream: OutputStream,
        params: SamplingParams,
        num_prompt_tokens: int,
        parser: ChatOutputParser,
    ) -> Response:
        states = [ChoiceState() for _ in range(params.n)]
        kv_transfer_params = None
        try:
            async for _, output in stream:
                kv_transfer_params = output.kv_transfer_params or kv_transfer_params
                for completion in output.outputs:
                    states[completion.index].add(completion)
        except ServerShutdown:
            for state in states:
                state.finish_reason = state.finish_reason or "abort"
        choices = []
        for i, s in enumerate(states):
            message = _message(s.text, parser)
            choices.append(
                ChatCompletionResponseChoice(
                    index=i,
                    message=message,
                    logprobs=self._logprobs(s.token_ids, s.logprobs, request),
                    finish_reason=_finish_reason(s.finish_reason, len(message.tool_calls), parser),
                    stop_reason=s.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            model=self.model_name,
            choices=choices,
            usage=usage(num_prompt_tokens, states),
            kv_transfer_params=kv_transfer_params,
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
        parser: ChatOutputParser,
    ) -> AsyncIterator[str]:
        chunk = _ChunkMaker(request_id, self.model_name, request, num_prompt_tokens)
        states = [ChoiceState() for _ in range(params.n)]
        streamers = [ChoiceStreamer(parser) for _ in range(params.n)]
        try:
            for i in range(params.n):
                yield chunk(i, DeltaMessage(role="assistant", content=""), states)
            try:
                async for _, output in stream:
                    for c in output.outputs:
                        states[c.index].add(c)
                        logprobs = self._logprobs(c.token_ids, c.logprobs or [], request)
                        if parser.is_plain:
                            yield chunk(c.index, DeltaMessage(content=c.text), states, logprobs, c)
                            continue
                        parsed = _parsed_chunk(streamers[c.index], c, parser)
                        if parsed is not None or logprobs is not None:
                            delta, finish = parsed or (DeltaMessage(), None)
                            yield chunk(c.index, delta, states, logprobs, finish)
            except ServerShutdown:
                for i, state in enumerate(states):
                    if state.finish_reason is None:
                        state.finish_reason = "abort"
                        yield chunk(i, DeltaMessage(content=""), states, finish=state)
            if chunk.include_usage:
                yield chunk.usage_only(states)
        except Exception as e:  # noqa: BLE001 (e.g. the engine died mid-stream: the stream says so)
            yield sse(_json(from_exception(e).body()))
        finally:
            ticket.release()
            stream.close()
        yield SSE_DONE

    def _reasoning_parser(self) -> ReasoningParser | None:
        name = self.ctx.reasoning_parser
        return None if name is None else get_reasoning_parser(name)()

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
        return token_text(self.tokenizer, token_id)


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


def make_chat_request(fields: dict[str, Any], param: str) -> ChatCompletionRequest:
    """A chat request built from another API's (Responses, Messages): a field that does not
    check is a 400 naming it, ``param`` the request field it came from."""
    try:
        return ChatCompletionRequest(**fields)
    except pydantic.ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise bad_request(f"Invalid request: {problems}", param=param) from None


def required_string(item: dict[str, Any], key: str, where: str, param: str) -> str:
    """``item[key]``, which another API's request must give as a string (a 400 naming it if not)."""
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string, got {value!r}", param=param)
    return value


def _constrain_tool_calls(params: SamplingParams, plan: ToolPlan) -> None:
    """``required`` and named tool choices: the grammar that makes the call valid JSON."""
    grammar = plan.grammar()
    if grammar is None:
        return
    if params.structured_outputs is not None:
        raise bad_request(
            f"tool_choice {plan.mode!r} cannot be combined with response_format or structured outputs",
            param="tool_choice",
        )
    try:
        validate_structured_outputs(grammar)
    except ValueError as e:
        raise bad_request(
            f"tools: a function's parameters are not a usable JSON schema: {e}", param="tools"
        ) from e
    params.structured_outputs = grammar


def _message(text: str, parser: ChatOutputParser) -> ChatCompletionMessage:
    if parser.is_plain:
        return ChatCompletionMessage(content=text)
    return ChatCompletionMessage(**parser.message_fields(text))


def _finish_reason(reason: str | None, num_tool_calls: int, parser: ChatOutputParser) -> str | None:
    if reason == "stop" and num_tool_calls and parser.calls_finish_with_tool_calls:
        return "tool_calls"
    return reason


def _parsed_chunk(
    streamer: ChoiceStreamer, c: CompletionOutput, parser: ChatOutputParser
) -> tuple[DeltaMessage, CompletionOutput | None] | None:
    """The delta and (on the last output) the finish of one parsed chunk; None: nothing to send yet."""
    fields = streamer.delta(c.text, c.finish_reason is not None)
    if c.finish_reason is None:
        return (DeltaMessage(**fields), None) if fields else None
    finish = dataclasses.replace(c, finish_reason=_finish_reason(c.finish_reason, streamer.num_calls, parser))
    return DeltaMessage(**fields), finish


def _check_chat_unsupported(request: ChatCompletionRequest) -> None:
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


def _template_kwargs(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The request's chat_template_kwargs, with reasoning_effort among them when given."""
    if request.reasoning_effort is None:
        return request.chat_template_kwargs
    return {"reasoning_effort": request.reasoning_effort, **(request.chat_template_kwargs or {})}
