"""Shared pieces of the structured-output tests: the real-server helper and a tool-aware template."""

from __future__ import annotations

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "axon_tests_server_conftest", os.path.join(os.path.dirname(__file__), "..", "server", "conftest.py")
)
assert _spec is not None and _spec.loader is not None
_server_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_server_conftest)
ServerProcess = _server_conftest.ServerProcess

# ChatML with Hermes-style tools (as Qwen2.5's template renders them), for SmolLM2, whose own
# template ignores tools.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are a function calling AI model. Here are the available tools: <tools>
{%- for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
For each function call return a JSON object within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
