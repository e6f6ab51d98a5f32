"""StructuredOutputsParams: what one request's output must match (vLLM's names and fields).

Pure Python (no xgrammar, no torch): it rides inside SamplingParams, and inside EngineSamplingParams across the process
boundary. Exactly one constraint is set; ``kind_and_spec`` turns it into the (kind, spec text)
pair that names the compiled grammar in the cache.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any


class GrammarKind(str, enum.Enum):
    JSON = "json"  # a JSON schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"  # EBNF / GBNF
    STRUCTURAL_TAG = "structural_tag"


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One of ``json`` (a schema, dict or JSON text), ``regex``, ``choice`` (a list of strings),
    ``grammar`` (EBNF), ``json_object`` (True) or ``structural_tag`` (JSON text).

    Whitespace between JSON tokens (the server-wide defaults come from
    ``--structured-outputs-config``): ``max_whitespace_cnt`` allows up to that many characters
    for this request (None: the server's bound); ``disable_any_whitespace`` allows only the
    single spaces of ", " and ": ".
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    max_whitespace_cnt: int | None = None
    # Accepted for vLLM compatibility; both are what axon does anyway (one backend, strict schemas).
    disable_fallback: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        if self.json_object is False:
            self.json_object = None
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {what}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
            )
        if self.max_whitespace_cnt is not None:
            check_positive_int("structured_outputs.max_whitespace_cnt", self.max_whitespace_cnt)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")

    def kind_and_spec(self) -> tuple[GrammarKind, str]:
        """(kind, canonical spec text): equal specs share one compiled grammar."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return GrammarKind.JSON, schema
        if self.json_object:
            return GrammarKind.JSON_OBJECT, ""
        if self.regex is not None:
            return GrammarKind.REGEX, self.regex
        if self.choice is not None:
            return GrammarKind.CHOICE, json.dumps(self.choice)
        if self.grammar is not None:
            return GrammarKind.GRAMMAR, self.grammar
        assert self.structural_tag is not None, "__post_init__ checks that one constraint is set"
        return GrammarKind.STRUCTURAL_TAG, self.structural_tag

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "structured_outputs") -> StructuredOutputsParams:
        """From a request's JSON; unknown keys are errors that name the key."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {data!r}")  # noqa: TRY004
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where} has unknown keys {unknown}; supported: {sorted(known)}")
        return cls(**data)


def check_positive_int(where: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where} must be a positive integer, got {value!r}")


def choice_as_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: each choice as an EBNF string literal (JSON escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
