"""GPT-OSS beyond the teacher-forced logits of test_logits.py: its MXFP4 experts (OpenAI's layout)
against transformers' dequantizer and against the same weights stored plainly, and prefix-cache
hits across the sliding window."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from axon import LLM, SamplingParams
from axon.model.layers.moe import FusedMoE
from axon.model.loader.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def test_mxfp4_dequantizes_as_transformers_does() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 40, 96, generator=torch.Generator().manual_seed(0)) * 3
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (3, 40, 3, 16) and scales.shape == (3, 40, 3)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(
        1, 2
    )  # they return x @ W
    assert torch.equal(ours, theirs)
    # Within half a code step of the block's scale: the largest error is a quarter of the
    # block's peak (between 4 and 6 at the top of the range).
    peak = weight.reshape(3, 40, 3, 32).abs().amax(-1, keepdim=True)
    assert ((ours - weight).reshape(3, 40, 3, 32).abs() <= peak / 4 + 1e-6).all()
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :2], torch.float32)


def _copy(folder: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> str:
    out.mkdir()
    for f in folder.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    (out / "config.json").write_text(json.dumps(config or json.loads((folder / "config.json").read_text())))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


def test_an_mxfp4_checkpoint_loads_as_its_dequantized_weights(tiny_model_dir, tmp_path: Path, caplog) -> None:
    """OpenAI ships the experts as ``*_blocks`` / ``*_scales`` over [E, out, in]; loading them
    equals loading the very values they stand for, stored as plain tensors."""
    folder = Path(tiny_model_dir("gpt_oss"))
    tensors = load_file(folder / "model.safetensors")
    quantized, plain = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors[name].transpose(1, 2))  # x @ W -> [E, out, in]
        del quantized[name]
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        plain[name] = dequantize_mxfp4(blocks, scales, torch.float32).transpose(1, 2).contiguous()
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["router", "self_attn"],
    }
    mxfp4 = _copy(folder, tmp_path / "mxfp4", quantized, config)
    dequantized = _copy(folder, tmp_path / "plain", plain)

    def experts(path: str) -> list[torch.Tensor]:
        llm = LLM(model=path, dtype="float32", max_model_len=64, linear_backend="torch")
        model = llm.llm_engine.engine_core.executor.worker.model
        return [p for m in model.modules() if isinstance(m, FusedMoE) for p in (m.w13_weight, m.w2_weight)]

    with caplog.at_level(logging.INFO, logger="axon.model.models.gpt_oss"):
        got = experts(mxfp4)
    assert "dequantized 8 MXFP4 expert tensors to torch.float32 at load" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="axon.model.models.gpt_oss"):
        want = experts(dequantized)
    assert "MXFP4" not in caplog.text  # plain experts: nothing to dequantize
    assert len(got) == 8
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_a_checkpoint_with_half_an_mxfp4_tensor_is_refused(tiny_model_dir, tmp_path: Path) -> None:
    folder = Path(tiny_model_dir("gpt_oss"))
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj"
    blocks, _ = quantize_mxfp4(tensors.pop(name).transpose(1, 2))
    tensors[f"{name}_blocks"] = blocks
    broken = _copy(folder, tmp_path / "broken", tensors)
    with pytest.raises(ValueError, match=rf"{name}_blocks but no {name}_scales"):
        LLM(model=broken, dtype="float32", max_model_len=64)


def test_prefix_cache_hits_across_the_sliding_window_change_nothing(tiny_model_dir) -> None:
    """Prompts longer than the window (8) that share 24 tokens: with prefix caching the second
    reuses the first's blocks, including blocks its sliding layers no longer read, and every
    token is what a cold engine computes."""
    folder = tiny_model_dir("gpt_oss")
    shared = [(13 * i + 5) % 500 for i in range(24)]
    prompts = [shared + [7, 8, 9, 10, 11, 12], shared + [300, 301, 302]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(prefix_caching: bool) -> list:
        llm = LLM(
            model=folder,
            dtype="float32",
            max_model_len=128,
            block_size=4,
            enable_prefix_caching=prefix_caching,
        )
        return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]

    cached, cold = run(True), run(False)
    assert cached[1].num_cached_tokens >= 20
    assert [o.outputs[0].token_ids for o in cached] == [o.outputs[0].token_ids for o in cold]


# ---- the KV cache's window group (vLLM's hybrid KV cache manager) ----


def _engine_of(llm: LLM):
    return llm.llm_engine.engine_core


def test_the_sliding_layers_blocks_out_of_the_window_are_freed_and_nothing_changes(tiny_model_dir) -> None:
    """GPT-OSS (window 8, blocks of 4): with the window group a request past the window holds
    about window / block_size blocks for its sliding layers, the same memory holds about twice
    the blocks (a cache tensor per full-and-sliding pair of layers), and every token, batched,
    chunked or after prefix-cache hits across the window, is what one group of blocks gives."""
    folder = tiny_model_dir("gpt_oss")
    prompts = [[(13 * i + 5 * j) % 500 for i in range(18 + 7 * j)] for j in range(4)]
    prompts.append(prompts[3][:22] + [400, 401, 402])  # a prefix-cache hit past the window
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": 4, "max_num_batched_tokens": 16}

    def run(**extra) -> tuple[list, int, LLM]:
        llm = LLM(model=folder, kv_cache_space_gib=0.001, **kwargs, **extra)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)
        return outs, _engine_of(llm).num_blocks, llm

    hybrid, hybrid_blocks, llm = run()
    one_group, one_group_blocks, _ = run(disable_hybrid_kv_cache_manager=True)
    assert [o.outputs[0].token_ids for o in hybrid] == [o.outputs[0].token_ids for o in one_group]
    assert hybrid[4].num_cached_tokens >= 16 and one_group[4].num_cached_tokens >= 16
    assert hybrid_blocks == 2 * one_group_blocks - 1 or hybrid_blocks == 2 * one_group_blocks

    # Mid-generation, a long request's window group holds only the blocks its window reads.
    manager = _engine_of(llm).scheduler.kv_cache_manager
    assert manager.window == 8
    engine = llm.llm_engine
    long_params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompts[3]}, long_params, request_id="long")
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for req_id in manager.req_to_window_blocks:  # the one request
            window_ids = manager.get_window_block_ids(req_id)
            held.append(sum(1 for b in window_ids if b != 0))
            assert len(window_ids) == manager.get_num_blocks(req_id)
        manager.check_integrity()
    assert len(held) >= 40
    assert max(held[-20:]) <= 8 // 4 + 2  # the window's blocks and the step's
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1


def test_the_automatic_kv_cache_fits_max_num_seqs_with_their_windows(tiny_model_dir) -> None:
    """kv_cache_space_gib auto sizes the cache for max_num_seqs full-length sequences, each
    holding its window group's blocks too: admission still lets all of them run at once."""
    llm = LLM(
        model=tiny_model_dir("gpt_oss"), dtype="float32", max_model_len=128, block_size=4, max_num_seqs=5
    )
    scheduler = _engine_of(llm).scheduler
    assert scheduler.kv_cache_manager.window == 8
    # Holdback admission at max_model_len each (window blocks included) admits all 5.
    full_length = scheduler.kv_cache_manager.max_blocks_per_seq(scheduler.max_num_batched_tokens)
    assert 5 * full_length <= scheduler.num_usable_blocks
