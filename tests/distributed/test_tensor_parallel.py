"""Tensor parallelism on the CPU, through the offline ``LLM`` with the ``mp`` executor: each rank a
process, its threads on its own CPU, the collectives through shared memory.

TP=2 must give what TP=1 gives: the same greedy tokens and the same log-probabilities (float32,
to rounding: the ranks sum their partial products in another order). Each rank loads only its
slice of each checkpoint tensor; a rank that dies ends the engine with an error naming it.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import time

import psutil
import pytest
import torch

from axon import LLM, SamplingParams
from axon.distributed import parallel_state
from axon.distributed.parallel_state import TensorParallelGroup
from axon.engine.arg_utils import create_engine_config
from axon.executor.abstract import WorkerError
from axon.model.layers.attention import get_attention_backend
from axon.model.loader import model_loader
from axon.model.loader.model_loader import load_model
from axon.model.loader.safetensors_loader import LazyTensor

PROMPTS = [[5, 17, 42, 9, 300, 12], [7, 7, 8, 120, 33, 2, 61, 90, 14, 250, 3, 44, 18, 19, 21, 99, 5, 6]]
OPTIONS = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 4, "block_size": 16}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=3)


def _run(folder: str, **options) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens, and the top log-probabilities of every prompt and output position."""
    llm = LLM(model=folder, **{**OPTIONS, **options})
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    result = []
    for out in outputs:
        positions = [*out.prompt_logprobs[1:], *out.outputs[0].logprobs]
        result.append((out.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in positions]))
    return result


def _assert_same(want, got) -> None:
    for (want_tokens, want_lps), (got_tokens, got_lps) in zip(want, got, strict=True):
        assert got_tokens == want_tokens
        for w, g in zip(want_lps, got_lps, strict=True):
            assert w.keys() == g.keys()
            for token, logprob in w.items():
                assert g[token] == pytest.approx(logprob, abs=2e-5)


@pytest.mark.parametrize("family", ["llama", "llama_tied", "qwen2", "qwen3", "mistral"])
def test_tp2_equals_tp1(tiny_model_dir, family: str) -> None:
    folder = tiny_model_dir(family)
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2))


def test_tp2_with_one_kv_head_and_an_odd_vocabulary(tiny_model_dir) -> None:
    """One KV head is replicated on both ranks; 509 rows split as 255 + 254 (the second padded)."""
    folder = tiny_model_dir("llama_one_kv_head_odd_vocab")
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2))


def test_tp2_random_sampling_equals_tp1(tiny_model_dir) -> None:
    """Every rank samples for itself and feeds its own token to the next step: the ranks must
    draw alike (same logits, same generators), seeded per request or from the engine's seed."""
    folder = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, ignore_eos=True, seed=7),
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),  # the engine's generator
    ]
    texts = {}
    for tp in (1, 2):
        llm = LLM(model=folder, tensor_parallel_size=tp, seed=3, **OPTIONS)
        texts[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.engine_core.shutdown()
    assert texts[2] == texts[1]


def test_tp2_over_gloo_equals_tp1(tiny_model_dir, monkeypatch) -> None:
    """The collectives through torch.distributed (what CUDA and CPUs without axon's kernels
    use) instead of shared memory: the same answers."""
    monkeypatch.setenv("AXON_CPU_SHM_COLLECTIVES", "0")  # the worker processes inherit it
    folder = tiny_model_dir("qwen2")
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2))


def test_tp2_with_async_scheduling_equals_tp1(tiny_model_dir) -> None:
    """Step N+1 queued behind step N at the ranks reads the tokens step N sampled."""
    folder = tiny_model_dir("llama")
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2, async_scheduling=True))


def test_tp2_compiled_buckets_equal_eager_tp1(tiny_model_dir) -> None:
    folder = tiny_model_dir("qwen3")
    compiled = {"enforce_eager": False, "bucket_compile": "warmup", "max_num_batched_tokens": 32}
    _assert_same(_run(folder), _run(folder, tensor_parallel_size=2, **compiled))


