"""Every record that crosses into or out of the engine-core process decodes to an equal value.

The server never stopped at EOS because decoding re-ran SamplingParams.__post_init__ and dropped
the EOS id resolved before encoding; offline runs, which never encode, could not see it. These
tests encode with the codec the processes use (``axon.engine.core_proc``).
"""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from axon.engine.core_proc import ADD, OUTPUTS, decode_outputs, decode_request, encode
from axon.engine.messages import EngineCoreOutputs, EngineCoreRequest
from axon.pooling_params import PoolingParams
from axon.sampling_params import INT64_MAX, INT64_MIN, UINT64_MAX, SamplingParams, StructuredOutputsParams
from axon.scheduler_output import BucketStep, CompileEvent, LogprobsLists
from axon.step_outputs import EngineCoreOutput, SchedulerStats, SpecDecodingStats

VOCAB, EOS = 49152, 2

token_ids = st.integers(0, VOCAB - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
text = st.text(min_size=1, max_size=12).filter(str.strip)
schemas = st.recursive(
    st.none() | st.booleans() | st.integers(INT64_MIN, INT64_MAX) | finite | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
structured_outputs = st.one_of(
    st.builds(StructuredOutputsParams, json=st.dictionaries(st.text(max_size=8), schemas, max_size=3)),
    st.builds(StructuredOutputsParams, json=text),
    st.builds(StructuredOutputsParams, regex=text),
    st.builds(StructuredOutputsParams, choice=st.lists(st.text(max_size=8), min_size=1, max_size=4)),
    st.builds(StructuredOutputsParams, grammar=text),
    st.builds(StructuredOutputsParams, json_object=st.just(True)),
    st.builds(
        StructuredOutputsParams,
        structural_tag=st.dictionaries(st.text(max_size=8), schemas, max_size=2),
        disable_any_whitespace=st.booleans(),
    ),
)
sampling_params = st.builds(
    SamplingParams,
    n=st.integers(1, 8),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.01, 10),
    temperature=st.sampled_from([0.0, 1e-6]) | st.floats(0, 5),
    top_p=st.floats(0.01, 1),
    top_k=st.sampled_from([-1, 0]) | st.integers(1, INT64_MAX),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(INT64_MIN, UINT64_MAX),
    stop=st.none() | text | st.lists(text, max_size=3),
    stop_token_ids=st.none() | st.lists(token_ids, max_size=4),
    ignore_eos=st.booleans(),
    max_tokens=st.none() | st.integers(64, 10_000),
    min_tokens=st.integers(0, 64),
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    logit_bias=st.none() | st.dictionaries(token_ids, st.floats(-100, 100), max_size=4),
    structured_outputs=st.none() | structured_outputs,
)


def round_trip_request(request: EngineCoreRequest) -> EngineCoreRequest:
    kind, payload = encode(ADD, request)
    assert kind == ADD
    return decode_request(payload)


@settings(max_examples=300, deadline=None)
@given(params=sampling_params, room=st.integers(1, 8192), prompt=st.lists(token_ids, min_size=1, max_size=8))
def test_engine_core_request_round_trips(params: SamplingParams, room: int, prompt: list[int]) -> None:
    engine_params = params.for_engine(EOS, VOCAB, default_max_tokens=room)
    request = EngineCoreRequest("0_chatcmpl-x-1", prompt, engine_params, EOS, 1.5e9, cache_salt=None)
    decoded = round_trip_request(request)
    assert decoded == request
    # The resolved state survives: EOS stops the request unless ignore_eos, max_tokens is filled.
    stop_ids = decoded.sampling_params.all_stop_token_ids
    assert (EOS in stop_ids) == (not params.ignore_eos or EOS in (params.stop_token_ids or []))
    assert set(params.stop_token_ids or []) <= stop_ids
    assert decoded.sampling_params.max_tokens == (
        params.max_tokens if params.max_tokens is not None else room
    )
    assert decoded.sampling_params.sampling_type == params.sampling_type


def test_eos_survives_the_round_trip() -> None:
    """The issue's reproduction: {2} before the round trip, set() after."""
    engine_params = SamplingParams(max_tokens=None).for_engine(EOS, VOCAB, default_max_tokens=500)
    decoded = round_trip_request(EngineCoreRequest("r", [1, 2, 3], engine_params, EOS, 0.0))
    assert decoded.sampling_params.all_stop_token_ids == {EOS}
    assert decoded.sampling_params.max_tokens == 500


@settings(max_examples=200, deadline=None)
@given(so=structured_outputs)
def test_structured_outputs_params_round_trip(so: StructuredOutputsParams) -> None:
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(so), type=StructuredOutputsParams)
    assert decoded == so
    assert decoded.kind_and_spec() == so.kind_and_spec()


