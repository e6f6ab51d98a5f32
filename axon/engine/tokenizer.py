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
