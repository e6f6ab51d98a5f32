"""The xgrammar backend (vLLM's default): JSON schema, JSON object, regex, choice, EBNF, structural tags.

``validate_structured_outputs`` runs in the front end without a tokenizer: it builds the
grammar (not the token-level compilation), so a bad schema, regex or grammar is a ValueError
before the request reaches the engine. ``XgrammarBackend`` compiles against the tokenizer in
the engine-core process.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from typing import Any

from axon.sampling_params import GrammarKind, StructuredOutputsParams, choice_as_ebnf
from axon.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from axon.structured_output.options import Whitespace

logger = logging.getLogger(__name__)


def _xgr() -> Any:
    import xgrammar

    return xgrammar


# ---- front-end validation -----------------------------------------------------------------------
def validate_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ValueError naming the problem if the constraint cannot be turned into a grammar."""
    _validate_spec(*params.kind_and_spec())


@functools.lru_cache(maxsize=256)  # a request is checked once per sample and again on submit
def _validate_spec(kind: GrammarKind, spec: str) -> None:
    try:
        _build_grammar(kind, spec)
    except ValueError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError (and others) from C++
        raise ValueError(f"structured_outputs.{_field(kind)} cannot be compiled: {_first_line(e)}") from e


def _build_grammar(kind: GrammarKind, spec: str) -> Any:
    xgr = _xgr()
    if kind == GrammarKind.JSON:
        schema = _load_schema(spec)
        _check_schema(schema)
        return xgr.Grammar.from_json_schema(json.dumps(schema))
    if kind == GrammarKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema('{"type": "object"}')
    if kind == GrammarKind.REGEX:
        if "\x00" in spec:
            raise ValueError("structured_outputs.regex must not contain a NUL character")
        return xgr.Grammar.from_regex(spec)
    if kind == GrammarKind.CHOICE:
        return xgr.Grammar.from_ebnf(choice_as_ebnf(json.loads(spec)))
    if kind == GrammarKind.GRAMMAR:
        return xgr.Grammar.from_ebnf(spec)
    return _structural_tag_grammar(spec)


def _load_schema(spec: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None


def _check_schema(schema: Any) -> None:
    """Reject what xgrammar would silently get wrong, and schemas that are not schemas."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r}")  # noqa: TRY004 (user input: a 400)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(
            f"structured_outputs.json is not a valid JSON schema at {path}: {e.message}"
        ) from None


def _structural_tag_grammar(spec: str) -> Any:
    xgr = _xgr()
    try:
        tag = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.structural_tag is not valid JSON: {e}") from None
    if isinstance(tag, dict) and "structures" in tag:  # the older begin/schema/end form
        items, triggers = _legacy_tag_items(tag)
        return xgr.Grammar.from_structural_tag(items, triggers)
    return xgr.Grammar.from_structural_tag(spec)


def _legacy_tag_items(tag: dict[str, Any]) -> tuple[list[Any], list[str]]:
    xgr = _xgr()
    try:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        triggers = list(tag["triggers"])
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"structured_outputs.structural_tag needs 'structures' of {{begin, schema, end}} and 'triggers': {e!r}"
        ) from None
    return items, triggers


def _field(kind: GrammarKind) -> str:
    return kind.value


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)  # xgrammar's "[time] file.cc:line: " prefix
    return text.splitlines()[0] if len(text) < 400 else text[:400]


# ---- the engine side ----------------------------------------------------------------------------
class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        # xgrammar's own cache is off: the manager caches by spec (one policy, one place).
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=False)

    def compile(self, kind: GrammarKind, spec: str, whitespace: Whitespace) -> Any:
        c = self.compiler
        if kind in (GrammarKind.JSON, GrammarKind.JSON_OBJECT):
            schema = spec if kind == GrammarKind.JSON else '{"type": "object"}'
            return c.compile_json_schema(
                schema,
                any_whitespace=whitespace.any_whitespace,
                max_whitespace_cnt=whitespace.max_whitespace_cnt,
            )
        if kind == GrammarKind.REGEX:
            return c.compile_regex(spec)
        if kind == GrammarKind.CHOICE:
            return c.compile_grammar(choice_as_ebnf(json.loads(spec)))
        if kind == GrammarKind.GRAMMAR:
            return c.compile_grammar(spec)
        return c.compile_grammar(_structural_tag_grammar(spec))

    def matcher(self, compiled: Any, max_rollback_tokens: int) -> StructuredOutputGrammar:
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens))

    def allocate_bitmask(self, num_rows: int) -> Any:
        return _xgr().allocate_token_bitmask(num_rows, self.vocab_size)


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.num_processed_tokens = 0

    def accept_tokens(self, req_id: str, tokens: list[int]) -> bool:
        for token in tokens:
            if self.matcher.is_terminated():
                return True  # tokens after the end are not the grammar's concern
            if not self.matcher.accept_token(token):
                logger.error("request %s: grammar rejected token %d", req_id, token)
                return False
            self.num_processed_tokens += 1
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        accepted: list[int] = []
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            accepted.append(token)
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def rollback(self, num_tokens: int) -> None:
        assert num_tokens <= self.num_processed_tokens, (
            f"cannot roll back {num_tokens} tokens, only {self.num_processed_tokens} were accepted"
        )
        self.matcher.rollback(num_tokens)
        self.num_processed_tokens -= num_tokens

    def fill_bitmask(self, bitmask: Any, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()
        self.num_processed_tokens = 0


BACKENDS = {"xgrammar": XgrammarBackend}
