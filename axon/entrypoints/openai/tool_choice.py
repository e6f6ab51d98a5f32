"""``tools`` and ``tool_choice`` on /v1/chat/completions: checked, planned, and turned into a grammar.

    none       tools are rendered (the template may show them); the output is content
    auto       the model decides; the server's --tool-call-parser reads calls out of its text
    required   a grammar forces a JSON array of one or more {"name", "parameters"} calls
    named      a grammar forces the named function's arguments (its ``parameters`` schema)

so ``required`` and named calls are always valid JSON for the function's parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from axon.entrypoints.openai.errors import bad_request
from axon.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from axon.sampling_params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    tools: list[dict[str, Any]] = field(default_factory=list)
    function_name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto only
    parallel_tool_calls: bool = True

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """Chat-template arguments with the tools added (templates that know tools render them)."""
        if not self.tools:
            return kwargs
        return {**(kwargs or {}), "tools": self.tools}

    def grammar(self) -> StructuredOutputsParams | None:
        """The constraint that enforces ``required`` and named choices (None otherwise)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.function_name))
        if self.mode == "required":
            return StructuredOutputsParams(json=self._required_schema())
        return None

    def _parameters(self, name: str | None) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or _ANY_OBJECT
        raise AssertionError(f"plan_tools checked that {name!r} is in tools")

    def _required_schema(self) -> dict[str, Any]:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": t["function"].get("parameters") or _ANY_OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return schema


def plan_tools(request: Any, enable_auto_tool_choice: bool, tool_call_parser: str | None) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` (400s that say what is wrong) and decide the mode."""
    tools = [_check_tool(i, t) for i, t in enumerate(request.tools or [])]
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    parallel = request.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", tools, parallel_tool_calls=parallel)
    if not tools:
        raise bad_request("when using `tool_choice`, `tools` must be set", param="tool_choice")
    if choice == "auto":
        if not enable_auto_tool_choice or tool_call_parser is None:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                param="tool_choice",
            )
        return ToolPlan("auto", tools, parser=get_tool_parser(tool_call_parser), parallel_tool_calls=parallel)
    if choice == "required":
        return ToolPlan("required", tools, parallel_tool_calls=parallel)
    name = _named_choice(choice)
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(
            f"tool_choice names function {name!r}, which is not in `tools`", param="tool_choice"
        )
    return ToolPlan("named", tools, function_name=name, parallel_tool_calls=parallel)


def _check_tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise bad_request(
            f"{where} must be {{'type': 'function', 'function': {{...}}}}, got {tool!r}", param="tools"
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function must be an object with a name", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.function has no name (a non-empty string is required)", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{where}.function.parameters must be a JSON schema object", param="tools")
    return {"type": "function", "function": function}


def _named_choice(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice!r}",
        param="tool_choice",
    )


def tool_message_fields(message: Any) -> dict[str, Any]:
    """The tool-calling fields of one chat message, as chat templates expect them.

    An assistant's ``tool_calls`` keep OpenAI's shape, with ``arguments`` parsed into a dict
    (templates such as Qwen's and Hermes' ``tojson`` them); a ``tool`` message keeps its id.
    """
    out: dict[str, Any] = {}
    if getattr(message, "tool_calls", None):
        out["tool_calls"] = [_template_call(call) for call in message.tool_calls]
    if getattr(message, "tool_call_id", None) is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise bad_request(
                f"messages: tool call {call.get('id')!r} has arguments that are not JSON: {arguments!r}",
                param="messages",
            ) from None
    return {**call, "function": function}
