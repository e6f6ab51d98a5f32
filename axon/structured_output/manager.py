"""StructuredOutputManager: the scheduler's grammar side, in the engine-core process.

    add_request ──init_request──> compile on a thread pool (or a cache hit: ready at once)
        │                               │
        └─ WAITING_FOR_FSM ── ready ────┘──> WAITING ──> RUNNING
    each step: grammar_output(sampling requests) -> packed bitmask rows, one per constrained row
    after each step: accept(request, token) -> CONTINUE | TERMINATED | REJECTED

Compiled grammars are cached by (kind, spec, whitespace policy) and shared; each request gets its own
matcher over them. With a reasoning parser, a request is constrained only once its reasoning has
ended (the end marker's tokens seen after the last start marker), so the grammar shapes the
answer and never the thinking.

Why here and not in the runner: the grammar must advance with every accepted token and decide
termination, which is the scheduler's business (it finishes requests); the runner stays a pure
function of SchedulerOutput and only applies the rows it is given.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

from axon.sampling_params import StructuredOutputsParams
from axon.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from axon.structured_output.options import StructuredOutputsOptions, Whitespace

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str, Whitespace]  # (kind, spec, whitespace between JSON tokens)


class Verdict(enum.Enum):
    CONTINUE = enum.auto()
    TERMINATED = enum.auto()  # the grammar is complete: finish with reason "stop"
    REJECTED = enum.auto()  # the token breaks the grammar (a bug, or a failed compile): abort


@dataclass
class ReasoningTracker:
    """Whether a request's reasoning has ended, from its token ids (prompt, then each output)."""

    start_ids: list[int]
    end_ids: list[int]
    ended: bool = False

    def scan_prompt(self, token_ids: list[int]) -> None:
        self.ended = _last_index(token_ids, self.end_ids) > _last_index(token_ids, self.start_ids)

    def update(self, token_ids: list[int]) -> bool:
        """After one new token: True if this token completed the end marker."""
        n = len(self.end_ids)
        if not self.ended and n and token_ids[-n:] == self.end_ids:
            self.ended = True
            return True
        return False


@dataclass
class StructuredOutputRequest:
    params: StructuredOutputsParams
    key: GrammarKey
    grammar: StructuredOutputGrammar | None = None
    error: str | None = None
    reasoning: ReasoningTracker | None = None  # None: constrain from the first output token
    future: Future[Any] | None = field(default=None, repr=False)

    @property
    def is_constraining(self) -> bool:
        """This request's next token is masked (ready, compiled, past any reasoning)."""
        return self.grammar is not None and (self.reasoning is None or self.reasoning.ended)


