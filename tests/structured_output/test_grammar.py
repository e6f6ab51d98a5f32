"""The grammar manager, the scheduler's waiting-for-grammar state and the sampler's bitmask,
with real xgrammar and SmolLM2's tokenizer (no model)."""

from __future__ import annotations

import json

import pytest
import torch

from axon.config import CacheConfig, SchedulerConfig
from axon.core.request import Request, RequestStatus
from axon.core.scheduler import Scheduler
from axon.engine.arg_utils import create_engine_config
from axon.sample.grammar import GrammarBitmask, apply_grammar_bitmask, unpack_bitmask
from axon.sampling_params import SamplingParams, StructuredOutputsParams
from axon.scheduler_output import GrammarOutput, ModelRunnerOutput
from axon.structured_output.backend_xgrammar import validate_structured_outputs
from axon.structured_output.manager import StructuredOutputManager, Verdict
from axon.structured_output.options import (
    DEFAULT_MAX_WHITESPACE_CNT,
    StructuredOutputsOptions,
    parse_structured_outputs_config,
)

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}


def _load(path: str):
    from axon.engine.tokenizer import get_tokenizer

    return get_tokenizer(path)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str):
    return _load(smollm2_path)


def make_manager(smollm2_path: str, **kwargs) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputsOptions(), lambda: _load(smollm2_path), VOCAB, **kwargs)


def make_request(req_id: str, tokenizer, prompt: str = "JSON:", **so) -> Request:
    structured_outputs = StructuredOutputsParams(**so) if so else None
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=structured_outputs).for_engine(
        tokenizer.eos_token_id, VOCAB, default_max_tokens=64
    )
    return Request(req_id, tokenizer.encode(prompt), params, eos_token_id=tokenizer.eos_token_id)


def feed(manager: StructuredOutputManager, request: Request, text: str, tokenizer) -> list[Verdict]:
    verdicts = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        request.append_output_token_ids(token)
        verdicts.append(manager.accept(request, token))
    return verdicts


def allowed_tokens(manager: StructuredOutputManager, request: Request) -> torch.Tensor:
    out = manager.grammar_output([request])
    assert out is not None
    return unpack_bitmask(torch.from_numpy(out[1]), VOCAB)[0]


# ---- params and options --------------------------------------------------------------------------
def test_params_need_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="unknown keys"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice=[])
    a = StructuredOutputsParams(json={"type": "object", "b": 1})
    assert a.kind_and_spec() == StructuredOutputsParams(json='{"type": "object", "b": 1}').kind_and_spec()


