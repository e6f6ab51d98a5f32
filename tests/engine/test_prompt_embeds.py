"""Prompts given as embeddings (``enable_prompt_embeds``) on a tiny random Llama: the model's own
token embeddings as ``prompt_embeds`` generate what the token ids generate (whole, chunked,
batched beside a token prompt), the same embeddings hit the prefix cache and others do not,
every bad tensor is a ValueError that names it, and through a real ``axon serve
--enable-prompt-embeds`` a completion's base64 ``prompt_embeds`` answers what its token ids do,
with a 400 for each bad one."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch
import transformers as tf

from axon import LLM, SamplingParams
from tests.server.conftest import ServerProcess

IDS = [1, 504, 345, 282, 260, 114, 30, 198, 30, 203, 77, 91, 402, 17, 250, 6, 99, 310]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def embeds(folder: str) -> torch.Tensor:
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(IDS)).clone()


@pytest.fixture(scope="module")
def llm(folder: str) -> LLM:
    return LLM(model=folder, dtype="float32", enable_prompt_embeds=True, block_size=4)


def _ids(out) -> list[int]:
    return out.outputs[0].token_ids


def test_embeddings_generate_what_their_tokens_generate(llm: LLM, folder: str, embeds: torch.Tensor) -> None:
    expected = _ids(llm.generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[0])
    got = llm.generate({"prompt_embeds": embeds}, PARAMS, use_tqdm=False)[0]
    assert _ids(got) == expected
    assert len(got.prompt_token_ids) == len(IDS)  # one placeholder per row
    batch = llm.generate(
        [{"prompt_embeds": embeds[None]}, {"prompt_token_ids": IDS[:9]}], PARAMS, use_tqdm=False
    )
    assert _ids(batch[0]) == expected  # [1, num_tokens, hidden] is taken too
    assert _ids(batch[1]) == _ids(llm.generate({"prompt_token_ids": IDS[:9]}, PARAMS, use_tqdm=False)[0])
    chunked = LLM(model=folder, dtype="float32", enable_prompt_embeds=True, max_num_batched_tokens=8)
    assert _ids(chunked.generate({"prompt_embeds": embeds}, PARAMS, use_tqdm=False)[0]) == expected


def test_the_same_embeddings_hit_the_prefix_cache_and_others_do_not(llm: LLM, embeds: torch.Tensor) -> None:
    first = llm.generate({"prompt_embeds": embeds * 1.5}, PARAMS, use_tqdm=False)[0]
    again = llm.generate({"prompt_embeds": embeds * 1.5}, PARAMS, use_tqdm=False)[0]
    other = llm.generate({"prompt_embeds": embeds * 1.25}, PARAMS, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 4 and other.num_cached_tokens == 0
    assert _ids(again) == _ids(first)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"prompt_embeds": torch.zeros(3, 7)}, r"shape \[num_tokens, 64\]"),
        ({"prompt_embeds": torch.zeros(64)}, "shape"),
        ({"prompt_embeds": torch.zeros(0, 64)}, "shape"),
        ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.int64)}, "float32, bfloat16 or float16"),
        ({"prompt_embeds": torch.full((3, 64), float("nan"))}, "NaN or infinite"),
        ({"prompt_embeds": [[0.0] * 64]}, "must be a torch.Tensor"),
        ({"prompt_embeds": torch.zeros(3, 64), "prompt": "x"}, "takes nothing else"),
    ],
)
def test_bad_embeddings_are_named(llm: LLM, prompt: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, PARAMS, use_tqdm=False)


def test_prompt_logprobs_and_the_flag(llm: LLM, folder: str, embeds: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate({"prompt_embeds": embeds}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        LLM(model=folder, dtype="float32").generate({"prompt_embeds": embeds}, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="speculative decoding"):
        LLM(
            model=folder,
            enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )


def _b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def test_axon_serve_prompt_embeds(folder: str, embeds: torch.Tensor) -> None:
    server = ServerProcess("--model", folder, "--enable-prompt-embeds")
    try:
        client = server.wait_ready().client()
        model = client.models.list().data[0].id
        kwargs = {"model": model, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
        by_ids = client.completions.create(prompt=IDS, **kwargs)
        extra = {"ignore_eos": True, "prompt_embeds": _b64(embeds)}
        by_embeds = client.completions.create(
            model=model, prompt=None, max_tokens=6, temperature=0, extra_body=extra
        )
        assert by_embeds.choices[0].text == by_ids.choices[0].text
        assert by_embeds.usage.prompt_tokens == len(IDS)
        for bad, message in [
            ("@@@", "not a base64 torch.save'd tensor"),
            (_b64(torch.zeros(3, 5)), "shape"),
            (_b64(torch.zeros(3, 64, dtype=torch.int32)), "float32, bfloat16 or float16"),
        ]:
            with pytest.raises(openai.BadRequestError, match=message):
                client.completions.create(
                    model=model, prompt=None, max_tokens=2, extra_body={"prompt_embeds": bad}
                )
        assert client.completions.create(prompt=IDS, **kwargs).choices[0].text == by_ids.choices[0].text
    finally:
        server.stop()