def test_a_model_that_does_not_split_is_refused_before_loading(tiny_model_dir) -> None:
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size 3 does not divide the model's number of attention heads \(4\)",
    ):
        create_engine_config(model=tiny_model_dir("llama"), tensor_parallel_size=3)
    folder = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="'draft_model' is not supported with tensor_parallel_size 2"):
        create_engine_config(
            model=folder,
            tensor_parallel_size=2,
            speculative_config={"method": "draft_model", "model": folder, "num_speculative_tokens": 2},
        )
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 'mp' or 'ray'"):
        create_engine_config(
            model=tiny_model_dir("llama"), tensor_parallel_size=2, distributed_executor_backend="uni"
        )


def count_reads(monkeypatch) -> list[int]:
    """The bytes of every checkpoint read from now on (one entry per ``LazyTensor.read``)."""
    read_bytes: list[int] = []
    original = LazyTensor.read

    def counting_read(self, dim=None, start=0, count=0):
        tensor = original(self, dim, start, count)
        read_bytes.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(LazyTensor, "read", counting_read)
    return read_bytes


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_reads_only_its_slice(tiny_model_dir, monkeypatch, rank: int) -> None:
    """Rank r's parameters are its slices of the checkpoint, and it reads no byte more."""
    from safetensors.torch import load_file

    folder = tiny_model_dir("qwen2")
    config = create_engine_config(model=folder, dtype="float32", tensor_parallel_size=2).model_config
    read_bytes = count_reads(monkeypatch)
    monkeypatch.setattr(parallel_state, "_group", TensorParallelGroup(rank=rank, size=2))
    model = load_model(config, torch.float32, torch.device("cpu"), get_attention_backend("reference", None))
    full = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        dims = json.load(f)
    params = dict(model.named_parameters())
    assert read_bytes and sum(read_bytes) == sum(p.numel() * p.element_size() for p in params.values())
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert sum(read_bytes) < 0.6 * total  # about half, plus the replicated norms

    layer = "model.layers.0"
    q, k, v = (full[f"{layer}.self_attn.{n}_proj.weight"] for n in "qkv")
    heads_q, heads_kv = dims["num_attention_heads"] // 2, dims["num_key_value_heads"] // 2
    d = dims["hidden_size"] // dims["num_attention_heads"]
    want_qkv = torch.cat(
        [
            q[rank * heads_q * d : (rank + 1) * heads_q * d],
            k[rank * heads_kv * d : (rank + 1) * heads_kv * d],
            v[rank * heads_kv * d : (rank + 1) * heads_kv * d],
        ]
    )
    assert torch.equal(params[f"{layer}.self_attn.qkv_proj.weight"], want_qkv)
    width = dims["intermediate_size"] // 2
    down = full[f"{layer}.mlp.down_proj.weight"][:, rank * width : (rank + 1) * width]
    assert torch.equal(params[f"{layer}.mlp.down_proj.weight"], down)
    rows = dims["vocab_size"] // 2
    embed = full["model.embed_tokens.weight"][rank * rows : (rank + 1) * rows]
    assert torch.equal(params["model.embed_tokens.weight"], embed)
    assert torch.equal(params["model.norm.weight"], full["model.norm.weight"])
    assert model_loader.get_tp_group().size == 2


def test_a_killed_rank_ends_the_engine_with_its_error(tiny_model_dir) -> None:
    llm = LLM(model=tiny_model_dir("llama"), tensor_parallel_size=2, **OPTIONS)
    executor = llm.llm_engine.engine_core.executor
    pids = executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=rf"worker rank 1 \(pid {pids[1]}\) exited with code -9"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert time.monotonic() - start < 10
    llm.llm_engine.engine_core.shutdown()
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == psutil.STATUS_ZOMBIE


def test_a_dropped_engine_stops_its_ranks(tiny_model_dir) -> None:
    llm = LLM(model=tiny_model_dir("llama"), tensor_parallel_size=2, **OPTIONS)
    pids = llm.llm_engine.engine_core.executor.worker_pids
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(p) for p in pids)