def test_options_and_config_checks() -> None:
    assert parse_structured_outputs_config({"disable_any_whitespace": True}).disable_any_whitespace
    with pytest.raises(ValueError, match="backend 'outlines' is not supported"):
        parse_structured_outputs_config({"backend": "outlines"})
    # Checked when the config is resolved, before any model work (config.py imports no feature).
    with pytest.raises(ValueError, match=r"unknown keys \['whitespace'\]"):
        create_engine_config(structured_outputs_config='{"whitespace": false}')
    with pytest.raises(ValueError, match="reasoning_parser 'o1' is not supported"):
        create_engine_config(reasoning_parser="o1")
    assert parse_structured_outputs_config({"max_whitespace_cnt": None}).max_whitespace_cnt is None
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(ValueError, match="max_whitespace_cnt must be a positive integer"):
            parse_structured_outputs_config({"max_whitespace_cnt": bad})
        with pytest.raises(ValueError, match="structured_outputs.max_whitespace_cnt must be a positive"):
            StructuredOutputsParams(json={}, max_whitespace_cnt=bad)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            {"json": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            "not a valid JSON schema at properties/a/type",
        ),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "(a"}, "regex cannot be compiled"),
        ({"grammar": "root ::= foo"}, "grammar cannot be compiled"),
        (
            {"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<a>"]}'},
            "structural_tag needs",
        ),
    ],
)
def test_front_end_validation_names_the_problem(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_structured_outputs(StructuredOutputsParams(**params))


# ---- the manager ------------------------------------------------------------------------------
def test_grammar_advances_terminates_and_rolls_back(smollm2_path: str, tokenizer) -> None:
    manager = make_manager(smollm2_path)
    request = make_request("a", tokenizer, json=SCHEMA, disable_any_whitespace=True)
    assert manager.init_request(request)  # the first compile goes to the pool
    manager.wait_any([request], None)
    assert manager.is_ready(request)
    allowed = allowed_tokens(manager, request)
    assert allowed[tokenizer.encode("{", add_special_tokens=False)[0]]
    assert not allowed[tokenizer.encode("hello", add_special_tokens=False)[0]]
    assert int(allowed.sum()) < 50  # the start of an object, nothing else

    grammar = request.structured_output_request.grammar
    body = tokenizer.encode('{"n": 7}', add_special_tokens=False)  # xgrammar's compact form keeps ": "
    assert grammar.validate_tokens(body + [5]) == body  # a probe: the state does not move
    assert feed(manager, request, '{"n": 7', tokenizer) == [Verdict.CONTINUE] * len(body[:-1])
    grammar.rollback(1)  # undo "7": a digit is allowed again, the closing brace not yet
    allowed = allowed_tokens(manager, request)
    assert allowed[tokenizer.encode("3", add_special_tokens=False)[0]]
    assert not allowed[tokenizer.encode("}", add_special_tokens=False)[0]]
    assert grammar.accept_tokens("a", tokenizer.encode("7}", add_special_tokens=False))
    allowed = allowed_tokens(manager, request)
    assert allowed.nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # only the end is left
    request.append_output_token_ids(tokenizer.eos_token_id)
    assert manager.accept(request, tokenizer.eos_token_id) is Verdict.TERMINATED

    rejected = make_request("b", tokenizer, json=SCHEMA)
    manager.init_request(rejected)
    manager.wait_any([rejected], None)
    assert manager.is_ready(rejected)
    assert feed(manager, rejected, "x", tokenizer) == [Verdict.REJECTED]


def test_compiled_grammars_are_cached_by_spec(smollm2_path: str, tokenizer) -> None:
    manager = make_manager(smollm2_path)
    first = make_request("a", tokenizer, regex="[0-9]+")
    second = make_request("b", tokenizer, regex="[0-9]+")
    assert manager.init_request(first) and manager.init_request(second)  # one compile, shared
    assert manager.num_compiles == 1
    manager.wait_any([first], None)
    assert manager.is_ready(first) and manager.is_ready(second)
    third = make_request("c", tokenizer, regex="[0-9]+")
    assert not manager.init_request(third)  # a cache hit: ready at once
    assert manager.num_cache_hits == 1 and manager.num_compiles == 1
    # Separate matchers over one compiled grammar.
    feed(manager, first, "12", tokenizer)
    assert third.structured_output_request.grammar.validate_tokens(
        tokenizer.encode("3", add_special_tokens=False)
    )


def test_grammar_waits_for_reasoning_to_end(smollm2_path: str, tokenizer) -> None:
    manager = make_manager(smollm2_path, reasoning_markers=("<think>", "</think>"))
    request = make_request("a", tokenizer, prompt="Question?<think>", choice=["yes", "no"])
    manager.init_request(request)
    manager.wait_any([request], None)
    assert manager.is_ready(request)
    assert manager.grammar_output([request]) is None  # thinking: unconstrained
    assert set(feed(manager, request, "hmm, free text</think>", tokenizer)) == {Verdict.CONTINUE}
    assert request.structured_output_request.is_constraining
    allowed = allowed_tokens(manager, request)
    assert allowed[tokenizer.encode("yes", add_special_tokens=False)[0]]
    assert not allowed[tokenizer.encode("hmm", add_special_tokens=False)[0]]
    ended = make_request("b", tokenizer, prompt="<think>done</think>", choice=["yes", "no"])
    manager.init_request(ended)
    assert ended.structured_output_request.is_constraining  # ended in the prompt already


# ---- the scheduler -----------------------------------------------------------------------------
def make_scheduler(smollm2_path: str) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(block_size=16, enable_prefix_caching=False),
        max_model_len=256,
        num_blocks=64,
        structured_output_manager=make_manager(smollm2_path),
    )


def test_scheduler_holds_requests_until_their_grammar_is_ready(smollm2_path: str, tokenizer) -> None:
    scheduler = make_scheduler(smollm2_path)
    plain = make_request("plain", tokenizer, prompt="Hello")
    constrained = make_request(
        "json", tokenizer, json={"type": "object", "properties": {"k": {"enum": ["v"]}}}
    )
    scheduler.add_request(plain)
    scheduler.add_request(constrained)
    assert constrained.status == RequestStatus.WAITING_FOR_FSM
    assert scheduler.get_num_unfinished_requests() == 2
    out = scheduler.schedule()  # the plain request runs while the grammar compiles (or is done)
    assert "plain" in out.num_scheduled_tokens
    while "json" not in out.num_scheduled_tokens:
        scheduler.update_from_output(
            out, ModelRunnerOutput(list(out.num_scheduled_tokens), [[0]] * len(out.num_scheduled_tokens))
        )
        out = scheduler.schedule()
    assert out.grammar_output is not None and out.grammar_output.req_ids == ["json"]  # only it is masked
    assert out.grammar_output.bitmask.shape == (1, VOCAB // 32)
    # Its grammar-complete output finishes it with reason "stop".
    for text in ['{"k": "v"}']:
        for token in tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]:
            result = scheduler.update_from_output(out, ModelRunnerOutput(["json"], [[token]]))
            if constrained.is_finished():
                break
            out = scheduler.schedule()
    assert result[-1].finish_reason == "stop" and constrained.status == RequestStatus.FINISHED_STOPPED


