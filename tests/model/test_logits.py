"""Logit validation against the oracle: transformers' own implementation, float32, teacher-forced."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

from axon import LLM
from axon.worker.logit_validation import teacher_forced_logits

FAMILIES = [
    "llama",
    "llama3",
    "llama_tied",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_moe_step2",
    "gpt_oss",
    "mistral",
]


def _axon_model(folder: str, block_size: int = 4, linear_backend: str = "auto"):
    llm = LLM(
        model=folder,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=4,
        block_size=block_size,
        linear_backend=linear_backend,
    )
    return llm.llm_engine.engine_core.executor.worker.model


def _oracle_logits(folder: str, token_ids: list[int]) -> torch.Tensor:
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("linear_backend", ["onednn", "torch"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_logits_match_transformers(family: str, linear_backend: str, tiny_model_dir) -> None:
    folder = tiny_model_dir(family)
    token_ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = _oracle_logits(folder, token_ids)
    model = _axon_model(folder, linear_backend=linear_backend)
    whole = teacher_forced_logits(model, token_ids, block_size=4)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    # Segmented prefill reads the earlier segments back from the paged cache.
    segmented = teacher_forced_logits(model, token_ids, block_size=4, segment=5)
    torch.testing.assert_close(segmented, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_pointwise_layers_match_transformers(family: str, tiny_model_dir, monkeypatch) -> None:
    # Where axon's C++ kernels are not loaded (no compiler; CUDA), norms, rotary and the
    # activation run in torch: that path against the oracle too.
    import axon.model.layers.norm
    import axon.model.layers.rotary
    import axon.model.models.llama

    for module in (axon.model.layers.norm, axon.model.layers.rotary, axon.model.models.llama):
        monkeypatch.setattr(module, "use_cpu_kernels", lambda x: False)
    folder = tiny_model_dir(family)
    token_ids = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    model = _axon_model(folder, linear_backend="onednn")
    got = teacher_forced_logits(model, token_ids, block_size=4, segment=6)
    torch.testing.assert_close(got, _oracle_logits(folder, token_ids), atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_applied(tiny_model_dir) -> None:
    """Past the original context the scaled and unscaled models must differ (the test above
    would pass vacuously if scaling were ignored by both)."""
    token_ids = list(range(1, 200))
    scaled = _oracle_logits(tiny_model_dir("llama3"), token_ids)
    model = _axon_model(tiny_model_dir("llama3"))
    assert model.arch.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(
        teacher_forced_logits(model, token_ids, block_size=4), scaled, atol=1e-4, rtol=1e-4
    )


def test_smollm2_logits_match_transformers(smollm2_path: str) -> None:
    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_path)
    token_ids = tokenizer.encode(
        "The quick brown fox jumps over the lazy dog. Paged attention stores keys in blocks."
    )
    expected = _oracle_logits(smollm2_path, token_ids)
    model = _axon_model(smollm2_path, block_size=16)
    got = teacher_forced_logits(model, token_ids, block_size=16, segment=7)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
