"""Mixture-of-experts models through a real ``axon serve`` with the official client: a tiny random
Qwen3-MoE (every layer sparse) and a tiny random GPT-OSS (sinks, sliding windows, MXFP4-free),
both with SmolLM2's tokenizer, in bfloat16, their experts on the fused CPU op where the CPU has
AVX-512 BF16. Greedy completions sent at once equal the offline engine's, one
prompt at a time; chat streams what it returns whole; bad input is a 400 that names the problem,
and the server goes on serving."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from axon import LLM, SamplingParams
from tests.server.conftest import COMPLETION_PROMPTS, ServerProcess

ARGS = ["--dtype", "bfloat16", "--max-model-len", "256"]


# family -> what its start-up log says of its experts
FAMILIES = {
    "qwen3_moe_full_vocab": "2 sparse MoE blocks of 8 experts (2 per token)",
    "gpt_oss_full_vocab": "4 sparse MoE blocks of 4 experts (2 per token)",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def moe_folder(tiny_model_dir, family: str) -> str:
    return tiny_model_dir(family)


@pytest.fixture(scope="module")
def server(moe_folder: str) -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", moe_folder, *ARGS)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def _fused_here() -> bool:
    from axon.config import default_cache_root
    from axon.platforms.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels(default_cache_root()) and bool(torch.ops.axon_cpu.linear_supported())


def test_the_start_up_log_names_the_experts_and_how_they_run(server: ServerProcess, family: str) -> None:
    how = "fused CPU op" if _fused_here() else "loop over experts"
    assert f"{FAMILIES[family]}: {how}" in server.log()


def test_greedy_completions_sent_at_once_equal_the_offline_engine(
    server: ServerProcess, moe_folder: str
) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    prompts = COMPLETION_PROMPTS[:8]

    def complete(prompt: str) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 12
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(complete, prompts))
    llm = LLM(model=moe_folder, dtype="bfloat16", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=12)
    offline = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    assert served == offline


def test_a_streamed_chat_equals_the_whole_one(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        == whole.choices[0].message.content
    )


def test_expert_parallel_serving_equals_one_rank(tiny_model_dir) -> None:
    """Qwen3-MoE with `--tensor-parallel-size 2 --enable-expert-parallel`: two ranks of four
    whole experts each, float32, the same greedy completions as the offline engine on one rank."""
    moe_folder = tiny_model_dir("qwen3_moe_full_vocab")
    proc = ServerProcess(
        "--model",
        moe_folder,
        "--max-model-len",
        "256",
        "--tensor-parallel-size",
        "2",
        "--enable-expert-parallel",
    )
    try:
        client = proc.wait_ready().client()
        for experts in ("0..3", "4..7"):  # each rank logs its share
            assert (
                f"2 sparse MoE blocks of 8 experts (2 per token), experts {experts} on this rank"
                in proc.log()
            )
        model = client.models.list().data[0].id
        prompts = COMPLETION_PROMPTS[8:12]
        served = [
            client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in prompts
        ]
    finally:
        proc.stop()
    llm = LLM(model=moe_folder, dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=8)
    assert served == [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_bad_input_is_a_400_and_the_server_goes_on(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hello", max_tokens=-3)
    assert "max_tokens" in str(err.value)
    reply = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3


def test_int4_experts_serve_what_the_offline_engine_computes(tiny_model_dir) -> None:
    """`--quantization int4` on Qwen3-MoE: the experts kept as int4 codes on the quantized
    fused op (the log says so), greedy completions sent at once equal the offline engine's."""
    from axon.model.layers.quant import quant_kernel_supported

    moe_folder = tiny_model_dir("qwen3_moe_full_vocab")
    proc = ServerProcess("--model", moe_folder, *ARGS, "--quantization", "int4")
    try:
        client = proc.wait_ready().client()
        how = (
            "fused CPU op on int4 codes"
            if _fused_here() and quant_kernel_supported()
            else "loop over experts"
        )
        assert f"{FAMILIES['qwen3_moe_full_vocab']}: {how}" in proc.log()
        served = _served_at_once(client, COMPLETION_PROMPTS[:6], max_tokens=10)
    finally:
        proc.stop()
    assert served == _offline(moe_folder, COMPLETION_PROMPTS[:6], max_tokens=10, quantization="int4")


def _served_at_once(client: openai.OpenAI, prompts: list[str], max_tokens: int) -> list[str]:
    """Greedy completions of ``prompts``, all sent at once."""
    model = client.models.list().data[0].id

    def complete(prompt: str) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))


def _offline(folder: str, prompts: list[str], max_tokens: int, **engine_args) -> list[str]:
    """The offline engine's greedy completions in bfloat16, one prompt at a time."""
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=256, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].text for p in prompts]


def test_sliding_layers_keep_only_their_window_and_serve_what_one_group_computes(
    server: ServerProcess, family: str, moe_folder: str
) -> None:
    """GPT-OSS's sliding layers (window 8) keep their blocks apart and free those out of the
    window (the start-up log says so; Qwen3-MoE has no window): completions well past the window,
    sent at once, equal the offline engine's with one group of blocks, one prompt at a time."""
    windowed = family.startswith("gpt_oss")
    assert ("the sliding-window layers' blocks apart (window 8" in server.log()) == windowed
    prompts = COMPLETION_PROMPTS[12:16]
    served = _served_at_once(server.client(), prompts, max_tokens=40)
    assert served == _offline(moe_folder, prompts, max_tokens=40, disable_hybrid_kv_cache_manager=True)
