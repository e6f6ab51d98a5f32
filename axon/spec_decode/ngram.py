"""The ngram proposer (prompt lookup): draft what followed the last occurrence of the request's
own most recent tokens.

For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``: find the latest earlier place
where the sequence's last n tokens occur, and draft the (up to) k tokens that followed them.
Copy-heavy requests (editing a file the prompt holds, quoting, code) repeat long runs of their
context, which this finds at no model cost.
"""

from __future__ import annotations

import numpy as np


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` drafts for a sequence ``token_ids``; [] when no suffix of min_n..max_n recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # Candidate starts i < length - n whose n tokens equal the suffix: windows [i, i + n).
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence; its continuation
            return tokens[start : start + k].tolist()
    return []
