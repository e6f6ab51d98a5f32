"""Twenty-two JSON schemas of everyday shapes, each with what to ask for in words.

Shared by the structured-output server tests (every schema validates at temperature 0) and by
``structured_whitespace.py`` (which whitespace bound gives valid JSON most often).
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "a city with its location",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "location": {
                    "type": "object",
                    "properties": {
                        "lat": {"type": "number", "minimum": -90, "maximum": 90},
                        "lon": {"type": "number", "minimum": -180, "maximum": 180},
                    },
                    "required": ["lat", "lon"],
                },
            },
            "required": ["city", "location"],
        },
    ),
    (
        "three lucky numbers",
        {
            "type": "object",
            "properties": {
                "numbers": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["numbers"],
        },
    ),
    (
        "a traffic light colour",
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "amber", "green"]}},
            "required": ["colour"],
        },
    ),
    (
        "a yes/no flag and a note",
        {
            "type": "object",
            "properties": {"flag": {"type": "boolean"}, "note": {"type": "null"}},
            "required": ["flag", "note"],
        },
    ),
    (
        "a temperature reading",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
        },
    ),
    (
        "an airport code",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["code"],
        },
    ),
    (
        "a book, subtitle optional",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "subtitle": NAME,
                "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
            },
            "required": ["title", "pages"],
        },
    ),
    (
        "two addresses",
        {
            "$defs": {
                "address": {
                    "type": "object",
                    "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"],
                }
            },
            "type": "object",
            "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}},
            "required": ["home", "work"],
        },
    ),
    (
        "a team of people",
        {
            "type": "object",
            "properties": {
                "members": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {"name": NAME, "role": {"enum": ["dev", "ops"]}},
                        "required": ["name", "role"],
                    },
                }
            },
            "required": ["members"],
        },
    ),
    (
        "a versioned record",
        {
            "type": "object",
            "properties": {"version": {"const": 2}, "id": {"type": "integer", "minimum": 1, "maximum": 1000}},
            "required": ["version", "id"],
        },
    ),
    (
        "an id that is a string or a number",
        {
            "type": "object",
            "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}},
            "required": ["id"],
        },
    ),
    (
        "a 2x2 matrix",
        {
            "type": "object",
            "properties": {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {
                        "type": "array",
                        "minItems": 2,
                        "maxItems": 2,
                        "items": {"type": "integer", "minimum": -9, "maximum": 9},
                    },
                }
            },
            "required": ["rows"],
        },
    ),
    (
        "an event with a date",
        {
            "type": "object",
            "properties": {"event": NAME, "date": {"type": "string", "format": "date"}},
            "required": ["event", "date"],
        },
    ),
    (
        "a positive score",
        {
            "type": "object",
            "properties": {"score": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
            "required": ["score"],
        },
    ),
    (
        "a nickname or null",
        {
            "type": "object",
            "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}},
            "required": ["nickname"],
        },
    ),
    (
        "a closed product record",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "in_stock"],
            "additionalProperties": False,
        },
    ),
    (
        "a dice roll",
        {"type": "object", "properties": {"roll": {"enum": [1, 2, 3, 4, 5, 6]}}, "required": ["roll"]},
    ),
    (
        "a company with a CEO and an address",
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "ceo": {
                            "type": "object",
                            "properties": {
                                "name": NAME,
                                "since": {"type": "integer", "minimum": 1990, "maximum": 2025},
                            },
                            "required": ["name", "since"],
                        },
                    },
                    "required": ["name", "ceo"],
                }
            },
            "required": ["company"],
        },
    ),
    (
        "a list of tags",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {"type": "string", "minLength": 1, "maxLength": 8},
                }
            },
            "required": ["tags"],
        },
    ),
    (
        "a point",
        {
            "type": "array",
            "prefixItems": [
                {"type": "integer", "minimum": 0, "maximum": 9},
                {"type": "integer", "minimum": 0, "maximum": 9},
            ],
            "items": False,
            "minItems": 2,
        },
    ),
    ("a rating", {"type": "integer", "minimum": 1, "maximum": 5}),
]
