"""What FlashInfer fills in for an argument a call left out: the defaults of the dumped version.

A dumped call records only the arguments its caller passed; FlashInfer fills the others from its
own defaults before the kernel runs. Those come from the call's `function_signature` (the record
holds `str(inspect.signature(f))` of the undecorated function, defaults included: the dumped
version's own), and, for the parameters a signature takes through `**kwargs`, from the keyword
defaults of the function it forwards them to, which the dump does not record:

    BatchDecodeWithPagedKVCacheWrapper.plan(..., *deprecated_positional_args, **kwargs)
        forwards to _plan_impl(..., *, pos_encoding_mode="NONE", window_left=-1,
        logits_soft_cap=None, q_data_type="float16", sm_scale=None, q_len_per_req=1, ...)
        (flashinfer/decode.py, 0.6 to 0.7)

`None` is what FlashInfer then turns into a value of its own: `logits_soft_cap` None is 0 (off),
`sm_scale` None is 1/sqrt(head_dim) (both in plan(); interop.md §1.5).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from attndbg.interop.flashinfer_dump import Call, parameter_items

# Keyword defaults of the functions a dumped signature forwards **kwargs to (flashinfer/decode.py
# BatchDecodeWithPagedKVCacheWrapper._plan_impl, read at FlashInfer fb28d72 and unchanged through 0.7).
FORWARDED_DEFAULTS: dict[str, dict[str, object]] = {
    "DecodeWithPagedKVCacheWrapper.plan": {
        "pos_encoding_mode": "NONE",
        "window_left": -1,
        "logits_soft_cap": None,
        "q_data_type": "float16",
        "sm_scale": None,
        "non_blocking": True,
        "disable_split_kv": False,
        "q_len_per_req": 1,
    },
}
FORWARDED_SOURCE = "_plan_impl's keyword defaults, which its plan(**kwargs) forwards to (flashinfer/decode.py)"


@dataclass(frozen=True)
class Default:
    value: object
    source: str  # where the value comes from, for `source.inferred`

    def note(self, name: str, becomes: str = "") -> str:
        shown = f"{self.value!r}{becomes}"
        return f"not passed: {shown}, {self.source}"


def default(call: Call | None, name: str) -> Default | None:
    """The value FlashInfer gives `name` when `call` did not pass it (None: no default known)."""
    if call is None:
        return None
    version = _version(call)
    for param, text in parameter_items(call):
        if param == name and text is not None:
            value = _literal(text)
            if value is not _NOT_LITERAL:
                return Default(value, f"the default in FlashInfer {version}'s {call.function}() signature, as dumped")
    forwarded = next((table for suffix, table in FORWARDED_DEFAULTS.items() if call.function.endswith(suffix)), {})
    if name in forwarded:
        return Default(forwarded[name], f"FlashInfer {version}'s default ({FORWARDED_SOURCE})")
    return None


_NOT_LITERAL = object()


def _literal(text: str) -> object:
    """A default written as a Python literal (-1, None, 'NHD', False, 0.0); anything else is not one."""
    text = text.strip()
    if len(text) > 64 or not re.fullmatch(r"[\w.'\"+\- ]*", text):
        return _NOT_LITERAL
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return _NOT_LITERAL


def _version(call: Call) -> str:
    versions = call.record.get("versions")
    version = versions.get("flashinfer") if isinstance(versions, dict) else None
    return version if isinstance(version, str) and len(version) < 64 and version.isprintable() else "(unknown version)"
