"""POST /v1/responses (OpenAI's Responses API), GET /v1/responses/{id}, POST .../{id}/cancel.

A response is a chat underneath: its ``input`` items (and ``instructions``, and with
``previous_response_id`` the stored conversation before it) become chat messages, its function
tools and ``text.format`` the chat's tools and ``response_format``; the chat runs as
``/v1/chat/completions`` runs it (axon/entrypoints/openai/serving_chat.py), and its message
comes back as output items: ``reasoning`` (the reasoning parser's text, as a summary),
``message`` (``output_text``) and ``function_call`` items. Streamed, the deltas become the
Responses event types (``response.created``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed``, ...).

Responses are kept (``store``, the default) in memory, the most recent ``MAX_STORED`` of them,
for ``GET`` and for a later ``previous_response_id``. ``background: true`` answers at once with
status ``queued`` and runs on; ``GET`` polls it and ``cancel`` aborts it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from axon.entrypoints.openai.errors import OpenAIError, bad_request, from_exception
from axon.entrypoints.openai.protocol import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    ResponsesRequest,
    SamplingFields,
    random_uuid,
)
from axon.entrypoints.openai.serving_chat import (
    ChatRun,
    OpenAIServingChat,
    make_chat_request,
    required_string,
)
from axon.entrypoints.openai.serving_engine import ChoiceState

MAX_STORED = 4096  # responses kept for GET and previous_response_id, least recently used out first


@dataclass
class StoredResponse:
    body: dict[str, Any]
    history: list[dict[str, Any]]  # the conversation after it: its input, then its output, as chat messages
    task: asyncio.Task[None] | None = None  # a background response still running
    run: ChatRun | None = field(default=None, repr=False)


class OpenAIServingResponses(OpenAIServingChat):
    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.store: OrderedDict[str, StoredResponse] = OrderedDict()

    # ---- routes ------------------------------------------------------------------------------
    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        if request.background and not request.store:
            raise bad_request(
                "background responses must be stored: store cannot be false", param="background"
            )
        if request.background and request.stream:
            raise bad_request("streaming a background response is not supported", param="stream")
        history = self._history(request.previous_response_id)
        messages = history + input_messages(request.input)
        chat = chat_request(request, messages)
        response_id = f"resp_{random_uuid()}"
        watch = None if (request.stream or request.background) else raw_request
        run = await self.start_chat(chat, watch, response_id)
        base = self._base(request, response_id)
        conversation = messages[len(history) :]
        if request.background:
            stored = StoredResponse(dict(base, status="queued"), history + conversation, run=run)
            self._keep(response_id, stored)
            stored.task = asyncio.create_task(self._background(stored, run, base, request))
            return _json(stored.body)
        if request.stream:
            return StreamingResponse(
                self._events(run, base, history + conversation, request), media_type="text/event-stream"
            )
        try:
            message, state = await self.message(run)
        finally:
            run.ticket.release()
        body = finished_body(base, message, state, run.num_prompt_tokens)
        if request.store:
            self._keep(
                response_id, StoredResponse(body, history + conversation + assistant_messages(message))
            )
        return _json(body)

    def retrieve(self, response_id: str) -> Response:
        return _json(self._stored(response_id).body)

    async def cancel(self, response_id: str) -> Response:
        stored = self._stored(response_id)
        if stored.task is None:
            raise bad_request("only a background response can be cancelled", param="response_id")
        if stored.task.done():
            raise bad_request(f"response {response_id} has already finished ({stored.body['status']})")
        stored.task.cancel()
        await asyncio.gather(stored.task, return_exceptions=True)
        return _json(stored.body)

    # ---- running -----------------------------------------------------------------------------
    async def _background(
        self, stored: StoredResponse, run: ChatRun, base: dict[str, Any], request: ResponsesRequest
    ) -> None:
        stored.body["status"] = "in_progress"
        try:
            message, state = await self.message(run)
            stored.body = finished_body(base, message, state, run.num_prompt_tokens)
            stored.history += assistant_messages(message)
        except asyncio.CancelledError:
            stored.body = dict(base, status="cancelled")
        except Exception as e:  # noqa: BLE001 (the stored response says what failed)
            error = from_exception(e)
            stored.body = dict(base, status="failed", error={"code": error.code, "message": error.message})
        finally:
            run.ticket.release()
            run.stream.close()

    async def _events(
        self, run: ChatRun, base: dict[str, Any], history: list[dict[str, Any]], request: ResponsesRequest
    ) -> AsyncIterator[str]:
        events = _EventWriter()
        yield events("response.created", response=dict(base, status="in_progress"))
        yield events("response.in_progress", response=dict(base, status="in_progress"))
        items = _StreamedItems(events)
        try:
            state = ChoiceState()
            async for delta, state in self.deltas(run):
                for event in items.add(delta):
                    yield event
            for event in items.close():
                yield event
            message = ChatCompletionMessage(
                content=items.text or None,
                reasoning_content=items.reasoning or None,
                tool_calls=[c.as_tool_call() for c in items.calls],
            )
            body = finished_body(base, message, state, run.num_prompt_tokens)
            if request.store:
                self._keep(base["id"], StoredResponse(body, history + assistant_messages(message)))
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}
            yield events(kind.get(body["status"], "response.failed"), response=body)
        except Exception as e:  # noqa: BLE001 (the engine died mid-stream: the stream says so)
            error = from_exception(e)
            yield events("error", code=error.code, message=error.message, param=None)
        finally:
            run.ticket.release()
            run.stream.close()

    # ---- the store ---------------------------------------------------------------------------
    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise bad_request(
                f"Previous response with id '{previous_response_id}' not found.", param="previous_response_id"
            )
        if stored.body["status"] in ("queued", "in_progress"):
            raise bad_request(
                f"Previous response '{previous_response_id}' has not finished yet.",
                param="previous_response_id",
            )
        self.store.move_to_end(previous_response_id)
        return list(stored.history)

    def _stored(self, response_id: str) -> StoredResponse:
        stored = self.store.get(response_id)
        if stored is None:
            raise OpenAIError(
                f"Response with id '{response_id}' not found.", HTTPStatus.NOT_FOUND, param="response_id"
            )
        return stored

    def _keep(self, response_id: str, stored: StoredResponse) -> None:
        self.store[response_id] = stored
        self.store.move_to_end(response_id)
        while len(self.store) > MAX_STORED:
            self.store.popitem(last=False)

    def _base(self, request: ResponsesRequest, response_id: str) -> dict[str, Any]:
        """The response object's fields that echo the request."""
        return {
            "id": response_id,
            "object": "response",
            "created_at": int(time.time()),
            "model": self.model_name,
            "status": "in_progress",
            "output": [],
            "instructions": request.instructions,
            "tools": request.tools or [],
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "text": request.text or {"format": {"type": "text"}},
            "reasoning": request.reasoning,
            "store": request.store,
            "background": request.background,
            "metadata": request.metadata or {},
            "user": request.user,
            "error": None,
            "incomplete_details": None,
            "usage": None,
        }


