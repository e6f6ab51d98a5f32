"""Token ids in and out with no tokenizer: ``skip_tokenizer_init`` on a model folder without
tokenizer files (a text model and the tiny Qwen3-VL with an image) generates the token ids a
normal engine generates, with no text; text prompts, chats and stop strings are refused with an
error that names the reason; ``SamplingParams(detokenize=False)`` gives the same ids and no text.
Through a real ``axon serve --skip-tokenizer-init`` with the openai client: a completion of
token ids, and a 400 for text, with the server still serving."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from axon import LLM, SamplingParams
from tests.server.conftest import ServerProcess

TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template", "added_tokens")
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
IDS = [1, 504, 345, 282, 260, 114, 30, 198, 30, 203]


def _without_tokenizer(src: str, dst: Path) -> str:
    dst.mkdir()
    for path in Path(src).iterdir():
        if not path.name.startswith(TOKENIZER_FILES):
            shutil.copy(path, dst / path.name)
    return str(dst)


@pytest.fixture(scope="module")
def bare_llama(tiny_model_dir, tmp_path_factory: pytest.TempPathFactory) -> str:
    return _without_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("bare") / "llama")


def test_token_ids_in_and_out_without_a_tokenizer(tiny_model_dir, bare_llama: str) -> None:
    expected = LLM(model=tiny_model_dir("llama")).generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[
        0
    ]
    llm = LLM(model=bare_llama, skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    out = llm.generate({"prompt_token_ids": IDS}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.outputs[0].text == ""
    assert all(lp.decoded_token is None for row in out.outputs[0].logprobs for lp in row.values())
    for bad, message in [
        ("Hello", "skip_tokenizer_init"),
        ({"prompt": "Hello"}, "prompts must be token ids"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(bad, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate({"prompt_token_ids": IDS}, SamplingParams(stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError, match="a chat needs a tokenizer"):
        llm.chat([{"role": "user", "content": "Hi"}], PARAMS, use_tqdm=False)
    # And the engine goes on.
    again = llm.generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_folder_without_a_tokenizer_names_the_flag(bare_llama: str) -> None:
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        LLM(model=bare_llama)


def test_detokenize_false_gives_the_ids_and_no_text(tiny_model_dir) -> None:
    llm = LLM(model=tiny_model_dir("llama"))
    text = llm.generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[0].outputs[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    ids = llm.generate({"prompt_token_ids": IDS}, params, use_tqdm=False)[0].outputs[0]
    assert ids.token_ids == text.token_ids and text.text and ids.text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        llm.generate({"prompt_token_ids": IDS}, SamplingParams(detokenize=False, stop=["x"]), use_tqdm=False)


def test_an_image_prompt_of_token_ids_without_a_tokenizer(qwen3_vl_dir: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(qwen3_vl_dir)
    ids = tokenizer.encode("See <|vision_start|><|image_pad|><|vision_end|> now.")
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 96, 3), dtype=np.uint8))
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
    kwargs = {"dtype": "float32", "max_model_len": 256}
    expected = LLM(model=qwen3_vl_dir, **kwargs).generate(prompt, PARAMS, use_tqdm=False)[0]
    bare = _without_tokenizer(qwen3_vl_dir, tmp_path / "vl")
    got = LLM(model=bare, skip_tokenizer_init=True, **kwargs).generate(prompt, PARAMS, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.prompt_token_ids == expected.prompt_token_ids  # the image's placeholders expanded
    assert len(got.prompt_token_ids) > len(ids)


def test_axon_serve_skip_tokenizer_init(bare_llama: str, tiny_model_dir) -> None:
    expected = LLM(model=tiny_model_dir("llama")).generate({"prompt_token_ids": IDS}, PARAMS, use_tqdm=False)[
        0
    ]
    server = ServerProcess("--model", bare_llama, "--skip-tokenizer-init")
    try:
        client = server.wait_ready().client()
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=IDS, max_tokens=6, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.choices[0].text == ""
        assert reply.usage.prompt_tokens == len(IDS) and reply.usage.completion_tokens == 6
        tokens = reply.choices[0].logprobs.tokens
        assert tokens == [f"token_id:{t}" for t in expected.outputs[0].token_ids]
        with pytest.raises(openai.BadRequestError, match="skip_tokenizer_init"):
            client.completions.create(model=model, prompt="Hello", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="a chat needs a tokenizer"):
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
        again = client.completions.create(model=model, prompt=IDS, max_tokens=2, temperature=0)
        assert again.usage.completion_tokens == 2
    finally:
        server.stop()
