"""Each backend's options for one run, chosen by name: `--backend-option NAME.FIELD=VALUE`.

What a backend may be given is its own options dataclass (`Backend.options_class`: TritonOptions,
FlashInferOptions, FA3Options, MLAOptions); this module only reads those dataclasses' fields and
types, so a new field, or a new backend with options, reaches the CLI without an edit here.
Values are parsed from the field's type: an enum by value, a bool, an int, a float or text, and
`none` where the field may be None.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from attndbg.backends import registry
from attndbg.suggest import did_you_mean

SPEC_FORM = "NAME.FIELD=VALUE, e.g. fa3.verify_path=two-call"
# `--num-kv-splits N`: the one backend option with a flag of its own, the split count of SGLang's
# split-KV decode, which the triton adapter reproduces (TritonOptions.num_kv_splits).
SPLIT_COUNT_OPTION = ("triton", "num_kv_splits")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class OptionError(ValueError):
    """A `NAME.FIELD=VALUE` that names no backend, no field of its options, or a value the field
    cannot take; the message names it and the choices."""


@dataclass(frozen=True)
class BackendOptions:
    """The options object of each backend named, by backend name; a backend not named gets its
    defaults. Frozen and built of frozen dataclasses, so it keys memoized replays and is pickled
    to check's worker processes as it is."""

    chosen: tuple[tuple[str, Any], ...] = ()  # (backend name, its options dataclass), sorted by name

    def of(self, name: str) -> Any | None:
        """`name`'s options object, or None for its defaults."""
        return dict(self.chosen).get(name)

    def specs(self, name: str) -> list[str]:
        """`name`'s options as `--backend-option` takes them (`parse`'s inverse): NAME.FIELD=VALUE
        for each field that differs from its default, so a command line can repeat a run."""
        chosen = self.of(name)
        if chosen is None:
            return []
        default = type(chosen)()
        return [
            f"{name}.{f.name}={_text(getattr(chosen, f.name))}"
            for f in dataclasses.fields(chosen)
            if getattr(chosen, f.name) != getattr(default, f.name)
        ]

    def overridden_by(self, other: BackendOptions) -> BackendOptions:
        """These options with each backend `other` names taken from `other` (a detector that
        forces an option keeps it; the rest are the user's)."""
        return BackendOptions(tuple(sorted({**dict(self.chosen), **dict(other.chosen)}.items())))


def parse(specs: Iterable[str]) -> BackendOptions:
    """`["fa3.verify_path=two-call", "triton.num_kv_splits=1", ...]` -> BackendOptions; the
    first bad spec raises OptionError."""
    fields: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, field, value = _parse_one(spec)
        fields.setdefault(name, {})[field] = value
    chosen = {}
    for name, values in fields.items():
        try:
            chosen[name] = options_class(name)(**values)
        except ValueError as e:  # the dataclass's own checks (__post_init__)
            raise OptionError(f"--backend-option {name}: {e}") from None
    return BackendOptions(tuple(sorted(chosen.items())))


def options_class(name: str) -> type:
    """The options dataclass of the backend named `name`; OptionError when there is none."""
    known = registry.backend_names()
    if name not in known:
        raise OptionError(f"--backend-option: unknown backend {name!r}{did_you_mean(name, known)}; known: {', '.join(known)}")
    cls = registry.adapter_class(name).options_class
    if cls is None:
        takes = [n for n in known if _has_options(n)]
        raise OptionError(f"--backend-option: the {name} backend takes no options; backends with options: {', '.join(takes)}")
    return cls


def _has_options(name: str) -> bool:
    try:
        return registry.adapter_class(name).options_class is not None
    except (ImportError, AttributeError):  # a third-party adapter that cannot be imported here
        return False


def _parse_one(spec: str) -> tuple[str, str, Any]:
    target, equals, text = spec.partition("=")
    name, dot, field = target.strip().partition(".")
    if not equals or not dot or not name or not field:
        raise OptionError(f"--backend-option {spec!r}: expected {SPEC_FORM}")
    cls = options_class(name)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if field not in names:
        raise OptionError(f"--backend-option {spec}: {name} has no option {field!r}; its options: {', '.join(names)}")
    try:
        return name, field, parse_value(hints[field], text.strip())
    except ValueError as e:
        raise OptionError(f"--backend-option {spec}: {e}") from None


def _text(value: Any) -> str:
    """A field's value as `parse_value` reads it back."""
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def parse_value(annotation: Any, text: str) -> Any:
    """`text` as a value of `annotation` (`int | None`, `ExtendPath | str`, `bool | None`, ...);
    ValueError naming what was expected."""
    kinds = list(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else [annotation]
    optional = type(None) in kinds
    if optional and text.lower() == "none":
        return None
    none = ", or none" if optional else ""
    for kind in kinds:
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{text!r}: expected one of {', '.join(str(m.value) for m in kind)}{none}") from None
    if bool in kinds:  # before int: a bool is an int
        if text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{text!r}: expected true or false{none}")
    for kind, words in ((int, "an integer"), (float, "a number")):
        if kind in kinds:
            try:
                return kind(text)
            except ValueError:
                raise ValueError(f"{text!r}: expected {words}{none}") from None
    if str in kinds:
        return text
    raise ValueError(f"a field of type {annotation} cannot be set from the command line")
