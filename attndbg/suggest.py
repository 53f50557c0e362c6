"""Suggestions for a name typed wrong ("did you mean"), for the one-line errors of bad input.

`tree_mask` -> `tree-mask`, `kv_len` -> `kv_lens`, `tritonn` -> `triton` by similarity (difflib),
and a bare mistake name (`bit-order`) -> the one `KIND:MISTAKE` it is the MISTAKE of.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# difflib's own default: close enough that a suggestion is a likely typo, not a guess.
CUTOFF = 0.6


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The known name `word` was most likely meant to be, or None."""
    choices = list(choices)
    if word in choices:
        return None
    by_suffix = [c for c in choices if ":" in c and c.rpartition(":")[2] == word]
    if len(by_suffix) == 1:
        return by_suffix[0]
    # Compare with - and _ made one: a Python identifier typed for a dashed name is the commonest slip.
    folded = {c.replace("_", "-").lower(): c for c in choices}
    matches = difflib.get_close_matches(word.replace("_", "-").lower(), list(folded), n=1, cutoff=CUTOFF)
    return folded[matches[0]] if matches else None


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """The text to put after the name in an error, " (did you mean 'tree-mask'?)", or "" when
    nothing is close."""
    match = closest(word, choices)
    return f" (did you mean {match!r}?)" if match else ""