def test_abort_while_waiting_for_grammar(smollm2_path: str, tokenizer) -> None:
    scheduler = make_scheduler(smollm2_path)
    request = make_request("r", tokenizer, grammar='root ::= "a" | "b"')
    scheduler.add_request(request)
    scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    assert not scheduler.has_unfinished_requests() and request.status == RequestStatus.FINISHED_ABORTED


# ---- the sampler ---------------------------------------------------------------------------------
def test_bitmask_masks_only_its_rows() -> None:
    vocab = 70
    logits = torch.randn(4, vocab)
    original = logits.clone()
    packed = torch.zeros(2, 3, dtype=torch.int32)  # rows for "b" and "d"; "a", "c" unconstrained
    packed[0, 0] = 1 << 5  # b: token 5 only
    packed[1, 2] = 1 << 1  # d: token 65 only
    grammar = GrammarBitmask.from_output(
        GrammarOutput(req_ids=["b", "d"], bitmask=packed.numpy()), ["a", "b", "c", "d"], torch.device("cpu")
    )
    assert grammar is not None
    out = apply_grammar_bitmask(logits, grammar)
    assert torch.equal(out[0], original[0]) and torch.equal(out[2], original[2])
    assert out[1].argmax() == 5 and torch.isinf(out[1]).sum() == vocab - 1
    assert out[3].argmax() == 65 and torch.isinf(out[3]).sum() == vocab - 1
    negative = torch.tensor([[-1]], dtype=torch.int32)  # all 32 bits: bit 31 is the sign bit
    assert unpack_bitmask(negative, 32).all()


NEWLINE_RUN = 40  # far past any bound under test


@pytest.mark.parametrize(
    ("config", "request_whitespace", "longest_run"),
    [
        ({}, {}, DEFAULT_MAX_WHITESPACE_CNT),  # bounded by default
        ({"max_whitespace_cnt": 5}, {}, 5),
        ({}, {"max_whitespace_cnt": 1}, 1),  # a request's bound wins over the server's
        ({"max_whitespace_cnt": None}, {}, NEWLINE_RUN),  # free whitespace, when asked for
        ({"max_whitespace_cnt": None}, {"max_whitespace_cnt": 3}, 3),
        ({}, {"disable_any_whitespace": True}, 0),  # only the single spaces of ", " and ": "
        ({"disable_any_whitespace": True}, {"max_whitespace_cnt": 3}, 0),
    ],
)
@pytest.mark.parametrize("kind", ["json", "json_object"])
def test_whitespace_between_json_tokens_is_bounded(
    smollm2_path: str, tokenizer, config: dict, request_whitespace: dict, longest_run: int, kind: str
) -> None:
    manager = StructuredOutputManager(parse_structured_outputs_config(config), lambda: tokenizer, VOCAB)
    constraint = {"json": SCHEMA} if kind == "json" else {"json_object": True}
    request = make_request("ws", tokenizer, **constraint, **request_whitespace)
    manager.init_request(request)
    manager.wait_any([request], None)
    assert manager.is_ready(request)
    grammar = request.structured_output_request.grammar
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)
    assert grammar.accept_tokens("ws", tokenizer.encode("{", add_special_tokens=False))
    # The matcher takes exactly the bound's worth of newlines after "{", then refuses the next.
    assert len(grammar.validate_tokens([newline] * NEWLINE_RUN)) == longest_run
    run_of_spaces = tokenizer.encode(" " * (longest_run + 1), add_special_tokens=False)
    if longest_run < NEWLINE_RUN:  # one character past the bound is refused, as one token too
        assert len(run_of_spaces) == 1 and grammar.validate_tokens(run_of_spaces) == []


def test_bitmask_rows_follow_the_sampler_rows() -> None:
    packed = torch.zeros(1, 2, dtype=torch.int32)
    output = GrammarOutput(req_ids=["x"], bitmask=packed.numpy())
    grammar = GrammarBitmask.from_output(output, ["w", "x"], torch.device("cpu"))
    assert grammar is not None and grammar.rows.tolist() == [1]
    with pytest.raises(AssertionError, match="do not sample"):
        GrammarBitmask.from_output(output, ["w"], torch.device("cpu"))


def test_offline_llm_structured_outputs(smollm2_path: str) -> None:
    from axon import LLM

    llm = LLM(
        smollm2_path,
        max_model_len=256,
        dtype="float32",
        max_num_seqs=4,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    so = StructuredOutputsParams(json=SCHEMA)
    outs = llm.generate(
        ["A digit as JSON:", "Hello"],
        [
            SamplingParams(temperature=0, max_tokens=20, structured_outputs=so),
            SamplingParams(temperature=0, max_tokens=5),
        ],
        use_tqdm=False,
    )
    value = json.loads(outs[0].outputs[0].text)
    assert outs[0].outputs[0].text == json.dumps(value)  # one space after ":" and ",", no other
    assert 0 <= value["n"] <= 9 and outs[0].outputs[0].finish_reason == "stop"
    assert len(outs[1].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="regex cannot be compiled"):
        llm.generate(
            "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[")), use_tqdm=False
        )
