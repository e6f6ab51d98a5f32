"""Mixture of experts: the routing, the fused CPU op against the loop over experts (its oracle),
Qwen3-MoE's weight loading, and the model in bfloat16 on the fused op against transformers.
(Teacher-forced float32 logits of both Qwen3-MoE layouts are in test_logits.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from axon import LLM, SamplingParams
from axon.model.layers.moe import FusedMoE, MoeMath, activate, moe_loop, pack_experts, route
from axon.model.layers.quant import quant_kernel_supported, quantize_experts
from axon.worker.logit_validation import teacher_forced_logits

CASES = [
    # experts, top_k, hidden, intermediate, tokens, renormalize
    (4, 2, 64, 32, 5, False),
    (8, 2, 96, 48, 1, True),  # one token (a decode)
    (16, 4, 128, 80, 33, True),  # intermediate not a multiple of 16; hidden not of 64
    (8, 8, 64, 32, 3, False),  # every expert picked by every token
    (6, 1, 32, 16, 300, False),  # top-1, many tokens
]
# GPT-OSS's block: top-k then softmax, swigluoai (a small limit, so the clamps bite), biases.
GPT_OSS_MATH = {"routing": "topk_softmax", "activation": "swigluoai", "alpha": 1.702, "limit": 0.5}


def _block(
    experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    renormalize: bool,
    seed: int,
    gpt_oss: bool = False,
) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    math = MoeMath(top_k, renormalize, **(GPT_OSS_MATH if gpt_oss else {}))
    block = FusedMoE(experts, hidden, intermediate, math, bias=gpt_oss)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return block


def _inputs(tokens: int, hidden: int, experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    if experts > 2:
        logits[:, 1] = -30.0  # expert 1 is never picked: an expert with no tokens
    return x, logits


def test_gpt_oss_routing_softmaxes_the_top_k_logits() -> None:
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(16))
    weights, ids = route(logits, MoeMath(3, routing="topk_softmax"))
    top = logits.sort(dim=-1, descending=True)
    assert torch.equal(ids, top.indices[:, :3])
    torch.testing.assert_close(weights, torch.softmax(top.values[:, :3], dim=-1))


def test_swigluoai_clamps_then_gates() -> None:
    gate = torch.tensor([-10.0, -1.0, 0.0, 1.0, 10.0])
    up = torch.tensor([-10.0, 0.5, 2.0, 10.0, 0.0])
    got = activate(torch.cat([gate, up]), MoeMath(1, activation="swigluoai", alpha=1.702, limit=7.0))
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(got, g * torch.sigmoid(1.702 * g) * (u + 1))
    assert got[4].item() == pytest.approx(
        7.0 * torch.sigmoid(torch.tensor(1.702 * 7.0)).item()
    )  # gate clamped


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_picks_the_top_k_by_probability(renormalize: bool) -> None:
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    weights, ids = route(logits, MoeMath(3, renormalize))
    probs = torch.softmax(logits, dim=-1)
    for t in range(50):
        assert len(set(ids[t].tolist())) == 3
        # No unpicked expert beats a picked one.
        assert probs[t, ids[t]].min() >= probs[t].sort(descending=True).values[2]
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    else:
        torch.testing.assert_close(weights, probs.gather(1, ids))


def test_the_loop_equals_a_dense_sum_over_every_expert() -> None:
    """The oracle by definition: each token's output is its picked experts' SwiGLU outputs,
    weighted; computed here for every (token, expert) pair and masked."""
    block = _block(6, 2, 32, 24, True, seed=3)
    x, logits = _inputs(20, 32, 6, seed=4)
    weights, ids = route(logits, MoeMath(2, True))
    dense = torch.zeros(20, 32)
    for e in range(6):
        gate, up = (x @ block.w13_weight[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ block.w2_weight[e].T
        dense += y * (weights * (ids == e)).sum(-1, keepdim=True)
    with torch.no_grad():
        torch.testing.assert_close(block(x, logits), dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize(("experts", "top_k", "hidden", "intermediate", "tokens", "renormalize"), CASES)
def test_the_fused_op_equals_the_loop(
    bf16_path: str,
    experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    tokens: int,
    renormalize: bool,
    gpt_oss: bool,
) -> None:
    block = _block(experts, top_k, hidden, intermediate, renormalize, seed=tokens, gpt_oss=gpt_oss).bfloat16()
    x, logits = _inputs(tokens, hidden, experts, seed=tokens + 1)
    x = x.bfloat16()
    expected = _loop_in_float32(block, x, logits)
    assert pack_experts(block) == 1 and block.method == "fused"
    _assert_within_bf16(block, x, logits, expected)


def _loop_in_float32(block: FusedMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The oracle: the loop in float32 on the block's own (bf16, or dequantized) weights."""
    biases = (block.w13_bias.float(), block.w2_bias.float()) if block.w13_bias is not None else (None, None)
    return moe_loop(
        x.float(), logits, block.w13_weight.float(), block.w2_weight.float(), block.math, 0, *biases
    )