class StructuredOutputManager:
    def __init__(
        self,
        options: StructuredOutputsOptions,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        reasoning_markers: tuple[str, str] | None = None,
        max_rollback_tokens: int = -1,  # -1: unbounded (xgrammar's default)
    ) -> None:
        self.options = options
        # Called once, on the first structured request: loading a tokenizer takes a moment, and
        # the caller (the engine) owns how tokenizers are loaded.
        self.load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.reasoning_markers = reasoning_markers
        self.max_rollback_tokens = max_rollback_tokens
        self._pool = ThreadPoolExecutor(options.num_compile_threads, thread_name_prefix="axon-grammar")
        self._backend: StructuredOutputBackend | None = None
        self._backend_lock = threading.Lock()
        self._marker_ids: tuple[list[int], list[int]] | None = None
        self._cache: OrderedDict[GrammarKey, Any] = OrderedDict()
        self._inflight: dict[GrammarKey, Future[Any]] = {}
        self.num_cache_hits = 0
        self.num_compiles = 0

    @classmethod
    def from_config(cls, config: Any, load_tokenizer: Callable[[], Any]) -> StructuredOutputManager:
        """From the resolved AxonConfig (vocabulary, options, reasoning markers) and the model's
        tokenizer loader."""
        from axon.reasoning import get_reasoning_parser
        from axon.structured_output.options import parse_structured_outputs_config

        so_config = config.structured_outputs_config
        markers = None
        if so_config.reasoning_parser is not None:
            parser = get_reasoning_parser(so_config.reasoning_parser)
            markers = (parser.start_marker, parser.end_marker)
        return cls(
            parse_structured_outputs_config(so_config.structured_outputs_config),
            load_tokenizer=load_tokenizer,
            vocab_size=int(config.model_config.hf_config["vocab_size"]),
            reasoning_markers=markers,
        )

    # ---- requests in ---------------------------------------------------------------------------
    def init_request(self, request: Any) -> bool:
        """Attach grammar state to ``request``; True if it must wait for a compile."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        kind, spec = params.kind_and_spec()
        so = StructuredOutputRequest(params=params, key=(kind.value, spec, self.options.whitespace(params)))
        request.structured_output_request = so
        if so.key in self._cache:
            self._cache.move_to_end(so.key)
            self.num_cache_hits += 1
            self._make_matcher(request, self._cache[so.key])
            return False
        future = self._inflight.get(so.key)
        if future is None:
            future = self._pool.submit(self._compile, so.key)
            self._inflight[so.key] = future
            self.num_compiles += 1
        so.future = future
        return True

    def is_ready(self, request: Any) -> bool:
        """True once the compile finished (then the matcher exists, or the error is recorded)."""
        so: StructuredOutputRequest = request.structured_output_request
        if so.future is None:
            return True
        if not so.future.done():
            return False
        future, so.future = so.future, None
        self._inflight.pop(so.key, None)
        try:
            compiled = future.result()
        except Exception as e:  # noqa: BLE001 (validated in the front end; reported, never raised)
            so.error = f"grammar compilation failed: {e}"
            logger.error("request %s: %s", request.req_id, so.error)
            return True
        self._remember(so.key, compiled)
        self._make_matcher(request, compiled)
        return True

    def wait_any(self, requests: list[Any], timeout_s: float | None) -> None:
        """Block until one of these requests' compiles is done (the engine has nothing else to do)."""
        futures = [r.structured_output_request.future for r in requests]
        pending = [f for f in futures if f is not None]
        if pending:
            wait_futures(pending, timeout=timeout_s, return_when="FIRST_COMPLETED")

    # ---- the step ------------------------------------------------------------------------------
    def grammar_output(self, requests: list[Any]) -> tuple[list[str], Any] | None:
        """(req_ids, packed bitmask [len(req_ids), ceil(V / 32)] int32 numpy) for those of
        ``requests`` (all of which sample this step) whose next token is constrained."""
        rows = [r for r in requests if getattr(r, "structured_output_request", None) is not None]
        rows = [r for r in rows if r.structured_output_request.is_constraining]
        if not rows:
            return None
        assert self._backend is not None, "a ready grammar implies a backend"
        bitmask = self._backend.allocate_bitmask(len(rows))  # [len(rows), ceil(V / 32)] int32
        for i, request in enumerate(rows):
            request.structured_output_request.grammar.fill_bitmask(bitmask, i)
        return [r.req_id for r in rows], bitmask.numpy()

    def accept(self, request: Any, token_id: int) -> Verdict:
        """Advance ``request``'s grammar over the token just appended to it."""
        so: StructuredOutputRequest | None = getattr(request, "structured_output_request", None)
        if so is None:
            return Verdict.CONTINUE
        if so.error is not None:
            return Verdict.REJECTED
        if so.reasoning is not None and not so.reasoning.ended:
            so.reasoning.update(request.all_token_ids)
            return Verdict.CONTINUE  # thinking (or the end marker itself) is not the grammar's
        assert so.grammar is not None, f"request {request.req_id} sampled before its grammar was ready"
        if not so.grammar.accept_tokens(request.req_id, [token_id]):
            return Verdict.REJECTED
        return Verdict.TERMINATED if so.grammar.is_terminated() else Verdict.CONTINUE

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- internals -----------------------------------------------------------------------------
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (loading the tokenizer takes a moment; unstructured
        workloads never pay it). Thread-safe: compile threads race to it."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def _make_backend(self) -> StructuredOutputBackend:
        from axon.structured_output.backend_xgrammar import BACKENDS

        name = self.options.resolved_backend
        if name not in BACKENDS:
            raise ValueError(
                f"structured outputs backend {name!r} is not built; supported: {sorted(BACKENDS)}"
            )
        tokenizer = self.load_tokenizer()
        if self.reasoning_markers is not None:
            start, end = self.reasoning_markers
            self._marker_ids = (
                list(tokenizer.encode(start, add_special_tokens=False)),
                list(tokenizer.encode(end, add_special_tokens=False)),
            )
        return BACKENDS[name](tokenizer, self.vocab_size)

    def _compile(self, key: GrammarKey) -> Any:
        from axon.sampling_params import GrammarKind

        kind, spec, whitespace = key
        return self.backend().compile(GrammarKind(kind), spec, whitespace)

    def _remember(self, key: GrammarKey, compiled: Any) -> None:
        self._cache[key] = compiled
        self._cache.move_to_end(key)
        while len(self._cache) > self.options.cache_size:
            self._cache.popitem(last=False)

    def _make_matcher(self, request: Any, compiled: Any) -> None:
        so: StructuredOutputRequest = request.structured_output_request
        backend = self.backend()
        so.grammar = backend.matcher(compiled, self.max_rollback_tokens)
        if self._marker_ids is not None:
            so.reasoning = ReasoningTracker(*self._marker_ids)
            so.reasoning.scan_prompt(request.all_token_ids)
        # A request resumed with outputs already made (not the case today: grammars init at
        # arrival) would need its grammar advanced over them; assert the assumption.
        assert not request.output_token_ids, f"request {request.req_id} has outputs before its grammar"


def _last_index(token_ids: list[int], pattern: list[int]) -> int:
    """Start of the last occurrence of ``pattern`` in ``token_ids``, or -1."""
    n = len(pattern)
    if not n:
        return -1
    first = pattern[0]
    for i in range(len(token_ids) - n, -1, -1):
        if token_ids[i] == first and token_ids[i : i + n] == pattern:
            return i
    return -1
