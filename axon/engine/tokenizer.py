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


def render_chat(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
) -> tuple[str, list[int]]:
    """Messages -> (prompt text, token ids) through the chat template: the one way offline, the
    CLI and the server render a conversation. Errors are ValueErrors that say what is wrong."""
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
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