def _assert_within_bf16(
    block: FusedMoE, x: torch.Tensor, logits: torch.Tensor, expected: torch.Tensor
) -> None:
    """The fused op accumulates in float32 and rounds to bf16 where the GEMMs take their inputs,
    so it lands within bf16's error of the float32 oracle."""
    with torch.inference_mode():
        got = block(x, logits)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=0.01 * scale, rtol=0.02)


def test_the_fused_op_gives_a_token_the_same_numbers_alone_or_batched(bf16_path: str) -> None:
    block = _block(8, 2, 64, 48, False, seed=5).bfloat16()
    pack_experts(block)
    x, logits = _inputs(24, 64, 8, seed=6)
    x, logits = x.bfloat16(), logits.bfloat16()  # router logits as the gate returns them
    with torch.inference_mode():
        batched = block(x, logits)
        alone = torch.cat([block(x[i : i + 1], logits[i : i + 1]) for i in range(24)])
        empty = block(x[:0], logits[:0])
    assert torch.equal(alone, batched)
    assert empty.shape == (0, 64)


@pytest.mark.parametrize("fused", [False, True])
def test_ranks_holding_half_the_experts_each_sum_to_the_whole(bf16_kernel: None, fused: bool) -> None:
    """Expert parallelism's arithmetic: a block over experts 0-3 plus one over 4-7 (each skipping
    the slots routed to the other's) is the block over all 8."""
    whole = _block(8, 2, 64, 48, True, seed=14).bfloat16()
    halves = []
    for first in (0, 4):
        half = FusedMoE(8, 64, 48, MoeMath(2, True), first_expert=first, num_local_experts=4).bfloat16()
        with torch.no_grad():
            half.w13_weight.copy_(whole.w13_weight[first : first + 4])
            half.w2_weight.copy_(whole.w2_weight[first : first + 4])
        halves.append(half)
    x, logits = _inputs(19, 64, 8, seed=15)
    x = x.bfloat16()
    if fused:
        for block in (whole, *halves):
            pack_experts(block)
    with torch.inference_mode():
        expected = whole(x, logits).float()
        got = halves[0](x, logits).float() + halves[1](x, logits).float()
    torch.testing.assert_close(got, expected, atol=0.02 * expected.abs().max().item(), rtol=0.02)


@pytest.fixture(scope="module")
def quant_kernel(bf16_kernel: None) -> None:
    if not quant_kernel_supported():
        pytest.skip("axon's quantized linear kernel needs a CPU with AVX-512 BF16 and VBMI")


def _quantized_pair(block: FusedMoE, method: str, group: int | None) -> FusedMoE:
    """Quantize ``block``'s experts for the fused op; returns a copy holding the same codes
    dequantized (the loop's weights: the oracle)."""
    oracle = FusedMoE(block.num_experts, block.hidden_size, block.intermediate_size, block.math,
                      bias=block.w13_bias is not None).to(block.w13_weight.dtype)  # fmt: skip
    oracle.load_state_dict(block.state_dict())
    quantize_experts(oracle, method, group, use_kernel=False)
    quantize_experts(block, method, group, use_kernel=True)
    assert block.method == "fused_quant" and oracle.method == "loop"
    assert not hasattr(block, "w13_weight")  # only the codes stay
    return oracle


