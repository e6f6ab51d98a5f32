"""Reading tool calls out of JSON that may still be arriving.

A streamed tool call is text like ``{"name": "f", "arguments": {"city": "Par`` that grows by
a few characters per token. ``scan_object`` finds the object's members and where each value
starts and (if it has) ends, without parsing values, so a call's name is known as soon as its
string closes and its arguments can be streamed as the raw text they are. Because the text only
grows, what is reported for a prefix is always a prefix of what is reported later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WHITESPACE = " \t\r\n"


@dataclass
class Span:
    start: int
    end: int | None  # exclusive; None while the value is still open


@dataclass
class PartialCall:
    """One tool call as far as it has arrived."""

    name: str | None  # None until the name's string has closed
    arguments: str  # raw JSON text of the arguments so far (all of it once complete)
    complete: bool = False


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """``text[i]`` is an opening quote: the index after the closing quote, or None."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """The index after the complete JSON value starting at ``text[i]``, or None if incomplete."""
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number, true, false or null: ends at a delimiter (at the end of text it may go on)
    while j < len(text) and text[j] not in ",}]" + _WHITESPACE:
        j += 1
    return j if j < len(text) else None


def scan_object(text: str, start: int) -> tuple[dict[str, Span], int | None, bool]:
    """Members of the object at ``text[start:]`` (after whitespace).

    Returns (key -> value span, index after the closing brace or None, well_formed_so_far).
    """
    i = skip_ws(text, start)
    members: dict[str, Span] = {}
    if i >= len(text):
        return members, None, True
    if text[i] != "{":
        return members, None, False
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return members, None, True
        c = text[i]
        if c == "}":
            return members, i + 1, True
        if c == ",":
            i += 1
            continue
        if c != '"':
            return members, None, False
        key_end = string_end(text, i)
        if key_end is None:
            return members, None, True
        try:
            key = json.loads(text[i:key_end])
        except json.JSONDecodeError:
            return members, None, False
        i = skip_ws(text, key_end)
        if i >= len(text):
            return members, None, True
        if text[i] != ":":
            return members, None, False
        i = skip_ws(text, i + 1)
        if i >= len(text):
            return members, None, True
        end = value_end(text, i)
        members[key] = Span(i, end)
        if end is None:
            return members, None, True
        i = end


def call_from_object(
    text: str, start: int, argument_keys: tuple[str, ...]
) -> tuple[PartialCall | None, int | None]:
    """The tool call in the object at ``text[start:]``, and the index after the object (or None).

    None for the call when the text there is not an object of this shape.
    """
    members, end, ok = scan_object(text, start)
    if not ok:
        return None, None
    name = None
    name_span = members.get("name")
    if name_span is not None and name_span.end is not None:
        try:
            name = json.loads(text[name_span.start : name_span.end])
        except json.JSONDecodeError:
            return None, None
        if not isinstance(name, str):
            return None, None
    arguments = ""
    for key in argument_keys:
        span = members.get(key)
        if span is not None:
            arguments = text[span.start : span.end if span.end is not None else len(text)].rstrip()
            break
    if end is not None and not arguments:
        arguments = "{}"  # a call without arguments
    return PartialCall(name, arguments, complete=end is not None), end


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
