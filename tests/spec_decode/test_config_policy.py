"""speculative_config checks (errors name the field), the ngram lookup and the draft policy."""

from __future__ import annotations

import json

import pytest

from axon.spec_decode.config import SpecDecodeConfig, parse_spec_decode_config
from axon.spec_decode.ngram import ngram_propose
from axon.spec_decode.policy import DraftPolicy


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens must be at most 16"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config.lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min",
        ),
        (
            {"method": "eagle3", "num_speculative_tokens": 2, "model": "/nonexistent"},
            "speculative_config.model",
        ),
        # Once a TypeError (unhashable) with a traceback out of `axon serve`.
        ({"method": ["ngram"], "num_speculative_tokens": 2}, "speculative_config.method"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": ""},
            "speculative_config.model does not apply",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "speculative_config.draft_tensor_parallel_size",
        ),
    ],
)
def test_bad_options_name_the_field(options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_spec_decode_config(options)


def test_vllm_defaults() -> None:
    spec = parse_spec_decode_config({"method": "ngram", "num_speculative_tokens": 3})
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = parse_spec_decode_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    assert parse_spec_decode_config(None) is None
    # vLLM's default draft_tensor_parallel_size is None (the target's): accepted as 1.
    assert parse_spec_decode_config(
        {"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": None}
    )


def test_method_is_inferred_from_the_model(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    spec = parse_spec_decode_config({"model": str(tmp_path), "num_speculative_tokens": 2})
    assert spec is not None and spec.method == "eagle3"
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    spec = parse_spec_decode_config({"model": str(tmp_path), "num_speculative_tokens": 2})
    assert spec is not None and spec.method == "draft_model"


def test_ngram_drafts_the_continuation_of_the_latest_match() -> None:
    assert ngram_propose([1, 2, 3, 4, 5, 1, 2, 3], 3, 1, 3) == [4, 5, 1]
    assert ngram_propose([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 2) == [7, 1]  # the latest occurrence
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []  # nothing recurs
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 3, 3) == []  # only a 2-token match, min 3
    assert ngram_propose([5], 3, 1, 3) == []


def _policy(**options) -> DraftPolicy:
    return DraftPolicy(SpecDecodeConfig(method="ngram", num_speculative_tokens=4, **options))


def test_policy_drafts_k_when_not_adaptive_and_none_past_disable_by_batch_size() -> None:
    policy = _policy(adaptive=False, disable_by_batch_size=8)
    assert [policy.num_drafts(b) for b in (1, 8, 9, 0)] == [4, 4, 0, 0]


def test_adaptive_policy_follows_acceptance_and_batch() -> None:
    policy = _policy()
    for _ in range(50):
        policy.record(4, 4)  # every draft accepted
    high = [policy.num_drafts(b) for b in (1, 4, 16, 256)]
    assert high[0] == 4 and high == sorted(high, reverse=True) and high[-1] == 0
    for _ in range(200):
        policy.record(4, 0)  # nothing accepted
    assert policy.num_drafts(1) == 0
    # While off it still probes now and then, so a workload that turns repetitive is noticed.
    assert any(policy.num_drafts(1) for _ in range(policy.probe_every))