@pytest.mark.parametrize(("method", "group"), [("int8", None), ("int4", None), ("int4", 16), ("fp8", None)])
@pytest.mark.parametrize("gpt_oss", [False, True])
@pytest.mark.parametrize(("experts", "top_k", "hidden", "intermediate", "tokens", "renormalize"), CASES)
def test_the_quantized_fused_op_equals_the_loop_on_the_same_codes(
    bf16_path: str,
    quant_kernel: None,
    method: str,
    group: int | None,
    gpt_oss: bool,
    experts: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    tokens: int,
    renormalize: bool,
) -> None:
    """Experts kept as int8, int4 (per group of 16 to 128 inputs) or FP8 codes: the quantized
    op against the loop in float32 over the same codes dequantized, within bf16's error."""
    block = _block(experts, top_k, hidden, intermediate, renormalize, seed=tokens, gpt_oss=gpt_oss).bfloat16()
    oracle = _quantized_pair(block, method, group)
    x, logits = _inputs(tokens, hidden, experts, seed=tokens + 1)
    x = x.bfloat16()
    _assert_within_bf16(block, x, logits, _loop_in_float32(oracle, x, logits))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_quantized_fused_op_gives_a_token_the_same_numbers_alone_or_batched(
    quant_kernel: None, method: str
) -> None:
    block = _block(8, 2, 64, 48, False, seed=5).bfloat16()
    quantize_experts(block, method, None, use_kernel=True)
    x, logits = _inputs(24, 64, 8, seed=6)
    x, logits = x.bfloat16(), logits.bfloat16()
    with torch.inference_mode():
        batched = block(x, logits)
        alone = torch.cat([block(x[i : i + 1], logits[i : i + 1]) for i in range(24)])
        compiled = torch.compile(block, dynamic=False, fullgraph=True)(x, logits)
    assert torch.equal(alone, batched)
    assert torch.equal(compiled, batched)


def test_the_quantized_fused_op_rejects_codes_of_another_shape(quant_kernel: None) -> None:
    block = _block(4, 2, 64, 32, False, seed=7).bfloat16()
    quantize_experts(block, "int8", None, use_kernel=True)
    x, logits = _inputs(3, 64, 4, seed=8)

    def call(w13_codes: torch.Tensor, group13: int) -> torch.Tensor:
        return torch.ops.axon_cpu.fused_moe_quant(
            x.bfloat16(), logits, w13_codes, block.w13_scales, None, block.w2_codes, block.w2_scales, None,
            0, 0, group13, 32, None, None, 2, False, 32, 0, 0, 0, 1.0, 1.0,
        )  # fmt: skip

    with pytest.raises(RuntimeError, match="w13 codes must be 4 rows of"):
        call(block.w13_codes[:, :-64].contiguous(), 64)
    with pytest.raises(RuntimeError, match="w13's group 24 must be a multiple of 16"):
        call(block.w13_codes, 24)


def test_the_fused_op_rejects_bad_input(bf16_kernel: None) -> None:
    block = _block(4, 2, 64, 32, False, seed=7).bfloat16()
    pack_experts(block)
    x, logits = _inputs(3, 64, 4, seed=8)
    with pytest.raises(RuntimeError, match="bfloat16"):
        block(x, logits)  # float32 x
    with pytest.raises(RuntimeError, match="router_logits"):
        block(x.bfloat16(), logits[:2])
    x = x.bfloat16()

    def call(top_k: int, first_expert: int) -> torch.Tensor:
        packed = (block.w13_packed, block.w2_packed, None, None)
        return torch.ops.axon_cpu.fused_moe(
            x, logits, *packed, top_k, False, 32, first_expert, 0, 0, 1.0, 1.0
        )

    with pytest.raises(RuntimeError, match="top_k"):
        call(5, 0)
    with pytest.raises(RuntimeError, match="not among the router's 4"):
        call(2, 1)
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        FusedMoE(4, 64, 32, MoeMath(5, False))
    with pytest.raises(ValueError, match="MoE activation 'gelu'"):
        MoeMath(2, activation="gelu")


def test_the_fused_op_runs_in_a_compiled_graph(bf16_kernel: None) -> None:
    block = _block(8, 2, 64, 48, True, seed=9).bfloat16()
    pack_experts(block)
    x, logits = _inputs(7, 64, 8, seed=10)
    x = x.bfloat16()
    with torch.inference_mode():
        eager = block(x, logits)
        compiled = torch.compile(block, dynamic=False, fullgraph=True)(x, logits)
    assert torch.equal(compiled, eager)


def test_the_loop_runs_in_a_compiled_graph() -> None:
    block = _block(8, 2, 64, 48, True, seed=11)
    x, logits = _inputs(7, 64, 8, seed=12)
    with torch.inference_mode():
        eager = block(x, logits)
        compiled = torch.compile(block, dynamic=False, fullgraph=True)(x, logits)
    torch.testing.assert_close(compiled, eager)


# ---- Qwen3-MoE checkpoints ----