@settings(max_examples=100, deadline=None)
@given(
    params=st.builds(
        PoolingParams,
        dimensions=st.none() | st.integers(1, INT64_MAX),
        normalize=st.none() | st.booleans(),
        truncate_prompt_tokens=st.none() | st.just(-1) | st.integers(1, INT64_MAX),
    )
)
def test_pooling_params_round_trip(params: PoolingParams) -> None:
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=PoolingParams) == params
    # The engine's record crosses inside EngineCoreRequest, normalize resolved before encoding.
    for default in (True, False):
        engine_params = params.for_engine(default)
        request = EngineCoreRequest("embd-1", [5, 6], None, None, 1.5e9, pooling_params=engine_params)
        decoded = round_trip_request(request)
        assert decoded == request and decoded.sampling_params is None
        assert decoded.pooling_params.normalize == (default if params.normalize is None else params.normalize)


logprobs_lists = st.integers(1, 3).flatmap(
    lambda k: st.builds(
        LogprobsLists,
        token_ids=st.lists(st.lists(token_ids, min_size=k, max_size=k), max_size=3),
        logprobs=st.lists(
            st.lists(st.floats(max_value=0.0) | st.just(float("-inf")), min_size=k, max_size=k), max_size=3
        ),
        ranks=st.lists(st.integers(1, VOCAB), max_size=3),
    )
)
core_outputs = st.builds(
    EngineCoreOutputs,
    outputs=st.lists(
        st.builds(
            EngineCoreOutput,
            req_id=st.text(max_size=20),
            new_token_ids=st.lists(token_ids, max_size=4),
            new_logprobs=st.none() | logprobs_lists,
            new_prompt_logprobs=st.none() | logprobs_lists,
            finish_reason=st.sampled_from([None, "stop", "length", "abort"]),
            stop_reason=st.none() | token_ids | text,
            num_cached_tokens=st.integers(0, 10_000),
            first_scheduled_time=st.floats(0, 2e9),
            pooled=st.none() | st.lists(finite, max_size=4),
        ),
        max_size=4,
    ),
    scheduler_stats=st.none()
    | st.builds(
        SchedulerStats,
        num_running_reqs=st.integers(0, 256),
        num_waiting_reqs=st.integers(0, 256),
        kv_cache_usage=st.floats(0, 1),
        spec_decoding=st.none()
        | st.builds(
            SpecDecodingStats,
            st.integers(0, 999),
            st.integers(0, 9999),
            st.integers(0, 9999),
            st.lists(st.integers(0, 999), max_size=5),
        ),
        bucket=st.none()
        | st.builds(BucketStep, st.text(max_size=12), st.integers(0, 9999), st.integers(0, 9999)),
        compiles=st.lists(
            st.builds(CompileEvent, st.text(max_size=12), st.floats(0, 1e4), st.booleans()), max_size=2
        ),
        model_load_time_s=st.none() | st.floats(0, 1e4),
        startup_time_s=st.none() | st.floats(0, 1e4),
    ),
)


@settings(max_examples=200, deadline=None)
@given(outputs=core_outputs)
def test_engine_core_outputs_round_trip(outputs: EngineCoreOutputs) -> None:
    _, payload = encode(OUTPUTS, outputs)
    assert decode_outputs(payload) == outputs


def test_numpy_floats_become_floats_before_the_wire() -> None:
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9), max_tokens=4)
    engine_params = params.for_engine(EOS, VOCAB, default_max_tokens=8)
    decoded = round_trip_request(EngineCoreRequest("r", [1], engine_params, EOS, 0.0))
    assert decoded.sampling_params.temperature == 0.5 and type(decoded.sampling_params.temperature) is float
