"""OutputProcessor: EngineCoreOutputs -> RequestOutputs (text, logprobs, stop strings, n > 1).

A request with n > 1 is one parent with n children in the core; the parent gathers the
children's CompletionOutputs. A stop string found here finishes the request, and its id is
returned so that the engine aborts it in the core. A pooling request (an embedding) is one core
request whose single output carries its vector; it becomes an ``EmbeddingRequestOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from axon.engine.detokenizer import IncrementalDetokenizer
from axon.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from axon.sampling_params import RequestOutputKind, SamplingParams
from axon.scheduler_output import LogprobsLists
from axon.step_outputs import EngineCoreOutput


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    output_kind: RequestOutputKind
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    kv_transfer_params: dict[str, Any] | None = None  # from a prefill server, with the finish


@dataclass
class PoolingRequest:
    request_id: str  # also its id in the core
    prompt: str | None
    prompt_token_ids: list[int]


AnyRequestOutput = RequestOutput | EmbeddingRequestOutput


@dataclass
class ChildState:
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_sent_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.children: dict[str, ChildState] = {}
        self.parents: dict[str, ParentRequest] = {}
        self.pooling: dict[str, PoolingRequest] = {}

    def check_new_ids(self, child_ids: list[str]) -> None:
        """The engine core takes an id only once while it runs: a reused one is the caller's
        error (ValueError), never an engine-core crash."""
        for child_id in child_ids:
            if child_id in self.children or child_id in self.pooling:
                raise ValueError(f"request id {child_id!r} is already in use by an unfinished request")

    def add_request(self, parent: ParentRequest, child_id: str, index: int, params: SamplingParams) -> None:
        self.parents[parent.request_id] = parent
        self.children[child_id] = ChildState(
            parent=parent,
            index=index,
            detokenizer=IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids, params),
            want_logprobs=params.logprobs is not None,
        )
        if params.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]  # the first prompt token has no logprob

    def add_pooling_request(self, request: PoolingRequest) -> None:
        self.pooling[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.children or self.pooling)

    def abort_requests(self, child_ids: list[str]) -> list[RequestOutput]:
        """Finish children from outside (user abort); returns outputs for finished parents."""
        outs = []
        for child_id in child_ids:
            self.pooling.pop(child_id, None)  # an aborted embedding has no output
            child = self.children.get(child_id)
            if child is not None:
                out = self._finish(child_id, child, "abort", None)
                if out is not None:
                    outs.append(out)
        return outs

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[AnyRequestOutput], list[str]]:
        """Returns (request outputs to deliver, child ids that a stop string ended)."""
        request_outputs: list[AnyRequestOutput] = []
        stopped_by_string: list[str] = []
        for out in outputs:
            if out.req_id in self.pooling:
                request_outputs.append(self._embedding(self.pooling.pop(out.req_id), out))
                continue
            child = self.children.get(out.req_id)
            if child is None:
                continue  # finished here already (stop string) while the core ran one more step
            parent = child.parent
            parent.num_cached_tokens = out.num_cached_tokens
            if out.kv_transfer_params is not None:
                parent.kv_transfer_params = out.kv_transfer_params
            if (
                out.new_prompt_logprobs is not None
                and parent.prompt_logprobs is not None
                and child.index == 0
            ):
                parent.prompt_logprobs += self._to_logprob_dicts(out.new_prompt_logprobs)
            child.token_ids += out.new_token_ids
            if child.want_logprobs and out.new_logprobs is not None:
                child.logprobs += self._to_logprob_dicts(out.new_logprobs)
                child.cumulative_logprob += sum(row[0] for row in out.new_logprobs.logprobs)
            stop = child.detokenizer.update(out.new_token_ids)
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if stop is not None:
                finish_reason, stop_reason = "stop", stop
                if not out.finished:
                    stopped_by_string.append(out.req_id)
            if finish_reason is not None:
                result = self._finish(out.req_id, child, finish_reason, stop_reason)
            else:
                result = self._make_output(child, finished=False)
            if result is not None:
                request_outputs.append(result)
        return request_outputs, stopped_by_string

    @staticmethod
    def _embedding(request: PoolingRequest, out: EngineCoreOutput) -> EmbeddingRequestOutput:
        assert out.pooled is not None, f"pooling request {out.req_id} finished without a vector"
        return EmbeddingRequestOutput(
            request_id=request.request_id,
            outputs=EmbeddingOutput(out.pooled),
            prompt_token_ids=request.prompt_token_ids,
            prompt=request.prompt,
            num_cached_tokens=out.num_cached_tokens,
        )

    def _finish(
        self, child_id: str, child: ChildState, finish_reason: str, stop_reason: int | str | None
    ) -> RequestOutput | None:
        child.finish_reason, child.stop_reason = finish_reason, stop_reason
        del self.children[child_id]
        child.parent.num_finished += 1
        result = self._make_output(child, finished=True)
        if child.parent.num_finished == child.parent.n:
            del self.parents[child.parent.request_id]
        return result

    def _make_output(self, child: ChildState, finished: bool) -> RequestOutput | None:
        parent = child.parent
        kind = parent.output_kind
        delta = kind == RequestOutputKind.DELTA
        # DELTA: only what is new since the last output; otherwise everything so far.
        start = child.num_sent_tokens if delta else 0
        child.num_sent_tokens = len(child.token_ids)
        completion = CompletionOutput(
            index=child.index,
            text=child.detokenizer.next_delta(finished) if delta else child.detokenizer.output_text,
            token_ids=child.token_ids[start:],
            cumulative_logprob=child.cumulative_logprob if child.want_logprobs else None,
            logprobs=child.logprobs[start:] if child.want_logprobs else None,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )
        parent.completions[child.index] = completion
        all_done = parent.num_finished == parent.n
        if kind == RequestOutputKind.FINAL_ONLY and not all_done:
            return None
        outputs = [completion] if delta else [parent.completions[i] for i in sorted(parent.completions)]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=outputs,
            finished=all_done,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params,
        )

    def _to_logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        rows = []
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks, strict=True):
            row = {
                tok: Logprob(lp, i, self._decode(tok)) for i, (tok, lp) in enumerate(zip(ids[1:], lps[1:]), 1)
            }
            row.setdefault(ids[0], Logprob(lps[0], rank, self._decode(ids[0])))
            rows.append(row)
        return rows

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])