def _weights_of(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.llm_engine.engine_core.executor.worker.model
    return {k: v.clone() for k, v in model.state_dict().items()}


def _restack(folder: str, out: Path) -> None:
    """The checkpoint with each layer's experts stacked as Hugging Face's newer layout names them
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])."""
    tensors = load_file(Path(folder) / "model.safetensors")
    config = json.loads((Path(folder) / "config.json").read_text())
    experts = config.get("num_experts", config.get("num_local_experts"))
    layers = {k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k}
    for layer in layers:
        prefix = f"{layer}.mlp.experts"
        gate_up = [
            torch.cat(
                [tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")]
            )
            for e in range(experts)
        ]
        down = [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(experts)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack(down)
    out.mkdir()
    for f in Path(folder).iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})


def test_stacked_and_per_expert_checkpoints_load_the_same(tiny_model_dir, tmp_path: Path) -> None:
    folder = tiny_model_dir("qwen3_moe_step2")
    _restack(folder, tmp_path / "stacked")
    kwargs = {"dtype": "float32", "max_model_len": 64, "linear_backend": "torch"}
    per_expert = _weights_of(LLM(model=folder, **kwargs))
    stacked = _weights_of(LLM(model=str(tmp_path / "stacked"), **kwargs))
    assert per_expert.keys() == stacked.keys()
    assert any(k.endswith("experts.w13_weight") for k in per_expert)
    for name, tensor in per_expert.items():
        assert torch.equal(tensor, stacked[name]), name


def test_a_checkpoint_missing_an_expert_names_it(tiny_model_dir, tmp_path: Path) -> None:
    folder = Path(tiny_model_dir("qwen3_moe"))
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.5.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.5\.up_proj\.weight"):
        LLM(model=str(broken), dtype="float32", max_model_len=64)


@pytest.mark.parametrize(("family", "seed", "num_blocks"), [("qwen3_moe_step2", 13, 2), ("gpt_oss", 17, 4)])
def test_bf16_moe_models_on_the_fused_op_track_transformers(
    bf16_kernel: None, tiny_model_dir, family: str, seed: int, num_blocks: int
) -> None:
    """bfloat16 on axon's kernels (fused experts; GPT-OSS's sinks and windows in cpu_flash)
    against transformers in float32: the same next token nearly everywhere and logits within
    bf16's error."""
    folder = tiny_model_dir(family)
    token_ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([token_ids])).logits[0]
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=128, block_size=4)
    model = llm.llm_engine.engine_core.executor.worker.model
    blocks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert len(blocks) == num_blocks and all(b.method == "fused" for b in blocks)
    got = teacher_forced_logits(model, token_ids, block_size=4).float()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() < 0.05 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9


def test_quantization_keeps_the_router_in_the_model_dtype_and_the_experts_as_codes(
    quant_kernel: None, tiny_model_dir
) -> None:
    """``--quantization int8`` on a MoE model: attention and experts quantized (the experts on
    the quantized fused op), the router not; the model still tracks transformers' float32
    logits (the next token nearly everywhere)."""
    from axon.model.layers.quant import QuantLinear

    folder = tiny_model_dir("qwen3_moe_step2")
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=128, block_size=4, quantization="int8")
    model = llm.llm_engine.engine_core.executor.worker.model
    block = model.model.layers[1].mlp
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, QuantLinear)  # the rest is quantized
    assert not isinstance(block.gate, QuantLinear) and isinstance(block.experts, FusedMoE)
    assert block.experts.method == "fused_quant"
    token_ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(13)).tolist()
    hf = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([token_ids])).logits[0]
    got = teacher_forced_logits(model, token_ids, block_size=4).float()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.85
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_int4_experts_on_the_kernels_track_the_same_codes_in_float32(
    quant_kernel: None, tiny_model_dir, tmp_path: Path
) -> None:
    """int4 (16 levels) moves a random model's logits too far for transformers to be the oracle;
    the oracle is the same codes in float32 (every layer dequantized, the experts on the loop).
    The checkpoint is rounded to bf16 first, so both dtypes quantize the same numbers."""
    folder = Path(tiny_model_dir("qwen3_moe_step2"))
    rounded = tmp_path / "bf16"
    rounded.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (rounded / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.bfloat16().float() for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, rounded / "model.safetensors", metadata={"format": "pt"})
    token_ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(14)).tolist()
    logits = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(model=str(rounded), dtype=dtype, max_model_len=128, block_size=4, quantization="int4")
        model = llm.llm_engine.engine_core.executor.worker.model
        expected_method = "fused_quant" if dtype == "bfloat16" else "loop"
        assert model.model.layers[1].mlp.experts.method == expected_method
        logits[dtype] = teacher_forced_logits(model, token_ids, block_size=4).float()
    expected, got = logits["float32"], logits["bfloat16"]
    assert (got - expected).abs().max().item() < 0.05 * expected.abs().max().item()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean().item() >= 0.9