# ---- requests: Responses -> chat -------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; items are messages (with
    input_text, output_text and input_image parts), function calls (an assistant's tool calls)
    and their outputs (tool messages); reasoning items are dropped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": required_string(item, "call_id", where, "input"),
                "type": "function",
                "function": {
                    "name": required_string(item, "name", where, "input"),
                    "arguments": required_string(item, "arguments", where, "input"),
                },
            }
            last = messages[-1] if messages else None
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": required_string(item, "call_id", where, "input"),
                    "content": text,
                }
            )
        elif kind != "reasoning":
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", param="input")
    return messages


def _content(content: Any, where: str) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", param="input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text")})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad_request(
                    f"{where}.content[{j}]: an input_image needs image_url (a URL)", param="input"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise bad_request(
                f"{where}.content[{j}]: content parts of type {kind!r} are not supported", param="input"
            )
    return parts


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    if request.instructions is not None:
        messages = [{"role": "system", "content": request.instructions}, *messages]
    fields: dict[str, Any] = {
        k: v for k, v in (request.model_extra or {}).items() if k in SamplingFields.model_fields
    }  # vLLM's sampling extras (top_k, seed, ...)
    fields.update(
        model=request.model,
        messages=messages,
        max_completion_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        user=request.user,
        parallel_tool_calls=request.parallel_tool_calls,
        tools=_tools(request.tools),
        tool_choice=_tool_choice(request.tool_choice),
        response_format=_response_format(request.text),
    )
    effort = (request.reasoning or {}).get("effort")
    if effort in ("low", "medium", "high"):
        fields["reasoning_effort"] = effort
    return make_chat_request(fields, "input")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(
                f"tools[{i}]: tools of type {tool.get('type')!r} are not supported (function tools are)",
                param="tools",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}]: a function tool needs a name", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice {choice!r} is not supported", param="tool_choice")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request(
            "text.format must be an object such as {'type': 'json_schema', ...}", param="text.format"
        )
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format of type {fmt.get('type')!r} is not supported", param="text.format")


# ---- answers: chat -> Responses --------------------------------------------------------------


def finished_body(
    base: dict[str, Any], message: ChatCompletionMessage, state: ChoiceState, num_prompt_tokens: int
) -> dict[str, Any]:
    reason = state.finish_reason
    status = {"length": "incomplete", "abort": "cancelled"}.get(reason or "", "completed")
    num_output = len(state.token_ids)
    return dict(
        base,
        status=status,
        output=output_items(message),
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        usage={
            "input_tokens": num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": num_output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": num_prompt_tokens + num_output,
        },
    )


