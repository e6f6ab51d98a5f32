"""GPT-OSS's chat path through a real ``axon serve`` with the official client:
``--reasoning-parser openai_gptoss --enable-auto-tool-choice --tool-call-parser openai``.

The model is a tiny random GPT-OSS whose tokenizer is SmolLM2's plus harmony's special tokens,
with a harmony-style chat template that renders ``reasoning_effort``. A random model does not
write harmony messages, so what this checks end to end is the plumbing: ``reasoning_effort``
reaches the template, the output is detokenized with its special tokens kept and parsed (text
outside harmony messages is the content, as the offline engine decodes it), streamed equals
whole, and bad input is a 400. The parsing of harmony messages themselves, whole and streamed
at every cut, is tested in tests/structured_output/test_parsers.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from axon import LLM, SamplingParams
from tests.conftest import GPT_OSS_DIMS
from tests.server.conftest import ServerProcess

HARMONY_TOKENS = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
]
TEMPLATE = (
    "{%- if reasoning_effort is defined and reasoning_effort %}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>{% endif -%}"
    "{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor -%}"
    "{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, smollm2_path: str) -> str:
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.chat_template = TEMPLATE
    config = tf.GptOssConfig(
        **(GPT_OSS_DIMS | {"vocab_size": len(tokenizer)}),
        tie_word_embeddings=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|return|>"),
    )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(tmp_path_factory.mktemp("tiny-gpt-oss-harmony"))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def server(folder: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model",
        folder,
        "--dtype",
        "bfloat16",
        "--reasoning-parser",
        "openai_gptoss",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "openai",
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_reasoning_effort_reaches_the_chat_template(server: ServerProcess) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, temperature=0)
    high = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, temperature=0, reasoning_effort="high"
    )
    # "<|start|>system<|message|>Reasoning: high<|end|>" joins the prompt.
    assert high.usage.prompt_tokens > plain.usage.prompt_tokens + 4
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=2, reasoning_effort="extreme"
        )
    assert "reasoning_effort" in str(err.value)


def test_output_outside_harmony_messages_is_the_content_whole_and_streamed(
    server: ServerProcess, folder: str
) -> None:
    client = server.client()
    model = client.models.list().data[0].id
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    # The offline engine on the same prompt, special tokens kept as the parser reads them.
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=256)
    tokenizer = llm.get_tokenizer()
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=10, skip_special_tokens=False)
    offline = llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0].text
    assert message.content == offline
    assert (message.model_extra or {}).get("reasoning_content") is None and not message.tool_calls
    stream = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == message.content


def test_special_tokens_stay_in_the_text_the_parsers_read(server: ServerProcess, folder: str) -> None:
    """With the harmony parsers, markers are kept (a plain server would drop these tokens)."""
    import transformers as tf

    end = tf.AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|end|>")
    client = server.client()
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=3, temperature=0, logit_bias={str(end): 100}
    )
    assert reply.choices[0].message.content == "<|end|>" * 3
