"""Rendering a conversation with tools when the model's chat template ignores them (SmolLM2's)."""

from __future__ import annotations

import pytest

from axon.engine.tokenizer import chatml_tools_template, render_chat, template_for_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str):
    from axon.engine.tokenizer import get_tokenizer

    return get_tokenizer(smollm2_path)


def test_tools_reach_the_prompt_of_a_template_that_ignores_them(tokenizer) -> None:
    assert "tools" not in tokenizer.chat_template
    plain, plain_ids = render_chat(tokenizer, ASK)
    text, ids = render_chat(tokenizer, ASK, chat_template_kwargs={"tools": TOOLS})
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in text
    assert text.endswith(plain[plain.index("<|im_start|>user") :])  # the conversation as the model's
    assert len(ids) > len(plain_ids) + 50
    # Without tools the model's own template renders, and axon's renders the same text.
    assert render_chat(tokenizer, ASK, chat_template=chatml_tools_template())[0] == plain


def test_calls_and_tool_results_render_back(tokenizer) -> None:
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
    }
    conversation = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"celsius": 21}'},
    ]
    text, _ = render_chat(tokenizer, conversation, chat_template_kwargs={"tools": TOOLS})
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
        '{"celsius": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in text


def test_templates_that_render_tools_or_are_not_chatml_are_kept(tokenizer) -> None:
    kwargs = {"tools": TOOLS}
    aware = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}{{ tools | tojson }}"
    assert template_for_tools(tokenizer, aware, kwargs) == aware
    llama = "{% for m in messages %}<|start_header_id|>{{ m.content }}{% endfor %}"
    assert template_for_tools(tokenizer, llama, kwargs) == llama
    assert template_for_tools(tokenizer, None, {"tools": []}) is None  # no tools: nothing to show
    assert template_for_tools(tokenizer, None, kwargs) == chatml_tools_template()
