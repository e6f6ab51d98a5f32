"""``axon train-eagle3``: self-distillation of an EAGLE3 head on a tiny random target, end to end
(the engine generates, the target labels, the head trains and is saved in the public format)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from axon import LLM, SamplingParams
from axon.entrypoints.cli import engine_chat_generator, main
from axon.model.layers.attention import get_attention_backend
from axon.model.loader import load_hf_config
from axon.spec_decode.eagle3 import load_eagle3
from axon.spec_decode.prompts import FOLLOW_UPS, STANDALONE, SUBJECTS, TEMPLATES, chat_dialogues, chat_prompts
from axon.spec_decode.train_eagle3 import (
    Batch,
    TrainOptions,
    chain_mask,
    choose_draft_vocab,
    train_eagle3,
)


@pytest.fixture(scope="module")
def tiny_target(tiny_model_dir) -> str:
    """A 4-layer random Llama with SmolLM2's tokenizer (and so its whole vocabulary: chat
    prompts use every id)."""
    return tiny_model_dir("llama_full_vocab")


def _options(target: str, output: Path, **changes) -> TrainOptions:
    values = {
        "output": str(output),
        "target": target,
        "num_prompts": 24,
        "num_eval_prompts": 6,
        "max_tokens": 48,
        "epochs": 2,
        "draft_vocab_size": 512,
        "dtype": "float32",
        "show_progress": False,
        **changes,
    }
    return TrainOptions(**values)


def test_trained_head_beats_a_random_one_and_loads(tiny_target: str, tmp_path: Path) -> None:
    options = _options(tiny_target, tmp_path / "head")
    report = train_eagle3(options, engine_chat_generator(tiny_target, "float32", 0))
    assert report.after.num_chains > 50
    assert report.after.mean_acceptance_length > report.before.mean_acceptance_length + 0.3
    assert 0 < report.draft_vocab_coverage <= 1 and 0 < report.held_out_vocab_coverage <= 1
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 1]  # vLLM's default
    assert config["draft_vocab_size"] == 512 and config["target_hidden_size"] == 64
    head = load_eagle3(
        str(tmp_path / "head"),
        load_hf_config(tiny_target),
        torch.float32,
        "cpu",
        get_attention_backend("reference"),
    )
    assert int(head.t2d.sum()) == 512
    # The estimate is what serving the head measures on the same held-out prompts.
    llm = LLM(
        model=tiny_target,
        dtype="float32",
        enable_prefix_caching=False,
        speculative_config={"model": str(tmp_path / "head"), "num_speculative_tokens": 3, "adaptive": False},
    )
    params = SamplingParams(temperature=0.0, max_tokens=options.max_tokens)
    for prompt in chat_prompts(options.num_eval_prompts, options.seed, held_out=True):
        llm.chat([[{"role": "user", "content": prompt}]], params, use_tqdm=False)
    totals = llm.llm_engine.engine_core.scheduler.spec_totals
    served = 1 + totals.num_accepted_tokens / totals.num_drafts
    print(f"estimate {report.after.mean_acceptance_length:.3f}, served {served:.3f}")
    assert abs(served - report.after.mean_acceptance_length) < 0.1


def test_cli_trains_and_prints_the_estimate(tiny_target: str, tmp_path: Path, capsys) -> None:
    argv = ["train-eagle3", "--target", tiny_target, "--output", str(tmp_path / "head")]
    argv += ["--num-prompts", "8", "--num-eval-prompts", "4", "--max-tokens", "24", "--epochs", "1"]
    assert main([*argv, "--draft-vocab-size", "256", "--dtype", "float32", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "EAGLE3 head written to" in out and "mean acceptance length" in out
    assert (tmp_path / "head" / "model.safetensors").is_file()


def test_cli_names_a_bad_option(tmp_path: Path, capsys) -> None:
    assert main(["train-eagle3", "--output", str(tmp_path), "--epochs", "0"]) == 2
    assert "epochs must be an integer of at least 1, got 0" in capsys.readouterr().err
    assert main(["train-eagle3", "--output", str(tmp_path), "--follow-ups", "99"]) == 2
    assert f"follow_ups must be an integer from 0 to {len(FOLLOW_UPS)}, got 99" in capsys.readouterr().err


def test_follow_up_turns_are_answered_in_the_same_conversation(tiny_target: str) -> None:
    dialogues = chat_dialogues(3, 0, 2) + chat_dialogues(1, 0, 0)
    assert [len(d) for d in dialogues] == [3, 3, 3, 1]
    answered = engine_chat_generator(tiny_target, "float32", 0)(dialogues, 8)
    assert [len(turns) for turns in answered] == [3, 3, 3, 1]
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    for dialogue, turns in zip(dialogues, answered, strict=True):
        for message, (prompt, _) in zip(dialogue, turns, strict=True):
            assert message in tokenizer.decode(prompt)
        for (prompt, _), (next_prompt, _) in itertools.pairwise(turns):
            # The next turn's prompt is this one, the answer as the chat template writes it
            # back, then the follow-up message (the prompt's last token, the newline after the
            # assistant's role, may merge with the answer's first characters).
            assert next_prompt[: len(prompt) - 1] == prompt[:-1] and len(next_prompt) > len(prompt) + 4
        assert all(answer for _, answer in turns)


def test_chain_mask_counts_response_chains_inside_the_sequence() -> None:
    # prompt 3 tokens, 8 in all: chains start at i >= 2; step j needs x_{i+2+j}, i + 2 + j <= 7
    batch = Batch(
        tokens=torch.zeros(1, 10, dtype=torch.int64),
        lengths=torch.tensor([8]),
        prompt_lens=torch.tensor([3]),
        aux=torch.zeros(1, 10, 3),
        final=torch.zeros(1, 10, 1),
    )
    assert chain_mask(batch, 0)[0].nonzero().flatten().tolist() == [2, 3, 4, 5]
    assert chain_mask(batch, 2)[0].nonzero().flatten().tolist() == [2, 3]


def test_draft_vocabulary_is_the_most_frequent_response_tokens() -> None:
    conversations = [([1, 2], [7, 7, 7, 5, 5, 9]), ([3], [5, 7])]
    ids, coverage = choose_draft_vocab(conversations, 2, 16)
    assert ids.tolist() == [5, 7] and coverage == pytest.approx(7 / 8)
    ids, coverage = choose_draft_vocab(conversations, 5, 16)
    assert ids.tolist() == [0, 1, 5, 7, 9] and coverage == 1.0  # then the lowest unseen ids


def test_held_out_prompts_have_their_own_subjects() -> None:
    train, held_out = chat_prompts(1500, 0), chat_prompts(200, 0, held_out=True)
    assert len(set(train)) == 1500 and not set(train) & set(held_out)
    held_subjects = {s for i, s in enumerate(SUBJECTS) if i % 8 == 0}
    assert not {t.format(s) for t in TEMPLATES for s in held_subjects} & set(train)
    assert any(p in STANDALONE for p in train)
    with pytest.raises(ValueError, match="num_prompts 5000 exceeds"):
        chat_prompts(5000, 0)
    dialogues = chat_dialogues(1500, 0, 2)
    assert [d[0] for d in dialogues] == train  # the same first turns, each with 2 follow-ups
    assert all(len(set(d[1:])) == 2 and set(d[1:]) <= set(FOLLOW_UPS) for d in dialogues)
    assert chat_dialogues(200, 0, 0, held_out=True) == [[p] for p in held_out]
