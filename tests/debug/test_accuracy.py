"""Accuracy debugging (axon.debug, ``axon debug accuracy``) on SmolLM2 in float32 against
transformers: captures equal transformers' module outputs and ``compare`` finds no divergence;
a perturbation injected into one layer of one side is named by ``first_divergence``; ``replace``
with the reference's own tensors leaves the logits as they were; logit validation passes, and
fails on a copy whose config has a wrong rope base, where the pipeline's report (HTML, parsed)
names the first layer's attention; the KV read back from the paged cache equals transformers'."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from axon import LLM
from axon.debug import capture, capture_reference, compare, read_kv, reference_kv, replace, validate_logits
from axon.entrypoints.accuracy import reference_model

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]
TOL = {"atol": 2e-3, "rtol": 2e-3}


@pytest.fixture(scope="module")
def llm(smollm2_path: str) -> LLM:
    return LLM(model=smollm2_path, dtype="float32", enforce_eager=True)


@pytest.fixture(scope="module")
def reference(smollm2_path: str):
    return reference_model(smollm2_path)


@pytest.fixture(scope="module")
def captures(llm: LLM, reference, smollm2_path: str):
    ours = capture(llm, PROMPTS, "re:.*")
    theirs = capture_reference(reference, PROMPTS, "re:.*", tokenizer=llm.get_tokenizer())
    return ours, theirs


@pytest.fixture(scope="module")
def wrong_rope(smollm2_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("wrong-rope")
    for name in os.listdir(smollm2_path):
        if name != "config.json":
            os.symlink(os.path.join(smollm2_path, name), folder / name)
    config = json.loads(Path(smollm2_path, "config.json").read_text())
    wrong = float(config.get("rope_theta", 10000.0)) * 20
    config["rope_theta"] = wrong
    if isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"] = dict(config["rope_parameters"], rope_theta=wrong)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_captures_equal_transformers(captures) -> None:
    ours, theirs = captures
    assert list(ours)[:4] == [
        "model.embed_tokens",
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.0",
    ]
    assert list(ours)[-2:] == ["model.norm", "lm_head"] and list(ours) == list(theirs)
    result = compare(ours, theirs, **TOL)
    assert result.first_divergence is None, result.table()
    assert all(r.cosine > 0.9999 for r in result.rows)


def test_a_perturbed_layer_is_the_first_divergence(captures) -> None:
    ours, theirs = captures
    perturbed = type(ours)()
    for name, tensors in ours.items():
        perturbed[name] = [t + 0.5 if name.startswith("model.layers.5") else t for t in tensors]
    assert compare(perturbed, theirs, **TOL).first_divergence == "model.layers.5.self_attn"
    only_layer = type(ours)()
    for name, tensors in ours.items():
        only_layer[name] = [t + 0.5 if name == "model.layers.7" else t for t in tensors]
    assert compare(only_layer, theirs, **TOL).first_divergence == "model.layers.7"


def test_replacing_with_the_references_own_output_changes_nothing(llm: LLM, captures) -> None:
    ours, theirs = captures
    replaced = replace(llm, PROMPTS, "model.layers.3", theirs["model.layers.3"])
    for got, want in zip(replaced, ours["lm_head"], strict=True):
        torch.testing.assert_close(got, want, atol=5e-3, rtol=5e-3)
    # Garbage in the same place changes the answer: the hook really replaces.
    noise = [torch.randn_like(t) * 10 for t in theirs["model.layers.3"]]
    assert (replace(llm, PROMPTS, "model.layers.3", noise)[0] - ours["lm_head"][0]).abs().max() > 1.0


def test_logit_validation_passes_and_fails_on_a_wrong_rope(llm: LLM, reference, wrong_rope: str) -> None:
    assert validate_logits(llm, PROMPTS, reference).passed
    wrong = LLM(model=wrong_rope, dtype="float32", enforce_eager=True)
    result = validate_logits(wrong, PROMPTS, reference)
    assert not result.passed
    assert result.checks[0].passed  # position 0 has no rotation to get wrong


def test_kv_read_back_equals_transformers(llm: LLM, reference) -> None:
    ours = read_kv(llm, PROMPTS[1])
    theirs = reference_kv(reference, PROMPTS[1], tokenizer=llm.get_tokenizer())
    assert len(ours) == len(theirs) == reference.config.num_hidden_layers
    for (k, v), (rk, rv) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(k, rk, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(v, rv, atol=2e-3, rtol=2e-3)


def test_axon_debug_accuracy_report(wrong_rope: str, smollm2_path: str, tmp_path: Path) -> None:
    """axon runs the wrong rope base, transformers the right one: the report says FAIL and names
    the first layer's attention, and the exit code is 1; on the right model it passes."""
    report = tmp_path / "report.html"
    cmd = [sys.executable, "-m", "axon.entrypoints.cli", "debug", "accuracy", "--model", wrong_rope,
           "--reference", smollm2_path, "--output", str(report)]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    html = report.read_text()
    verdict = re.search(r'<h1 id="verdict">(.*?)</h1>', html).group(1)
    assert verdict.startswith("FAIL")
    first = re.search(r'<p id="first-divergence">first divergence: <b>(.*?)</b>', html).group(1)
    assert first == "model.layers.0.self_attn"
    assert "data:image/png;base64," in html and "first divergence: model.layers.0.self_attn" in proc.stdout
    good = tmp_path / "good.html"
    cmd = [sys.executable, "-m", "axon.entrypoints.cli", "debug", "accuracy", "--model", smollm2_path,
           "--output", str(good)]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert re.search(r'<h1 id="verdict">PASS', good.read_text())
