"""A request's output constraint, from any of the three ways of asking for one:

    response_format   OpenAI: {"type": "text" | "json_object" | "json_schema" | "structural_tag"}
    structured_outputs   vLLM: {"json" | "regex" | "choice" | "grammar" | "structural_tag" | ...}
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older aliases

At most one of them may be given; each error is a 400 that names the field.
"""

from __future__ import annotations

import json
from typing import Any

from axon.entrypoints.openai.errors import bad_request
from axon.sampling_params import StructuredOutputsParams

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs_from_request(request: Any) -> StructuredOutputsParams | None:
    """The StructuredOutputsParams a completion or chat request asks for, or None."""
    asked: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(request, "response_format", None)
    if response_format is not None:
        params = _from_response_format(response_format)
        if params is not None:
            asked.append(("response_format", params))
    if request.structured_outputs is not None:
        asked.append(("structured_outputs", _build("structured_outputs", request.structured_outputs)))
    guided = {name: getattr(request, name) for name in _GUIDED if getattr(request, name) is not None}
    if guided:
        if len(guided) > 1:
            raise bad_request(f"only one of {sorted(guided)} may be set", param=sorted(guided)[1])
        ((name, value),) = guided.items()
        asked.append((name, _build(name, {_GUIDED[name]: value})))
    if len(asked) > 1:
        names = [name for name, _ in asked]
        raise bad_request(f"only one output constraint may be given, got {', '.join(names)}", param=names[1])
    return asked[0][1] if asked else None


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _build("response_format", {"json_object": True})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a 'schema' (and a 'name')",
                param="response_format",
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI allows a schema-less json_schema: any JSON object.
            return _build("response_format", {"json_object": True})
        return _build("response_format", {"json": schema})
    if kind == "structural_tag":
        tag = {k: v for k, v in response_format.items() if k != "type"}
        if "format" in tag:  # the newer form keeps its own type
            tag = {"type": "structural_tag", **tag}
        return _build("response_format", {"structural_tag": json.dumps(tag)})
    raise bad_request(
        f"response_format.type must be one of text, json_object, json_schema, structural_tag; got {kind!r}",
        param="response_format",
    )


def _build(where: str, data: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams.from_dict(data, where)
    except (TypeError, ValueError) as e:
        raise bad_request(f"{where}: {e}", param=where) from e
