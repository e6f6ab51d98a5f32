from __future__ import annotations

import functools
import logging
import re
from importlib import resources
from typing import Any

logger = logging.getLogger(__name__)

# axon's ChatML template with tools in the Hermes format, for ChatML models whose own template
# ignores ``tools`` (SmolLM2, the default model): see ``template_for_tools``.
TOOLS_TEMPLATE = "templates/chatml_tools.jinja"


def get_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """The model folder's Hugging Face fast tokenizer (never downloads)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the user needs the path and cause
        raise ValueError(
            f"cannot load a tokenizer from {path!r}: {e} (a model folder without one runs with "
            "skip_tokenizer_init, on token ids)"
        ) from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def load_tokenizer(model_config: Any, chat_template: str | None = None) -> Any | None:
    """The engine's tokenizer: None with ``skip_tokenizer_init`` (token ids in and out)."""
    if model_config.skip_tokenizer_init:
        return None
    assert model_config.tokenizer is not None, "resolve_config() sets the tokenizer"
    return get_tokenizer(model_config.tokenizer, chat_template)


NO_TOKENIZER = (
    "the engine was started with skip_tokenizer_init (no tokenizer): prompts must be token ids "
    "({'prompt_token_ids': [...]}) and outputs have no text"
)


class PromptTooLong(ValueError):
    """The rendered prompt has more characters than the caller's bound (it was not tokenized)."""

    def __init__(self, num_chars: int, max_chars: int) -> None:
        super().__init__(f"the rendered prompt has {num_chars} characters, more than {max_chars}")
        self.num_chars = num_chars


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    max_chars: int | None = None,
) -> tuple[str, list[int]]:
    """Messages -> (prompt text, token ids) through the chat template: the one way offline, the
    CLI and the server render a conversation. Errors are ValueErrors that say what is wrong;
    a text longer than ``max_chars`` raises ``PromptTooLong`` instead of being tokenized."""
    if tokenizer is None:
        raise ValueError(f"a chat needs a tokenizer: {NO_TOKENIZER}")
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; pass chat_template")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template_for_tools(tokenizer, chat_template, chat_template_kwargs),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **(chat_template_kwargs or {}),
        )
    except Exception as e:  # jinja2 errors (e.g. raise_exception in the template) are the caller's
        raise ValueError(f"the chat template failed on these messages: {e}") from e
    if max_chars is not None and len(text) > max_chars:
        raise PromptTooLong(len(text), max_chars)
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def template_for_tools(
    tokenizer: Any, chat_template: str | None, chat_template_kwargs: dict[str, Any] | None
) -> str | None:
    """The template to render with: ``chat_template`` (None: the tokenizer's), unless the
    conversation has ``tools`` and that template never mentions them while being ChatML; then
    axon's ChatML template, which shows the tools to the model in the Hermes format that
    ``--tool-call-parser hermes`` reads. Without it a template such as SmolLM2's drops the tools
    silently and ``tool_choice: "auto"`` can never produce a call."""
    if not (chat_template_kwargs or {}).get("tools"):
        return chat_template
    source = chat_template if chat_template is not None else tokenizer.chat_template
    if not isinstance(source, str) or re.search(r"\btools\b", source):
        return chat_template  # renders tools itself (or is a dict of named templates: left alone)
    if "<|im_start|>" not in source:
        _log_once("the chat template ignores tools and is not ChatML: the tools are not shown to the model")
        return chat_template
    _log_once(
        f"the model's chat template ignores tools; using axon's tool-aware template (axon/engine/"
        f"{TOOLS_TEMPLATE}: ChatML, tools in the system message, calls as <tool_call>{{...}}</tool_call>) "
        "for requests with tools"
    )
    return chatml_tools_template()


@functools.cache
def chatml_tools_template() -> str:
    return resources.files("axon.engine").joinpath(TOOLS_TEMPLATE).read_text(encoding="utf-8")


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)
