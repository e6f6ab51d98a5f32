"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A message request is a chat underneath, as vLLM serves it: ``system`` and the messages' content
blocks (``text``, ``image``, an assistant's ``tool_use``, a user's ``tool_result``) become chat
messages, ``tools`` (``input_schema``) and ``tool_choice`` (auto, any, tool, none) the chat's
function tools, ``stop_sequences`` its stop strings. The chat's answer comes back as content
blocks (``thinking`` from the reasoning parser, ``text``, ``tool_use``) with Anthropic's stop
reasons (``end_turn``, ``max_tokens``, ``stop_sequence``, ``tool_use``); streamed, as
``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta`` and
``message_stop`` events. Errors on these paths have Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``, api_server.py), and ``x-api-key`` is
accepted beside ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from axon.entrypoints.openai.errors import anthropic_error_body, bad_request, from_exception
from axon.entrypoints.openai.protocol import (
    ChatCompletionMessage,
    CountTokensRequest,
    MessagesRequest,
    random_uuid,
)
from axon.entrypoints.openai.serving_chat import (
    ChatRun,
    OpenAIServingChat,
    make_chat_request,
    required_string,
)
from axon.entrypoints.openai.serving_engine import ChoiceState

# OpenAI's finish reasons -> Anthropic's stop reasons
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class AnthropicServingMessages(OpenAIServingChat):
    async def create_message(self, request: MessagesRequest, raw_request: Request) -> Response:
        chat = chat_request(request)
        message_id = f"msg_{random_uuid()}"
        run = await self.start_chat(chat, raw_request, message_id)
        if request.stream:
            return StreamingResponse(self._events(run, message_id), media_type="text/event-stream")
        try:
            message, state = await self.message(run)
        finally:
            run.ticket.release()
        return Response(
            json.dumps(self._body(message_id, message, state, run.num_prompt_tokens)),
            media_type="application/json",
        )

    async def count_tokens(self, request: CountTokensRequest) -> Response:
        self.check_model(request.model)
        prompt_token_ids, _, _ = await self.chat_prompt(chat_request(request))
        return Response(json.dumps({"input_tokens": len(prompt_token_ids)}), media_type="application/json")

    def _body(
        self, message_id: str, message: ChatCompletionMessage, state: ChoiceState, num_prompt_tokens: int
    ) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if message.reasoning_content:
            content.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
        if message.content:
            content.append({"type": "text", "text": message.content})
        for call in message.tool_calls:
            function = call["function"]
            content.append(_tool_use(function["name"], _arguments(function["arguments"])))
        reason, sequence = _stop_reason(state, bool(message.tool_calls))
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": num_prompt_tokens, "output_tokens": len(state.token_ids)},
        }

    async def _events(self, run: ChatRun, message_id: str) -> AsyncIterator[str]:
        start = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": run.num_prompt_tokens, "output_tokens": 0},
        }
        blocks = _Blocks()
        try:
            yield _event("message_start", message=start)
            state = ChoiceState()
            async for delta, state in self.deltas(run):
                for event in blocks.add(delta):
                    yield event
            for event in blocks.close():
                yield event
            reason, sequence = _stop_reason(state, blocks.num_tool_uses > 0)
            yield _event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": len(state.token_ids)},
            )
            yield _event("message_stop")
        except Exception as e:  # noqa: BLE001 (the engine died mid-stream: the stream says so)
            error = from_exception(e)
            yield f"event: error\ndata: {json.dumps(anthropic_error_body(error.status, error.message))}\n\n"
        finally:
            run.ticket.release()
            run.stream.close()


# ---- requests: Messages -> chat --------------------------------------------------------------


def chat_request(request: MessagesRequest | CountTokensRequest) -> Any:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        system = request.system if isinstance(request.system, str) else _text_of(request.system, "system")
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        messages += _chat_messages(message, f"messages[{i}]")
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "tools": _tools(request.tools),
        "tool_choice": _tool_choice(request.tool_choice),
    }
    if isinstance(request, MessagesRequest):
        fields.update(
            max_tokens=request.max_tokens,
            stop=request.stop_sequences,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stream=request.stream,
        )
    return make_chat_request(fields, "messages")


def _chat_messages(message: dict[str, Any], where: str) -> list[dict[str, Any]]:
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"{where}.role must be 'user' or 'assistant', got {role!r}", param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks", param="messages")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.content[{j}]"
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text")})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), here)}})
        elif kind == "tool_use" and role == "assistant":
            arguments = json.dumps(block.get("input") or {})
            function = {"name": required_string(block, "name", here, "messages"), "arguments": arguments}
            calls.append(
                {
                    "id": required_string(block, "id", here, "messages"),
                    "type": "function",
                    "function": function,
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            text = result if isinstance(result, str) else _text_of(result or [], f"{here}.content")
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": required_string(block, "tool_use_id", here, "messages"),
                    "content": text,
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad_request(
                f"{here}: content blocks of type {kind!r} are not supported in a {role} message",
                param="messages",
            )
    out = list(results)  # a tool's results answer the calls of the turn before
    if parts or calls:
        turn: dict[str, Any] = {"role": role, "content": parts or None}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _text_of(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list) or not all(
        isinstance(b, dict) and b.get("type") == "text" for b in blocks
    ):
        raise bad_request(f"{where} must be a string or a list of text blocks", param="messages")
    return "".join(b.get("text") or "" for b in blocks)


def _image_url(source: Any, where: str) -> str:
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if kind == "url":
        return str(source.get("url"))
    raise bad_request(
        f"{where}: an image's source must be of type 'base64' or 'url', got {kind!r}", param="messages"
    )


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom" or not isinstance(tool.get("input_schema"), dict):
            raise bad_request(
                f"tools[{i}]: only custom tools with an input_schema are supported (got type {tool.get('type')!r})",
                param="tools",
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}]: a tool needs a name", param="tools")
        function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice {choice!r} is not supported", param="tool_choice")


# ---- answers: chat -> Messages ---------------------------------------------------------------


def _tool_use(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{random_uuid()}", "name": name, "input": arguments}


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop_reason(state: ChoiceState, used_tools: bool) -> tuple[str, str | None]:
    if used_tools and state.finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    if state.finish_reason == "stop" and isinstance(state.stop_reason, str):
        return "stop_sequence", state.stop_reason
    return STOP_REASONS.get(state.finish_reason or "stop", "end_turn"), None


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


class _Blocks:
    """Chat deltas -> content blocks, each started, grown and stopped as Anthropic streams them."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the kind of the block being written
        self.num_tool_uses = 0

    def add(self, delta: Any) -> list[str]:
        out: list[str] = []
        if delta.reasoning_content:
            out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning_content}))
        if delta.content:
            out += self._start("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls or []:
            function = call.get("function") or {}
            if call.get("id") is not None:  # a new call: a new block, even after another call
                out += self._start("tool_use", _tool_use(function.get("name", ""), {}), new=True)
                self.num_tool_uses += 1
            if function.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def close(self) -> list[str]:
        return self._stop()

    def _start(self, kind: str, block: dict[str, Any], new: bool = False) -> list[str]:
        if self.open == kind and not new:
            return []
        out = self._stop()
        self.index += 1
        self.open = kind
        return [*out, _event("content_block_start", index=self.index, content_block=block)]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", index=self.index)]

    def _delta(self, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", index=self.index, delta=delta)
