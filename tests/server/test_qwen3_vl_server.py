"""Qwen3-VL through a real ``axon serve`` and the official ``openai`` client: chat messages with
base64 images (data URLs) answer what ``LLM.chat`` computes for the same images, streamed and
whole, with the image tokens counted in usage; a file:// URL under --allowed-local-media-path
works; each bad image is a 400 that names the problem, and the server goes on serving."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from axon import LLM, SamplingParams
from tests.server.conftest import ServerProcess


def _png(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


PNGS = [_png(64, 96, 1), _png(96, 64, 2)]


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "What is in these?"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "one.png").write_bytes(PNGS[0])
    return folder


@pytest.fixture(scope="module")
def server(qwen3_vl_dir: str, media_dir: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model", qwen3_vl_dir, "--dtype", "float32", "--max-model-len", "256",
        "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path", str(media_dir),
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_a_chat_with_images_answers_what_llm_chat_computes(server: ServerProcess, qwen3_vl_dir: str) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    messages = _messages(*(_data_url(p) for p in PNGS))
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                            stream=True)  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == whole.choices[0].message.content
    llm = LLM(model=qwen3_vl_dir, dtype="float32", max_model_len=256)
    offline_messages = _messages()
    offline_messages[0]["content"] += [{"type": "image", "image": Image.open(io.BytesIO(p))} for p in PNGS]
    offline = llm.chat(offline_messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert whole.choices[0].message.content == offline.outputs[0].text
    assert whole.usage.prompt_tokens == len(offline.prompt_token_ids)  # the images' tokens counted
    assert whole.usage.prompt_tokens > 2 * 6  # two images of 6 tokens each, and the text


def test_a_file_url_under_the_allowed_folder_is_read(server: ServerProcess, media_dir: Path) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=_messages(f"file://{media_dir / 'one.png'}"), max_tokens=3, temperature=0
    )
    assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("url_or_parts", "message"),
    [
        ("data:image/png;base64,bm90IGFuIGltYWdl", "cannot be decoded"),
        ("data:image/png;base64,@@@", "does not decode"),
        ("http://127.0.0.1:9/image.png", "could not be fetched"),
        ("file:///etc/hostname", "outside --allowed-local-media-path"),
        ("ftp://example.com/a.png", "must be a data:, http"),
        ([_data_url(PNGS[0])] * 3, "3 images, more than the 2 allowed"),
    ],
)
def test_bad_images_are_400s_and_the_server_goes_on(
    server: ServerProcess, url_or_parts, message: str
) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    urls = url_or_parts if isinstance(url_or_parts, list) else [url_or_parts]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=_messages(*urls), max_tokens=2)
    assert message in str(err.value)
    reply = client.chat.completions.create(
        model=model, messages=_messages(_data_url(PNGS[1])), max_tokens=2, temperature=0
    )
    assert reply.usage.completion_tokens == 2


def test_an_unsupported_content_part_is_a_400(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    messages = [
        {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
    ]
    with pytest.raises(openai.BadRequestError, match="content part type 'input_audio' is not supported"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2)
