"""axon on CUDA against transformers on CUDA: logits, greedy tokens, compiled buckets, bfloat16,
and a real ``axon serve --device cuda`` process. Skipped where no CUDA device is available.

Models are tiny random-weight ones (tests/conftest.py's ``tiny_model_dir``), float32 unless
said otherwise, built with SmolLM2's tokenizer: the bundled folder where it exists, else the
tokenizer files ``benchmarks/gpu/fetch_wheels.sh`` copies to ``.gpu_assets/`` for a machine
without the model. Each engine gets a small fixed KV pool (``num_gpu_blocks_override``): several
engines, the oracle and a server process share the device.
"""

from __future__ import annotations

import gc
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers as tf

from axon import LLM, SamplingParams
from axon.worker.logit_validation import teacher_forced_logits
from tests.server.conftest import ServerProcess

# AXON_GPU_TEST_DEVICE=cpu runs this module on the CPU, to try it out on a machine without CUDA.
CUDA = torch.device(os.environ.get("AXON_GPU_TEST_DEVICE", "cuda"))
pytestmark = pytest.mark.skipif(
    CUDA.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
)
GPU_TOKENIZER = Path(__file__).resolve().parents[2] / ".gpu_assets" / "smollm2-tokenizer"
ENGINE = {
    "device": CUDA.type,
    "max_model_len": 256,
    "max_num_seqs": 4,
    "block_size": 16,
    "num_gpu_blocks_override": 64,
}
PROMPTS = [[(11 * i + 5 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 17, 40))]
NUM_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
# Two kernels computing the same float32 logits may order a near tie differently; past such a
# tie the two sequences go their own ways, so they are compared only up to it.
TIE_MARGIN = 1e-4
# Small compiled shapes: 4 decode rows, 64 prefill tokens (all three prompts in one step).
BUCKETS = {
    "num_seqs_buckets": [4],
    "max_num_batched_tokens": 64,
    "num_batched_tokens_buckets": [64],
}


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Only the tokenizer is used here (the models are random): no GGUF needed on the GPU host."""
    if (GPU_TOKENIZER / "tokenizer.json").is_file():
        return str(GPU_TOKENIZER)
    from axon.engine.arg_utils import create_engine_config

    path = create_engine_config().model_config.model_path
    assert path is not None
    return path


@pytest.fixture(autouse=True)
def _free_device() -> Iterator[None]:
    yield
    gc.collect()
    if CUDA.type == "cuda":
        torch.cuda.empty_cache()


def _llm(folder: str, dtype: str = "float32", **kwargs) -> LLM:
    return LLM(model=folder, dtype=dtype, **{**ENGINE, **kwargs})


def _model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.engine_core.executor.worker.model


def _oracle(folder: str, dtype: torch.dtype = torch.float32):
    return tf.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(CUDA).eval()


@torch.no_grad()
def _oracle_last_logits(hf, token_ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([token_ids], device=CUDA)).logits[0, -1].float()  # [vocab]


@torch.no_grad()
def _oracle_greedy(hf, prompt: list[int], num_new: int) -> list[int]:
    """Greedy continuation by full recomputation each step: no cache, no stopping rule."""
    seq = list(prompt)
    for _ in range(num_new):
        seq.append(int(_oracle_last_logits(hf, seq).argmax()))
    return seq[len(prompt) :]


def _assert_same_greedy(hf, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """Token for token, up to a near tie in the oracle's logits (then the rest may differ)."""
    assert len(got) == len(expected) == NUM_NEW
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a != b:
            logits = _oracle_last_logits(hf, prompt + expected[:i])
            margin = abs(float(logits[a] - logits[b]))
            assert margin < TIE_MARGIN, (
                f"token {i}: {a} vs {b}, logit margin {margin:.2e} is no tie; got {got}, expected {expected}"
            )
            return


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers(family: str, tiny_model_dir) -> None:
    folder = tiny_model_dir(family)
    token_ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = _oracle(folder)(torch.tensor([token_ids], device=CUDA)).logits[0].float()
    llm = _llm(folder)
    model = _model(llm)
    assert next(model.parameters()).device.type == CUDA.type
    whole = teacher_forced_logits(model, token_ids, block_size=16)
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=1e-4)
    # Segmented prefill reads the earlier segments back from the paged cache.
    segmented = teacher_forced_logits(model, token_ids, block_size=16, segment=5)
    torch.testing.assert_close(segmented, expected, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def llama_eager(tiny_model_dir) -> tuple[str, list[list[int]]]:
    folder = tiny_model_dir("llama")
    llm = _llm(folder, enforce_eager=True, **BUCKETS)
    worker = llm.llm_engine.engine_core.executor.worker
    assert all(k.device.type == CUDA.type for kv in worker.kv_caches for k in kv)
    if CUDA.type == "cuda":
        assert worker.attention_backend == "reference" and worker.linear_backend == "torch"
        assert llm.llm_engine.engine_core.async_scheduling, "async scheduling is the CUDA default"
    return folder, _generate(llm, PROMPTS)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_matches_transformers(family: str, tiny_model_dir, llama_eager) -> None:
    folder = tiny_model_dir(family)
    got = llama_eager[1] if family == "llama" else _generate(_llm(folder), PROMPTS)
    hf = _oracle(folder)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        _assert_same_greedy(hf, prompt, tokens, _oracle_greedy(hf, prompt, NUM_NEW))


def test_compiled_buckets_equal_eager(llama_eager, tmp_path) -> None:
    folder, eager = llama_eager
    llm = _llm(folder, enforce_eager=False, bucket_compile="warmup", cache_root=str(tmp_path), **BUCKETS)
    compiler = llm.llm_engine.engine_core.executor.worker.compiler
    assert compiler is not None
    assert sorted(compiler.stats.records) == [4, 64] and not compiler.stats.failures, compiler.stats
    compiled = _generate(llm, PROMPTS)
    assert compiler.stats.graph_steps >= NUM_NEW  # one prefill step, then decodes, all compiled
    hf = _oracle(folder)
    for prompt, got, expected in zip(PROMPTS, compiled, eager, strict=True):
        _assert_same_greedy(hf, prompt, got, expected)


@pytest.fixture(scope="module")
def full_vocab_llama(tiny_model_dir) -> str:
    """A tiny random Llama over the tokenizer's whole vocabulary, so text prompts fit it."""
    return tiny_model_dir("llama_full_vocab")


def test_bfloat16_generates_text(full_vocab_llama: str) -> None:
    folder = full_vocab_llama
    llm = _llm(folder, dtype="bfloat16")
    worker = llm.llm_engine.engine_core.executor.worker
    assert next(worker.model.parameters()).dtype == torch.bfloat16
    assert worker.kv_caches[0][0].dtype == torch.bfloat16
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outputs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    tokenizer = llm.get_tokenizer()
    for out in outputs:
        comp = out.outputs[0]
        assert len(comp.token_ids) == 16 and all(0 <= t < len(tokenizer) for t in comp.token_ids)
        assert comp.text == tokenizer.decode(comp.token_ids, skip_special_tokens=True)
    # bfloat16 against the float32 oracle: the same top token at most positions of a prompt.
    token_ids = outputs[0].prompt_token_ids + list(outputs[0].outputs[0].token_ids)
    with torch.no_grad():
        expected = _oracle(folder)(torch.tensor([token_ids], device=CUDA)).logits[0].float()
    got = teacher_forced_logits(worker.model, token_ids, block_size=16)
    assert torch.isfinite(got).all()
    # Rounding moves each logit by a few thousandths (std ~0.16): the rows point the same way.
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.min().item() > 0.999, cosine
    agree = (got.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.8, f"bfloat16 top-1 agrees with float32 on only {agree:.0%} of positions"


def test_serve_on_cuda_answers_chat_and_exits_0_on_sigterm(full_vocab_llama: str) -> None:
    server = ServerProcess(
        full_vocab_llama,
        "--device",
        CUDA.type,
        "--num-gpu-blocks-override",
        "256",
        "--served-model-name",
        "tiny",
        env={"AXON_ENFORCE_EAGER": "1"},
    )
    try:
        server.wait_ready()
        import httpx

        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        client = server.client()
        messages = [{"role": "user", "content": "Say hello."}]
        # Random weights never choose EOS on purpose: ignore_eos and max_tokens bound the answer.
        extra = {"ignore_eos": True}
        reply = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, extra_body=extra
        )
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage is not None and reply.usage.completion_tokens == 12
        assert isinstance(reply.choices[0].message.content, str)
        stream = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        chunks = list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(timeout=60)
        log = server.log()
        server.stop()
    assert code == 0, f"axon serve exited with {code} on SIGTERM:\n{log[-4000:]}"
    assert "Traceback" not in log, log[-4000:]


def test_gpu_tokenizer_assets_are_complete() -> None:
    """The folder the GPU host uses in place of SmolLM2 loads as a tokenizer with a chat template."""
    if not (GPU_TOKENIZER / "tokenizer.json").is_file():
        pytest.skip(f"{GPU_TOKENIZER} not prepared (benchmarks/gpu/fetch_wheels.sh)")
    tok = tf.AutoTokenizer.from_pretrained(os.fspath(GPU_TOKENIZER))
    assert tok.chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