def output_items(message: ChatCompletionMessage) -> list[dict[str, Any]]:
    items = []
    if message.reasoning_content:
        items.append(_reasoning_item(f"rs_{random_uuid()}", message.reasoning_content))
    if message.content or not message.tool_calls:
        items.append(_message_item(f"msg_{random_uuid()}", message.content or ""))
    for call in message.tool_calls:
        function = call["function"]
        items.append(_call_item(f"fc_{random_uuid()}", call["id"], function["name"], function["arguments"]))
    return items


def assistant_messages(message: ChatCompletionMessage) -> list[dict[str, Any]]:
    """The answer as the chat message(s) a later turn's conversation holds."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        turn["tool_calls"] = message.tool_calls
    return [turn]


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [{"type": "summary_text", "text": text}],
        "status": status,
    }


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = (
        [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    )
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# ---- streaming -------------------------------------------------------------------------------


class _EventWriter:
    """Server-sent events of the Responses API, numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


@dataclass
class _Call:
    item_id: str
    call_id: str
    name: str
    arguments: str = ""

    def as_tool_call(self) -> dict[str, Any]:
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


class _StreamedItems:
    """Chat deltas -> output items opened, grown and closed as the Responses events say: the
    reasoning summary first, then the message text, then each function call."""

    def __init__(self, events: _EventWriter) -> None:
        self.events = events
        self.items: list[dict[str, Any]] = []  # finished items, in output order
        self.open: tuple[str, str] | None = None  # (kind, item id) of the item being written
        self.reasoning = self.text = ""
        self.calls: list[_Call] = []

    @property
    def index(self) -> int:
        return len(self.items)

    def add(self, delta: Any) -> list[str]:
        out: list[str] = []
        if delta.reasoning_content:
            if self.open is None or self.open[0] != "reasoning":
                out += self._close() + self._open("reasoning")
            self.reasoning += delta.reasoning_content
            out.append(
                self._event(
                    "response.reasoning_summary_text.delta", summary_index=0, delta=delta.reasoning_content
                )
            )
        if delta.content:
            if self.open is None or self.open[0] != "message":
                out += self._close() + self._open("message")
            self.text += delta.content
            out.append(
                self._event("response.output_text.delta", content_index=0, delta=delta.content, logprobs=[])
            )
        for call in delta.tool_calls or []:
            function = call.get("function") or {}
            if call.get("id") is not None:  # a new call begins
                out += self._close()
                self.calls.append(_Call(f"fc_{random_uuid()}", call["id"], function.get("name", "")))
                out += self._open("function_call")
            if function.get("arguments"):
                self.calls[-1].arguments += function["arguments"]
                out.append(self._event("response.function_call_arguments.delta", delta=function["arguments"]))
        return out

    def close(self) -> list[str]:
        out = self._close()
        if not self.items:  # an empty answer is still one message
            out += self._open("message") + self._close()
        return out

    def _event(self, kind: str, **fields: Any) -> str:
        assert self.open is not None
        return self.events(kind, item_id=self.open[1], output_index=self.index, **fields)

    def _open(self, kind: str) -> list[str]:
        if kind == "reasoning":
            item_id = f"rs_{random_uuid()}"
            item, part = (
                _reasoning_item(item_id, "", "in_progress"),
                (
                    "response.reasoning_summary_part.added",
                    {"summary_index": 0, "part": {"type": "summary_text", "text": ""}},
                ),
            )
        elif kind == "message":
            item_id = f"msg_{random_uuid()}"
            item, part = (
                _message_item(item_id, None, "in_progress"),
                (
                    "response.content_part.added",
                    {"content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}},
                ),
            )
        else:
            call = self.calls[-1]
            item_id = call.item_id
            item, part = _call_item(item_id, call.call_id, call.name, "", "in_progress"), None
        self.open = (kind, item_id)
        out = [self.events("response.output_item.added", output_index=self.index, item=item)]
        if part is not None:
            out.append(self._event(part[0], **part[1]))
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        kind, item_id = self.open
        if kind == "reasoning":
            item = _reasoning_item(item_id, self.reasoning)
            out = [
                self._event("response.reasoning_summary_text.done", summary_index=0, text=self.reasoning),
                self._event("response.reasoning_summary_part.done", summary_index=0, part=item["summary"][0]),
            ]
        elif kind == "message":
            item = _message_item(item_id, self.text)
            out = [
                self._event("response.output_text.done", content_index=0, text=self.text, logprobs=[]),
                self._event("response.content_part.done", content_index=0, part=item["content"][0]),
            ]
        else:
            call = self.calls[-1]
            item = _call_item(item_id, call.call_id, call.name, call.arguments)
            out = [self._event("response.function_call_arguments.done", arguments=call.arguments)]
        out.append(self._event("response.output_item.done", item=item))
        self.items.append(item)
        self.open = None
        return out


def _json(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body), media_type="application/json")
