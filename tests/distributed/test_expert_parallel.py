"""Qwen3-MoE and GPT-OSS across ranks (the ``mp`` executor, as test_tensor_parallel.py): tensor parallelism
splits every expert's width, expert parallelism (``enable_expert_parallel``) gives each rank
whole experts; either way TP=2 / EP=2 must give what one rank gives (float32: the same greedy
tokens, log-probabilities to rounding), and each rank reads only its share of the experts."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from axon.distributed import parallel_state
from axon.distributed.parallel_state import TensorParallelGroup
from axon.engine.arg_utils import create_engine_config
from axon.model.layers.attention import get_attention_backend
from axon.model.layers.moe import FusedMoE
from axon.model.loader.model_loader import load_model
from tests.distributed.test_tensor_parallel import _assert_same, _run, count_reads


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_step2", "gpt_oss"])
def test_tp2_splitting_each_expert_equals_tp1(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_step2", "gpt_oss"])
def test_ep2_equals_ep1(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    one = _run(folder, enable_expert_parallel=True)  # one rank: every expert, as without the flag
    _assert_same(_run(folder), one)
    _assert_same(one, _run(folder, tensor_parallel_size=2, enable_expert_parallel=True))


def test_ep2_compiled_buckets_equal_eager_ep1(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3_moe_step2")
    compiled = {"enforce_eager": False, "bucket_compile": "warmup", "max_num_batched_tokens": 32}
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2, enable_expert_parallel=True, **compiled))


def _load_rank(folder: str, rank: int, expert_parallel: bool, monkeypatch) -> tuple[torch.nn.Module, int]:
    """Rank ``rank`` of 2's model, and how many bytes it read from the checkpoint."""
    config = create_engine_config(
        model=folder, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=expert_parallel
    ).model_config
    read_bytes = count_reads(monkeypatch)
    monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup(rank=rank, size=2))
    parallel_state.set_expert_parallel(expert_parallel)
    try:
        model = load_model(
            config, torch.float32, torch.device("cpu"), get_attention_backend("reference", None)
        )
    finally:
        parallel_state.set_expert_parallel(False)
    return model, sum(read_bytes)


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_share_of_the_experts(
    tiny_model_dir, monkeypatch, rank: int, expert_parallel: bool
) -> None:
    from safetensors.torch import load_file

    folder = tiny_model_dir("qwen3_moe")
    model, read = _load_rank(folder, rank, expert_parallel, monkeypatch)
    full = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        dims = json.load(f)
    params = dict(model.named_parameters())
    assert read == sum(p.numel() * p.element_size() for p in params.values())
    experts, size = dims["num_local_experts"], dims["moe_intermediate_size"]
    block = model.model.layers[0].mlp.experts
    assert isinstance(block, FusedMoE)
    prefix = "model.layers.0.mlp"
    if expert_parallel:  # whole experts 4r .. 4r + 3
        mine = range(rank * experts // 2, (rank + 1) * experts // 2)
        cols = slice(0, size)
    else:  # every expert, columns of its width
        mine = range(experts)
        cols = slice(rank * size // 2, (rank + 1) * size // 2)
    assert (block.first_expert, block.num_local_experts) == (mine.start, len(mine))
    for local, e in enumerate(mine):
        gate = full[f"{prefix}.experts.{e}.gate_proj.weight"][cols]
        up = full[f"{prefix}.experts.{e}.up_proj.weight"][cols]
        assert torch.equal(block.w13_weight[local], torch.cat([gate, up]))
        assert torch.equal(block.w2_weight[local], full[f"{prefix}.experts.{e}.down_proj.weight"][:, cols])
    assert torch.equal(params[f"{prefix}.gate.weight"], full[f"{prefix}.gate.weight"])  # the router: whole


def _edited(folder: str, tmp_path, **changes) -> str:
    out = tmp_path / "edited"
    out.parent.mkdir(exist_ok=True)
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_experts_that_do_not_split_are_refused_before_loading(tiny_model_dir, tmp_path) -> None:
    folder = tiny_model_dir("qwen3_moe")
    six = _edited(folder, tmp_path, num_local_experts=6)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 4 does not divide the model's number of experts"
    ):
        create_engine_config(model=six, tensor_parallel_size=4, enable_expert_parallel=True)
    create_engine_config(model=six, tensor_parallel_size=4)  # splitting each expert's 48 columns is fine
    narrow = _edited(folder, tmp_path / "b", moe_intermediate_size=50)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size 4 does not divide the model's moe_intermediate_size \(50\)"
    ):
        create_engine_config(model=narrow, tensor_parallel_size=4)
