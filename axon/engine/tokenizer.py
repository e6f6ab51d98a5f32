from __future__ import annotations

from typing import Any


def get_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """The model folder's Hugging Face fast tokenizer (never downloads)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the user needs the path and cause
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


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
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; pass chat_template")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
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
