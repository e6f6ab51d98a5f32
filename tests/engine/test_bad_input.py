"""Every bad input is a ValueError naming the value, raised before any engine state changes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from axon import LLM, SamplingParams
from axon.config import build_config
from axon.entrypoints.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(model=smollm2_path, dtype="float32", max_model_len=64, max_num_seqs=4)


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        # Integers past msgpack's int64 (uint64 for a seed) and non-finite floats.
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**70}, "top_k"),
        ({"n": 2**63}, "n"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"top_p": float("nan")}, "top_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {5: -1e9}}, "logit_bias"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_name_the_value(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        SamplingParams(**kwargs)


def _engine_is_clean(llm: LLM) -> None:
    core = llm.llm_engine.engine_core
    assert not core.has_unfinished_requests()
    assert not llm.llm_engine.has_unfinished_requests()
    assert core.scheduler.kv_cache_manager.usage == 0.0


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    _engine_is_clean(llm)


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_model_len is 64"):
        llm.generate({"prompt_token_ids": [42] * 64}, use_tqdm=False)
    _engine_is_clean(llm)


def test_lone_surrogate_in_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="lone surrogate"):
        llm.generate("a\ud800b", use_tqdm=False)
    _engine_is_clean(llm)


def test_token_id_outside_vocabulary(llm: LLM) -> None:
    with pytest.raises(ValueError, match="49152"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate("hi", SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)


def test_a_bad_request_among_good_ones_changes_nothing(llm: LLM) -> None:
    good = "The sky is"
    with pytest.raises(ValueError):
        llm.generate(
            [good, {"prompt_token_ids": [7] * 100}, good], SamplingParams(max_tokens=4), use_tqdm=False
        )
    _engine_is_clean(llm)
    out = llm.generate([good, good], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_logprobs_above_the_limit(llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)


def test_mismatched_sampling_params_list(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_unknown_option_is_named() -> None:
    with pytest.raises(ValueError, match="unknown option 'max_num_seq'; did you mean 'max_num_seqs'"):
        build_config(max_num_seq=4)
    with pytest.raises(ValueError, match="block_size"):
        build_config(block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        build_config(dtype="int3")


def test_unknown_architecture(tmp_path: Path, tiny_model_dir) -> None:
    folder = tmp_path / "weird"
    folder.mkdir()
    config = json.loads((Path(tiny_model_dir("llama")) / "config.json").read_text())
    config["architectures"] = ["FancyNetForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNetForCausalLM.*supported: BertModel, GptOssForCausalLM, LlamaForCausalLM"):
        LLM(model=str(folder))


def test_missing_and_corrupt_model_files(tmp_path: Path, tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="neither a local folder nor a .gguf file"):
        LLM(model=str(tmp_path / "nope"))
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(model=str(bad_gguf), cache_root=str(tmp_path / "cache"))
    folder = tmp_path / "corrupt"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((Path(tiny_model_dir("llama")) / name).read_bytes())
    (folder / "model.safetensors").write_bytes(b"\x00" * 32)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(model=str(folder), dtype="float32")


def test_kv_cache_too_small_for_one_sequence(smollm2_path: str) -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        LLM(model=smollm2_path, max_model_len=256, block_size=16, num_gpu_blocks_override=8)


def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "", "--max-model-len", "64"]) == 2
    assert "the prompt is empty" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert cli_main(["generate", "hi", "--model", "/does/not/exist"]) == 2
    assert "/does/not/exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli_main(["generate", "hi", "--no-such-flag"])
    assert exc.value.code == 2


def test_extreme_seeds_run(llm: LLM) -> None:
    """The ends of the seed range are accepted, n > 1 children past uint64 wrap, and nothing fails."""
    for seed in (-(2**63), 2**64 - 1):
        params = SamplingParams(n=2, seed=seed, max_tokens=2, temperature=1.0)
        out = llm.generate("hi", params, use_tqdm=False)
        assert [len(c.token_ids) for c in out[0].outputs] == [2, 2]
    _engine_is_clean(llm)


def test_reused_request_id_is_a_value_error(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("hi", SamplingParams(max_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("hi", SamplingParams(max_tokens=2), request_id="same")
    while engine.has_unfinished_requests():
        engine.step()
    _engine_is_clean(llm)
