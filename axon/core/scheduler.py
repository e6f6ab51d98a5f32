"""The holdback scheduler: FCFS admission control over vLLM V1's token-count scheduling.

Each step spends a budget of ``max_num_batched_tokens``:
  1. running requests first, each catching ``num_computed_tokens`` up with ``num_tokens`` (a
     decode is one token; a long prompt's next prefill segment is whatever budget is left);
     when KV runs out anyway, the newest running request is preempted (recomputed later);
  2. then the holdback queue, admitted in FCFS order only while admission holds: a batch slot
     is free and the KV cache holds the running set at its worst case, every request at its
     own longest (prompt + max_tokens + draft slots, at most ``max_model_len``), so decodes
     never preempt each other into a livelock. The first refusal stops admission, which keeps
     the order fair.
No phases: a prompt longer than the budget is simply prefilled over several steps.

Pooling requests (embeddings) are scheduled like any prefill and batched with everything
else; the step that computes a pooling request's last prompt token returns its pooled vector,
which finishes it (reason "stop"): it never samples and never holds a placeholder. With an
encoder-only model (``encoder_only``: bidirectional attention, no KV cache) a prompt is never
split across steps: it is admitted only when the whole prompt fits the step's remaining budget,
and a prompt longer than ``max_num_batched_tokens`` runs alone in a step of its own.

A multimodal request's images are encoded in the step that admits it, so admission also spends
an encoder budget, ``max_num_encoder_input_tokens`` image tokens per step: a request whose
images would pass what is left waits for the next step (FCFS), and one whose images alone
exceed the budget is admitted in a step that encodes no other images.

With LoRA (``max_loras``), the running set holds at most ``max_loras`` adapters: a request whose
adapter would be one more waits (FCFS) until the requests of a running adapter are done.

Speculative decoding (``spec_config``): after each step the worker drafts tokens for every
request that sampled (``ModelRunnerOutput.spec_token_ids``); the request keeps them in
``spec_token_ids`` and the next step schedules them with its known tokens (``num_tokens_with_spec``),
so the worker verifies them in one forward. A draft model or EAGLE3 head writes KV for the
positions it drafts, so its requests get ``num_lookahead_tokens`` slots beyond the step. When
the step's output comes, the rejected drafts are rolled back (``num_computed_tokens``) and the
blocks that held only them are released. ``DraftPolicy`` picks how many to draft per step.

Disaggregated serving (``kv_connector``, axon/kv_transfer/base.py): a request whose prompt KV
another server holds is admitted like any other, but its blocks are first filled by the
connector: it waits in ``waiting_for_remote_kv`` (status WAITING_FOR_REMOTE_KVS, holding its
blocks and a place in the running cap) until the worker reports the load, then returns to the
head of the queue with every prompt token but the last computed. A failed load recomputes the
prompt (``kv_load_failure_policy`` "recompute") or fails the request ("fail"). A finished
request that a decode server will read keeps its blocks (``sending``) until the connector says
they were read, or its wait timed out.

Async scheduling: the engine may schedule step N+1 before step N's sampled tokens are known.
Every request that samples in a step carries a placeholder for that token
(``num_output_placeholders``) until ``update_from_output`` brings it, and is scheduled one token
past it; the worker, which runs the steps in order, already holds the token when step N+1
starts (synchronous steps settle each placeholder before the next schedule). A request whose
in-flight token ends it by length is not scheduled ahead; one that an in-flight token ends
otherwise (EOS, a stop token) wastes one row of step N+1, which nobody sees.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable

from axon.config import CacheConfig, SchedulerConfig
from axon.core.kv_cache_manager import KVCacheManager
from axon.core.kv_cache_utils import max_concurrency
from axon.core.request import Request, RequestStatus
from axon.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler, KVTransferStats
from axon.scheduler_output import (
    CachedRequestData,
    GrammarOutput,
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from axon.spec_decode.config import SpecDecodeConfig
from axon.spec_decode.policy import DraftPolicy
from axon.step_outputs import EngineCoreOutput, SchedulerStats, SpecDecodingStats
from axon.structured_output.manager import StructuredOutputManager, Verdict

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        structured_output_manager: StructuredOutputManager | None = None,
        encoder_only: bool = False,
        spec_config: SpecDecodeConfig | None = None,
        kv_connector: KVConnectorScheduler | None = None,
        kv_load_failure_policy: str = "recompute",
        window: int | None = None,
        max_loras: int | None = None,
    ) -> None:
        """``window``: the sliding window of a model whose layers are partly sliding-window, for
        the KV cache's window group (kv_cache_manager.py); None: one group. ``max_loras``: the
        LoRA adapters one step may hold (None: LoRA is off)."""
        assert scheduler_config.max_num_batched_tokens is not None, (
            "resolve_config sets max_num_batched_tokens"
        )
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_num_encoder_input_tokens = (
            scheduler_config.max_num_encoder_input_tokens or self.max_num_batched_tokens
        )
        self.max_model_len = max_model_len
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        self.encoder_only = encoder_only
        # An encoder keeps no KV, so there is no prefix to reuse.
        self.enable_caching = cache_config.enable_prefix_caching and not encoder_only
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, max_model_len, self.enable_caching, window
        )
        self.max_running = self.max_num_seqs
        # Holdback admission (``_worst_case_blocks``): vllm-neuron caps the running set at the
        # requests of max_model_len tokens the cache holds; a request's own max_tokens narrows its
        # worst case, so 64 requests of 512 + 128 tokens all run where 45 of 4,096 would fit.
        self.admission_kv_limit = scheduler_config.admission_kv_limit
        self.num_usable_blocks = num_blocks - 1  # block 0 is the null block
        full_length = max_concurrency(
            num_blocks,
            self.block_size,
            max_model_len,
            self.kv_cache_manager.max_blocks_per_seq(self.max_num_batched_tokens),
        )
        logger.info(
            "maximum concurrency for %d tokens per request: %d (max_num_seqs %d; requests with a "
            "smaller max_tokens fit more)",
            max_model_len,
            full_length,
            self.max_num_seqs,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # the holdback queue, FCFS
        self.running: list[Request] = []  # oldest first; the newest is preempted first
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.structured_output_manager = structured_output_manager
        self.waiting_for_grammar: dict[str, Request] = {}  # WAITING_FOR_FSM, arrival order
        self.draft_policy = None if spec_config is None else DraftPolicy(spec_config)
        # Model-based proposers write draft KV past the step's tokens; ngram writes none.
        self.drafts_need_kv = spec_config is not None and spec_config.method != "ngram"
        self.num_lookahead_tokens = 0  # this step's drafts per request (the policy's choice)
        self.max_lookahead_tokens = spec_config.num_speculative_tokens if self.drafts_need_kv else 0
        self.spec_stats = SpecDecodingStats()  # since the last report
        self.spec_totals = SpecDecodingStats()  # since start-up
        self.connector = kv_connector
        if kv_connector is not None:
            kv_connector.block_ids_of = self.kv_cache_manager.get_block_ids
        self.waiting_for_remote_kv: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KVS, admission order
        self.finished_recving: set[str] = set()  # loads the worker reported, not yet applied
        self.failed_recving: set[str] = set()
        # Finished requests whose blocks a remote reader still needs (freed when it is done), and
        # aborted ones whose blocks a load is still writing (freed when the load ends).
        self.sending: dict[str, Request] = {}
        self.aborted_recving: dict[str, Request] = {}
        self.kv_transfer_stats = KVTransferStats()  # since the last report
        self.kv_load_failure_policy = kv_load_failure_policy
        self.failed_requests: list[Request] = []  # failed loads under "fail", reported next step

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        assert request.req_id not in self.requests, f"duplicate request id {request.req_id}"
        self.requests[request.req_id] = request
        som = self.structured_output_manager
        if som is not None and not request.is_pooling and som.init_request(request):
            request.status = RequestStatus.WAITING_FOR_FSM  # its first state: no transition
            self.waiting_for_grammar[request.req_id] = request
            return
        self.waiting.append(request)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside the step (aborts, stop strings). Unknown ids are ignored."""
        finished = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_FSM:
                del self.waiting_for_grammar[req_id]
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                pass  # _free keeps its blocks until the load writing them ends
            else:
                self.waiting.remove(req)
            req.set_status(status)
            self._free(req)
            finished.append(req)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.waiting_for_grammar or self.waiting_for_remote_kv)

    def get_num_unfinished_requests(self) -> int:
        return (
            len(self.waiting)
            + len(self.running)
            + len(self.waiting_for_grammar)
            + len(self.waiting_for_remote_kv)
        )

    def has_pending_transfers(self) -> bool:
        """Blocks that a KV connector is loading or that a remote server has yet to read: the
        engine keeps stepping (the worker polls the transfers) until they are settled."""
        return bool(self.waiting_for_remote_kv or self.sending or self.aborted_recving)

    # ---- the step --------------------------------------------------------------------------
    def can_schedule_ahead(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens are known: not while
        a grammar needs each token before it can mask the next."""
        if self.draft_policy is not None:
            return False  # the next step verifies drafts made from this step's tokens
        return not self.waiting_for_grammar and not any(
            r.structured_output_request is not None for r in (*self.running, *self.waiting)
        )

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted: set[str] = set()
        spec_tokens: dict[str, list[int]] = {}

        self._promote_ready_grammars()
        self._promote_loaded_requests()
        if self.draft_policy is not None:
            # the batch the coming decode steps hold: who runs plus who is admitted, up to max_num_seqs
            batch = min(len(self.running) + len(self.waiting), self.max_running)
            self.num_lookahead_tokens = self.draft_policy.num_drafts(batch)
        budget = self._schedule_running(budget, num_scheduled, cached, preempted, spec_tokens)
        if not preempted:
            self._admit_waiting(budget, num_scheduled, new_reqs)

        for req_id, n in num_scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens += n
            if req.is_pooling:
                continue  # pooled, not sampled: update_from_output finishes it
            num_drafts = len(spec_tokens.get(req_id, ()))
            if req.num_computed_tokens - num_drafts == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # it samples this step; update_from_output settles it
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
            grammar_output=self._grammar_output(num_scheduled),
            scheduled_spec_decode_tokens=spec_tokens,
            num_draft_tokens=self.num_lookahead_tokens,
        )
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self.finished_req_ids = set()
        return out

    def _schedule_running(
        self,
        budget: int,
        num_scheduled: dict[str, int],
        cached: CachedRequestData,
        preempted: set[str],
        spec_tokens: dict[str, list[int]],
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.is_pooling and req.num_computed_tokens == req.num_tokens:
                i += 1  # its vector comes with the step in flight
                continue
            pending = req.num_output_placeholders
            if pending and (
                req.num_output_tokens + pending >= req.max_tokens
                or req.num_tokens + pending >= self.max_model_len
            ):
                i += 1  # its in-flight token is its last
                continue
            num_known = req.num_tokens + pending - req.num_computed_tokens
            n = min(num_known + len(req.spec_token_ids), budget)
            assert n > 0, f"running request {req.req_id} has nothing to compute"
            lookahead = self._lookahead(req, n)
            num_kept_blocks = self.kv_cache_manager.get_num_blocks(req.req_id)
            num_kept_window_blocks = self.kv_cache_manager.get_num_window_blocks(req.req_id)
            new_blocks = self.kv_cache_manager.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.req_id)
                if victim is req:
                    return budget
                new_blocks = self.kv_cache_manager.allocate_slots(req, n, num_lookahead_tokens=lookahead)
            if n > num_known:
                spec_tokens[req.req_id] = req.spec_token_ids[: n - num_known]
            num_scheduled[req.req_id] = n
            cached.req_ids.append(req.req_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks])
            cached.num_kept_blocks.append(num_kept_blocks)
            if self.kv_cache_manager.window is not None:
                window_ids = self.kv_cache_manager.get_window_block_ids(req.req_id)
                cached.new_window_block_ids.append(window_ids[num_kept_window_blocks:])
                cached.num_kept_window_blocks.append(num_kept_window_blocks)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            budget -= n
            i += 1
        return budget

    def _lookahead(self, req: Request, num_new_tokens: int) -> int:
        """KV slots past the step for the drafts a model-based proposer writes after it."""
        if not self.drafts_need_kv or req.is_pooling:
            return 0
        return max(
            0, min(self.num_lookahead_tokens, self.max_model_len - req.num_computed_tokens - num_new_tokens)
        )

    def _worst_case_blocks(self, req: Request) -> int:
        """The most KV blocks ``req`` can ever hold: its prompt, every token it may generate and
        a model proposer's draft slots, at most ``max_model_len`` tokens in all."""
        longest = req.num_prompt_tokens + req.max_tokens + self.max_lookahead_tokens
        return self.kv_cache_manager.max_blocks_per_seq(
            self.max_num_batched_tokens, min(self.max_model_len, longest)
        )

    def _admit_waiting(
        self, budget: int, num_scheduled: dict[str, int], new_reqs: list[NewRequestData]
    ) -> None:
        encoder_budget = self.max_num_encoder_input_tokens
        reserved = 0  # the running set's worst-case blocks (holdback admission)
        if self.admission_kv_limit and self.waiting:  # not summed in steps nobody waits in
            holders = itertools.chain(self.running, self.waiting_for_remote_kv.values())
            reserved = sum(self._worst_case_blocks(r) for r in holders)
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.waiting_for_remote_kv) < self.max_running
        ):
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token in flight: resumable once it arrives
            if not self._adapter_fits(req):
                break  # FCFS: it waits until a running adapter's requests are done
            # The worker encodes a request's images in the step that admits it.
            num_image_tokens = sum(i.num_tokens for i in req.images or ())
            if num_image_tokens > encoder_budget and encoder_budget < self.max_num_encoder_input_tokens:
                break  # FCFS: it waits for a step whose vision-tower call has room
            need = self._worst_case_blocks(req) if self.admission_kv_limit else 0
            if reserved and reserved + need > self.num_usable_blocks:
                break  # holdback: it waits until the running set's worst case leaves it room
            hit_blocks, num_hit_tokens = [], 0
            if req.num_computed_tokens == 0:  # else: a loaded request, its blocks in hand
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(req)
                if self._start_remote_load(req, hit_blocks, num_hit_tokens):
                    reserved += need
                    continue
            n = min(req.num_tokens - req.num_computed_tokens - num_hit_tokens, budget)
            if self.encoder_only and n < req.num_tokens:
                # An encoder attends over the whole prompt at once: it waits for a step with
                # room, and one longer than the whole budget runs in a step of its own.
                if budget < self.max_num_batched_tokens:
                    break
                n = req.num_tokens
            lookahead = (
                self._lookahead(req, num_hit_tokens + n)
                if n == req.num_tokens - req.num_computed_tokens - num_hit_tokens
                else 0
            )
            new_blocks = self.kv_cache_manager.allocate_slots(
                req, n, num_hit_tokens, hit_blocks, num_lookahead_tokens=lookahead
            )
            if new_blocks is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            reserved += need
            req.set_status(RequestStatus.RUNNING)
            self.running.append(req)
            req.num_computed_tokens += num_hit_tokens
            if req.num_cached_tokens < 0:  # first admission (not a resumption)
                req.num_cached_tokens = req.num_computed_tokens  # local hits and loaded tokens
                req.first_scheduled_time = time.time()
            new_reqs.append(
                NewRequestData(
                    req_id=req.req_id,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=list(req.output_token_ids),
                    sampling_params=req.sampling_params,
                    block_ids=self.kv_cache_manager.get_block_ids(req.req_id),
                    window_block_ids=self.kv_cache_manager.get_window_block_ids(req.req_id),
                    images=req.images,
                    prompt_embeds=req.prompt_embeds,
                    lora=req.lora,
                    num_computed_tokens=req.num_computed_tokens,
                    pooling_params=req.pooling_params,
                )
            )
            num_scheduled[req.req_id] = n
            budget -= n
            encoder_budget -= num_image_tokens

    def _adapter_fits(self, req: Request) -> bool:
        """A request with a LoRA adapter runs beside at most ``max_loras`` adapters in all."""
        if req.lora is None or self.max_loras is None:
            return True
        running = {r.lora.int_id for r in self.running if r.lora is not None}
        return req.lora.int_id in running or len(running) < self.max_loras

    def _start_remote_load(self, req: Request, hit_blocks: list, num_hit_tokens: int) -> bool:
        """If the connector can load part of the prompt: give the request blocks for its local
        hits and the loaded tokens, hand them to the connector, and park it until the load
        ends. False: nothing to load, admit it as usual (also when the blocks are short)."""
        if self.connector is None or req.is_pooling or req.wants_prompt_logprobs or req.kv_load_failed:
            return False
        num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_hit_tokens)
        if num_external <= 0:
            return False
        assert load_async, "axon's connectors load asynchronously"
        new_blocks = self.kv_cache_manager.allocate_slots(
            req, num_external, num_hit_tokens, hit_blocks, delay_cache_blocks=True
        )
        if new_blocks is None:
            return False  # no room for the load now: admission waits as for any request
        self.waiting.popleft()
        req.set_status(RequestStatus.WAITING_FOR_REMOTE_KVS)
        req.num_computed_tokens = num_hit_tokens  # the load's tokens count once it has ended
        self.waiting_for_remote_kv[req.req_id] = req
        self.connector.update_state_after_alloc(
            req, self.kv_cache_manager.get_block_ids(req.req_id), num_external
        )
        return True

    def _promote_loaded_requests(self) -> None:
        """Requests whose load ended go back to the head of the queue, in admission order:
        loaded, with every prompt token but the last computed (its logits are computed here);
        failed, recomputing the prompt or failing (``kv_load_failure_policy``)."""
        done = [r for r in self.waiting_for_remote_kv.values() if r.req_id in self.finished_recving]
        for req in reversed(done):
            del self.waiting_for_remote_kv[req.req_id]
            self.finished_recving.discard(req.req_id)
            if req.req_id in self.failed_recving:
                self.failed_recving.discard(req.req_id)
                # "fail" is for requests sent here to decode only; one that merely found its
                # prompt at the connector (shared storage, by content) just computes it.
                asked = (req.kv_transfer_params or {}).get("do_remote_prefill")
                req.kv_transfer_params = None
                req.kv_load_failed = True  # recomputed here (the source may still look valid)
                if self.kv_load_failure_policy == "fail" and asked:
                    req.set_status(RequestStatus.FINISHED_ERROR)
                    self._free(req)
                    self.failed_requests.append(req)
                    continue
                self.kv_cache_manager.free(req)
                req.num_computed_tokens = 0
                req.set_status(RequestStatus.WAITING)
            else:
                req.set_status(RequestStatus.WAITING)
                num_blocks = self.kv_cache_manager.get_num_blocks(req.req_id)
                req.num_computed_tokens = min(num_blocks * self.block_size, req.num_tokens - 1)
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            self.waiting.appendleft(req)
        # Loads of aborted requests: their blocks are free to reuse now.
        for req_id in list(self.aborted_recving):
            if req_id in self.finished_recving:
                self.finished_recving.discard(req_id)
                self.failed_recving.discard(req_id)
                self.kv_cache_manager.free(self.aborted_recving.pop(req_id))

    def _update_from_connector(self, output: KVConnectorOutput | None) -> None:
        if output is None or self.connector is None:
            return
        self.connector.update_connector_output(output)
        self.finished_recving |= output.finished_recving
        self.failed_recving |= output.failed_recving
        for req_id in output.finished_sending:
            req = self.sending.pop(req_id, None)
            if req is not None:
                self.kv_cache_manager.free(req)
        if output.stats is not None:
            self.kv_transfer_stats.add(output.stats)

    def _preempt(self, req: Request) -> None:
        """Recompute-preemption: drop the KV, keep the tokens, go back to the queue's head."""
        self.kv_cache_manager.free(req)
        req.set_status(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step --------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        self._update_from_connector(runner_output.kv_connector_output)
        for req in self.failed_requests:
            outputs.append(self._output_of(req, [], None, None))
        self.failed_requests = []
        for req_id, pooled in runner_output.pooler_output.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.set_status(RequestStatus.FINISHED_STOPPED)
            outputs.append(self._output_of(req, [], None, None, pooled))
            self.running.remove(req)
            self._free(req)
        for idx, req_id in enumerate(runner_output.req_ids):
            req = self.requests.get(req_id)
            if req is not None and req.is_pooling:
                continue  # pooled above, or a prefill segment
            sampled = runner_output.sampled_token_ids[idx]
            if req is not None and sampled and req.num_output_placeholders:
                req.num_output_placeholders -= 1
            elif req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted (or finished by an earlier step) or preempted while the step ran
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled and req.status == RequestStatus.RUNNING:
                self._settle_drafts(req, len(drafts), len(sampled) - 1)
            new_token_ids = []
            for token_id in sampled:
                req.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                if self._check_stop(req) or self._check_grammar(req):
                    break
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if not new_token_ids and prompt_logprobs is None:
                continue  # a prefill segment: nothing to report yet
            logprobs = runner_output.logprobs.get(req_id)
            if logprobs is not None and len(logprobs.ranks) > len(new_token_ids):
                # A stop inside a verified run of drafts: the tokens after it are not output.
                n = len(new_token_ids)
                logprobs = LogprobsLists(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
            outputs.append(self._output_of(req, new_token_ids, logprobs, prompt_logprobs))
            if req.is_finished():
                # Running, or preempted by a step scheduled ahead while its token was in flight.
                (self.running if req in self.running else self.waiting).remove(req)
                outputs[-1].kv_transfer_params = self._free(req)
            elif req.status == RequestStatus.RUNNING:
                req.spec_token_ids = self._usable_drafts(req, runner_output.spec_token_ids.get(req_id))
        return outputs

    def _settle_drafts(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Roll back the rejected drafts' KV and release the blocks that held only them. The
        block of the next token's slot stays: the next step computes that slot, and a model
        proposer has already written its own KV there (its catch-up pass over the known tokens)."""
        assert 0 <= num_accepted <= num_drafts, f"{num_accepted} of {num_drafts} drafts accepted"
        req.num_computed_tokens -= num_drafts - num_accepted
        req.spec_token_ids = []
        self.kv_cache_manager.trim(req, req.num_computed_tokens + 1)
        assert self.draft_policy is not None
        self.draft_policy.record(num_drafts, num_accepted)
        self.spec_stats.observe(num_drafts, num_accepted)
        self.spec_totals.observe(num_drafts, num_accepted)

    def _usable_drafts(self, req: Request, drafts: list[int] | None) -> list[int]:
        """The drafts that can still become output: none past max_tokens or max_model_len, and
        none for a request whose grammar must see each token before the next is allowed."""
        if not drafts or req.structured_output_request is not None:
            return []
        room = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
        return drafts[: max(room, 0)]

    @staticmethod
    def _output_of(
        req: Request,
        new_token_ids: list[int],
        new_logprobs: LogprobsLists | None,
        prompt_logprobs: LogprobsLists | None,
        pooled: list[float] | None = None,
    ) -> EngineCoreOutput:
        """The request's output of this step (finished or not)."""
        return EngineCoreOutput(
            req_id=req.req_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=prompt_logprobs,
            finish_reason=req.get_finish_reason(),
            stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            first_scheduled_time=req.first_scheduled_time,
            pooled=pooled,
        )

    def _check_stop(self, req: Request) -> bool:
        params = req.sampling_params
        last = req.output_token_ids[-1]
        # all_stop_token_ids holds EOS (unless ignore_eos) and the user's stop_token_ids.
        if req.num_output_tokens >= params.min_tokens and last in params.all_stop_token_ids:
            # Under ignore_eos the EOS id can only be here as a user stop token: report it (vLLM).
            if params.ignore_eos or last != req.eos_token_id:
                req.stop_reason = last
            req.set_status(RequestStatus.FINISHED_STOPPED)
            return True
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.set_status(RequestStatus.FINISHED_LENGTH_CAPPED)
            return True
        return False

    # ---- structured outputs (axon/structured_output/manager.py does the grammar work) ---------
    def _promote_ready_grammars(self) -> None:
        """Requests whose grammar has compiled join the holdback queue; the rest keep waiting
        while others run. With nothing else to run, wait for the first compile."""
        if not self.waiting_for_grammar:
            return
        som = self.structured_output_manager
        assert som is not None, "only the manager puts requests in waiting_for_grammar"
        if not (self.waiting or self.running):
            som.wait_any(list(self.waiting_for_grammar.values()), timeout_s=None)
        for req_id, req in list(self.waiting_for_grammar.items()):
            if som.is_ready(req):
                del self.waiting_for_grammar[req_id]
                req.set_status(RequestStatus.WAITING)
                self.waiting.append(req)

    def _grammar_output(self, num_scheduled: dict[str, int]) -> GrammarOutput | None:
        """Bitmask rows for the constrained requests that sample this step (prefill done)."""
        if self.structured_output_manager is None:
            return None
        sampling = [self.requests[req_id] for req_id in num_scheduled]
        sampling = [r for r in sampling if r.num_computed_tokens == r.num_tokens and not r.is_pooling]
        rows = self.structured_output_manager.grammar_output(sampling)
        return None if rows is None else GrammarOutput(req_ids=rows[0], bitmask=rows[1])

    def _check_grammar(self, req: Request) -> bool:
        """Advance the request's grammar over its newest token; a completed grammar finishes it
        with reason "stop", a rejected token (a bug, or a failed compile) aborts it."""
        if req.structured_output_request is None or self.structured_output_manager is None:
            return False
        verdict = self.structured_output_manager.accept(req, req.output_token_ids[-1])
        if verdict is Verdict.CONTINUE:
            return False
        terminated = verdict is Verdict.TERMINATED
        req.set_status(RequestStatus.FINISHED_STOPPED if terminated else RequestStatus.FINISHED_ABORTED)
        return True

    def _free(self, req: Request) -> dict | None:
        """Release a finished request; returns the kv_transfer_params its client gets. Its
        blocks wait where something still uses them: a load writing them (freed when it ends),
        a decode server that will read them (freed when it has)."""
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(
                req, self.kv_cache_manager.get_block_ids(req.req_id)
            )
        if self.waiting_for_remote_kv.pop(req.req_id, None) is not None:
            self.aborted_recving[req.req_id] = req
        elif delay:
            self.sending[req.req_id] = req
        else:
            self.kv_cache_manager.free(req)
        self.finished_req_ids.add(req.req_id)
        del self.requests[req.req_id]
        return params

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            spec_decoding=self.spec_stats.take() if self.draft_policy is not None else None,
            kv_transfer=self.kv_transfer_stats.take(),
            running_lora_adapters=self._adapter_names(self.running),
            waiting_lora_adapters=self._adapter_names(self.waiting),
        )

    def _adapter_names(self, requests: Iterable[Request]) -> list[str] | None:
        if self.max_loras is None:
            return None
        return sorted({r.lora.name for r in requests if r.lora is not None})
