"""ModelRunner: SchedulerOutput -> model inputs -> forward -> sample -> ModelRunnerOutput.

One step's tokens are flattened across requests (see the layout in
``axon/model/layers/attention/backend.py``). ``prepare_inputs`` builds host-side inputs;
``run_forward`` is the single place a forward happens, which is where bucketed, compiled
execution slots in; sampling then touches only the rows that complete a sequence's known tokens.
A pooling request samples nothing: its rows' hidden states are kept until its prompt is
computed, then pooled by the model's pooler (``axon/model/pooler.py``) into its vector.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import record_function

from axon.distributed.parallel_state import get_tp_group
from axon.forward_context import set_forward_context
from axon.kv_transfer.ec_connector import ECSharedStorageConnector
from axon.model.layers.attention import CommonAttentionMetadata, Segment, describe_step
from axon.model.layers.lora import LoRASlots
from axon.model.models.llama import EmbedRows
from axon.model.pooler import finish_embedding, pool
from axon.sample.grammar import GrammarBitmask
from axon.sample.logprobs import compute_logprobs, to_lists
from axon.sample.metadata import build_sampling_metadata
from axon.sample.rejection import rejection_sample
from axon.sample.sampler import Sampler
from axon.scheduler_output import BucketStep, LogprobsLists, ModelRunnerOutput, SchedulerOutput
from axon.spec_decode.proposer import DraftBatch, DraftRequest, Proposer
from axon.worker.buckets import Buckets, bucket_name
from axon.worker.compiler import BucketCompiler
from axon.worker.input_batch import CachedRequestState, RequestStates
from axon.worker.lora import LoRAManager
from axon.worker.multimodal import EncoderCache, encode_request_images, step_images


@dataclass
class StepInputs:
    req_ids: list[str]
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: CommonAttentionMetadata  # the step's description; the backend builds its own
    # Rows whose last scheduled token is the sequence's last known token: they sample.
    sample_req_idx: list[int]
    # [num_sampled rows] token index of each sampling row: a request verifying k drafts has
    # k + 1 rows (its last known token and each draft), any other sampling request one.
    logits_indices: torch.Tensor
    drafts: list[list[int]]  # per sampling request (aligned with sample_req_idx): drafts verified
    bucket: BucketStep | None = None  # the shape the step runs at
    graph: Callable[..., torch.Tensor] | None = None  # its compiled graph; None: eager
    # Attention data parallelism: this rank's requests alone, and their rows of the step.
    attention: CommonAttentionMetadata | None = None
    attention_rows: torch.Tensor | None = None
    # A multimodal step's image tokens (their features; positions are then [3, T]).
    # Rows whose input embedding is given (images' features, prompt embeddings); such a step
    # runs eagerly.
    embeds: EmbedRows | None = None
    lora_slots: LoRASlots | None = None  # the rows by LoRA adapter slot; None: none


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        buckets: Buckets | None = None,
        compiler: BucketCompiler | None = None,
        pooling_type: str | None = None,
        proposer: Proposer | None = None,
        ec_connector: ECSharedStorageConnector | None = None,
        lora_manager: LoRAManager | None = None,
    ) -> None:
        self.model = model
        self.pooling_type = pooling_type  # the model's pooler (runner="pooling" only)
        self.attention_layers = model.attention_layers()
        self.block_size = block_size
        group = get_tp_group()  # decode context parallelism: this rank's share of each sequence
        self.dcp = (group.dcp_size, group.dcp_rank)
        # Attention data parallelism: this rank attends (and keeps the KV of) its own requests.
        self.attention_rank = group.rank if group.attention_dp else None
        self.vocab_size = vocab_size
        self.device = device
        self.buckets = buckets  # steps are padded to them only to run in a compiled graph
        self.compiler = compiler  # None: eager
        self.requests = RequestStates(device, group.size if group.attention_dp else 1)
        self.sampler = Sampler()
        self.proposer = proposer  # speculative decoding: drafts after each step (None: off)
        self.encoder_cache = EncoderCache()  # a multimodal model's vision features by image
        self.ec_connector = ec_connector  # encoder disaggregation: features from an encoder server
        self.lora_manager = lora_manager  # LoRA adapters' slots (None: LoRA is off)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.requests.update(sched)
        if self.proposer is not None:
            self.proposer.forget(sched.finished_req_ids | sched.preempted_req_ids)
            for new in sched.scheduled_new_reqs:
                self.proposer.begin(new.req_id, new.num_computed_tokens)
        if sched.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        with record_function("prepare_inputs"):
            inputs = self.prepare_inputs(sched)
        with record_function(f"forward {inputs.bucket.name}"):
            hidden, aux = self.run_forward(inputs)  # [T, hidden], [T, aux] or None
        with record_function("sample"):
            sampled, logprobs = self.sample(inputs, hidden)
        prompt_logprobs = self.compute_prompt_logprobs(inputs, hidden, sched)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            bucket=inputs.bucket,
            pooler_output=self.pool(inputs, hidden),
            spec_token_ids=self.propose(sched, inputs, sampled, hidden if aux is None else aux),
        )

    def propose(
        self, sched: SchedulerOutput, inputs: StepInputs, sampled: list[list[int]], hidden: torch.Tensor
    ) -> dict[str, list[int]]:
        """Drafts for the next step of every request that sampled (none while the policy says 0)."""
        if self.proposer is None:
            return {}
        requests = []
        loc = inputs.attn_metadata.query_start_loc
        drafts_of = dict(zip(inputs.sample_req_idx, inputs.drafts, strict=True))
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            if state.pooling_params is not None:
                continue
            drafts = drafts_of.get(i, [])
            num_known_rows = loc[i + 1] - loc[i] - len(drafts)
            requests.append(
                DraftRequest(
                    req_id=req_id,
                    token_ids=state.token_ids,
                    block_ids=state.block_ids,
                    row=loc[i],
                    first_position=state.num_computed_tokens,
                    num_valid_rows=num_known_rows + max(len(sampled[i]) - 1, 0),
                    wants_drafts=bool(sampled[i]),
                )
            )
        batch = DraftBatch(requests, sched.num_draft_tokens, hidden if self.proposer.hidden_states else None)
        drafts = self.proposer.propose(batch)
        return {r.req_id: d for r, d in zip(requests, drafts, strict=True) if d}

    def pool(self, inputs: StepInputs, hidden: torch.Tensor) -> dict[str, list[float]]:
        """The finished vectors of the pooling requests whose prompt this step completed; the
        hidden states of the others' segments are kept for the step that completes them."""
        out: dict[str, list[float]] = {}
        loc = inputs.attn_metadata.query_start_loc
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            params = state.pooling_params
            if params is None:
                continue
            assert self.pooling_type is not None, "pooling requests need a pooling model"
            # A copy: a compiled graph's output buffer is reused by the next step.
            state.hidden_parts.append(hidden[loc[i] : loc[i + 1]].to(torch.float32, copy=True))
            if inputs.attn_metadata.seq_lens[i] < state.num_tokens:
                continue  # a prefill segment
            states = torch.cat(state.hidden_parts)[None]  # [1, L, hidden]
            mask = torch.ones(states.shape[:2], dtype=torch.int64, device=states.device)
            vector = pool(states, mask, self.pooling_type)[0]
            out[req_id] = finish_embedding(vector, params.dimensions, params.normalize).tolist()
            state.hidden_parts = []
        return out

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        req_ids = list(sched.num_scheduled_tokens)
        token_ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        sample_req_idx: list[int] = []
        logits_indices: list[int] = []
        drafts: list[list[int]] = []
        is_decode = True  # every request computes its last known token and its drafts only
        # Requests whose images have not been encoded yet: all of them in one vision-tower call.
        new = [
            s
            for s in (self.requests[r] for r in req_ids)
            if s.images is not None and s.encoded_images is None
        ]
        if new:
            encoded = encode_request_images(
                self.model,
                [(s.prompt_token_ids, s.images) for s in new],
                self.encoder_cache,
                self.ec_connector,
            )
            for state, images in zip(new, encoded, strict=True):
                state.encoded_images = images
        row_slots: list[int] = []  # each row's LoRA adapter slot (-1: the base model)
        step_adapters = (
            {s.lora.int_id for s in (self.requests[r] for r in req_ids) if s.lora is not None}
            if self.lora_manager is not None
            else set()
        )
        image_parts = []  # (a request's images, start, end, its first row)
        embed_parts = []  # (its first row, its given prompt embeddings for the step's rows)
        image_positions = []  # (its first row, its [3, n] positions)
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + sched.num_scheduled_tokens[req_id]
            spec = sched.scheduled_spec_decode_tokens.get(req_id, [])
            known_end = end - len(spec)
            assert known_end <= state.num_tokens, f"{req_id}: scheduled past its known tokens"
            assert not spec or known_end == state.num_tokens, f"{req_id}: drafts after a partial prefill"
            if state.images is not None:
                image_parts.append((state.encoded_images, start, end, len(token_ids)))
                image_positions.append((len(token_ids), state.encoded_images.positions_for(start, end)))
                positions += image_positions[-1][1][0].tolist()  # a text token's three are equal
            else:
                positions += range(start, end)
            if state.prompt_embeds is not None and start < state.prompt_embeds.shape[0]:
                embed_parts.append(
                    (len(token_ids), state.prompt_embeds[start : min(end, state.prompt_embeds.shape[0])])
                )
            token_ids += state.token_ids[start:known_end] + spec
            if self.lora_manager is not None:
                slot = -1 if state.lora is None else self.lora_manager.slot_for(state.lora, step_adapters)
                row_slots += [slot] * (len(token_ids) - len(row_slots))
            segments.append(Segment(state.block_ids, start, end, state.window_block_ids))
            is_decode = is_decode and end - start == len(spec) + 1
            if known_end == state.num_tokens and state.pooling_params is None:
                sample_req_idx.append(i)
                logits_indices += range(len(token_ids) - len(spec) - 1, len(token_ids))
                drafts.append(spec)
        num_tokens = len(token_ids)
        images = step_images(image_parts, self.device) if image_parts else None
        embeds = images
        if embed_parts:
            assert images is None, "a model takes images or prompt embeddings, not both"
            rows = torch.cat([torch.arange(r, r + e.shape[0]) for r, e in embed_parts]).to(self.device)
            embeds = EmbedRows(rows, torch.cat([e for _, e in embed_parts]))
        graph, padded, block_cols = None, num_tokens, None
        if self.buckets is not None and self.compiler is not None and embeds is None:
            target = self.buckets.pad_tokens(num_tokens, is_decode)
            graph = self.compiler.graph_for(target)
            if graph is not None:
                # Pad to the bucket: padded rows write no KV slot (-1) and no row samples them.
                # A bucket still compiling runs eagerly at its exact shape: padding buys nothing.
                padded = target
                token_ids += [0] * (padded - num_tokens)
                positions += [0] * (padded - num_tokens)
                block_cols = self.buckets.pad_context_blocks(max(len(s.block_ids) for s in segments))
        dev = self.device
        metadata = describe_step(
            segments, self.block_size, dev, num_tokens=padded, num_block_cols=block_cols, dcp=self.dcp
        )
        attention, attention_rows = None, None
        if self.attention_rank is not None:
            loc = metadata.query_start_loc
            mine = [
                i for i, r in enumerate(req_ids) if self.requests[r].attention_rank == self.attention_rank
            ]
            attention = describe_step([segments[i] for i in mine], self.block_size, dev)
            rows = [t for i in mine for t in range(loc[i], loc[i + 1])]
            attention_rows = torch.tensor(rows, dtype=torch.int64, device=dev)
        step_positions = torch.tensor(positions, dtype=torch.int64, device=dev)
        if images is not None:  # M-RoPE: an image token's three positions differ
            step_positions = step_positions.expand(3, -1).clone()
            for row0, pos in image_positions:
                step_positions[:, row0 : row0 + pos.shape[1]] = pos.to(dev)
        return StepInputs(
            req_ids=req_ids,
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=dev),
            positions=step_positions,
            attn_metadata=metadata,
            sample_req_idx=sample_req_idx,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            drafts=drafts,
            bucket=BucketStep(bucket_name(padded, is_decode), num_tokens, padded),
            graph=graph,
            attention=attention,
            attention_rows=attention_rows,
            embeds=embeds,
            lora_slots=(
                LoRASlots.from_rows(row_slots, len(self.lora_manager.slots), dev) if row_slots else None
            ),
        )

    def run_forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[padded tokens, hidden] through the bucket's compiled graph when it is ready, and the
        auxiliary hidden states an EAGLE3 head reads (None unless the target returns them)."""
        step = inputs.attn_metadata if inputs.attention is None else inputs.attention
        with set_forward_context(step, self.attention_layers, inputs.attention_rows, inputs.lora_slots):
            if inputs.embeds is not None:  # eager: a step with given embeddings
                out = self.model(inputs.input_ids, inputs.positions, embeds=inputs.embeds)
            else:
                out = (inputs.graph or self.model)(inputs.input_ids, inputs.positions)
        return out if isinstance(out, tuple) else (out, None)

    def sample(
        self, inputs: StepInputs, hidden: torch.Tensor
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """Each sampling request's new tokens: one, or its accepted drafts and one more."""
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        if not inputs.sample_req_idx:
            return sampled, {}
        states = [self.requests[inputs.req_ids[i]] for i in inputs.sample_req_idx]
        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [num_rows, vocab]
        # Row j of a request verifying drafts sees its drafts before j as output tokens.
        rows = [
            (s, s.output_token_ids + d[:j]) for s, d in zip(states, inputs.drafts) for j in range(len(d) + 1)
        ]
        metadata = build_sampling_metadata(
            [s.sampling_params for s, _ in rows],
            [s.prompt_token_ids for s, _ in rows],
            [out for _, out in rows],
            [s.generator for s, _ in rows],
            self.vocab_size,
            self.device,
        )
        metadata.grammar_bitmask = GrammarBitmask.from_output(
            self.requests.grammar_output, [s.req_id for s, _ in rows], self.device
        )
        if any(inputs.drafts):
            verified = rejection_sample(logits, metadata, inputs.drafts)
            new_tokens, logprobs = verified.token_ids, verified.logprobs
        else:
            out = self.sampler(logits, metadata)
            new_tokens, logprobs = [[t] for t in out.sampled_token_ids.tolist()], out.logprobs
        for i, state, tokens in zip(inputs.sample_req_idx, states, new_tokens, strict=True):
            sampled[i] = tokens
            for token in tokens:
                state.append_output(token)
        return sampled, self._split_logprobs(states, new_tokens, logprobs)

    @staticmethod
    def _split_logprobs(
        states: list[CachedRequestState], new_tokens: list[list[int]], logprobs
    ) -> dict[str, LogprobsLists]:
        """Each asking request's rows of the step's logprobs (one row per new token)."""
        if logprobs is None:
            return {}
        wanted = [s.sampling_params.logprobs for s in states]
        lists = to_lists(logprobs, [k or 0 for k, tokens in zip(wanted, new_tokens) for _ in tokens])
        out, row = {}, 0
        for state, k, tokens in zip(states, wanted, new_tokens, strict=True):
            if k is not None:
                end = row + len(tokens)
                out[state.req_id] = LogprobsLists(
                    lists.token_ids[row:end], lists.logprobs[row:end], lists.ranks[row:end]
                )
            row += len(tokens)
        return out

    def compute_prompt_logprobs(
        self, inputs: StepInputs, hidden: torch.Tensor, sched: SchedulerOutput
    ) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens 1.. whose predicting position was computed this step."""
        out: dict[str, LogprobsLists] = {}
        for i, req_id in enumerate(inputs.req_ids):
            state = self.requests[req_id]
            k = None if state.sampling_params is None else state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = state.num_computed_tokens
            # Positions p predict token p + 1; only prompt targets count.
            end = min(start + sched.num_scheduled_tokens[req_id], len(state.prompt_token_ids) - 1)
            if end <= start:
                continue
            base = inputs.attn_metadata.query_start_loc[i]
            logits = self.model.compute_logits(hidden[base : base + end - start])  # [n, vocab]
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
            lp = compute_logprobs(logits.float(), targets, k)
            out[req_id] = to_lists(lp, [k] * (end - start))
        return out
