"""The hook toolkit every engine adapter wraps the engine with: wrap a method where a class defines
it, once; reach the subclasses that exist now and those defined later.

Why subclasses: engines import their attention classes lazily (SGLang's attention registry, vLLM's
backend selector), and every subclass overrides the methods we hook, so wrapping the base class is
not enough. An adapter wraps `[base, *subclasses(base)]` when it installs and registers
`on_subclass(base, instrument)` for the classes defined afterwards: it runs the moment a subclass
statement executes. Every wrapper carries `MARK`, so installing twice wraps nothing twice.

What a wrapper does with the engine's call (run it first and unchanged, then record inside
`RecordingSession.guard`, hand host copies to the writer with `snapshot`/`submit`) is the session's
contract (`session.py`); this module only places the wrappers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

MARK = "__attndbg_hook__"  # set on every wrapper attndbg installs

F = TypeVar("F", bound=Callable[..., Any])
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def mark(fn: F) -> F:
    """Mark `fn` as one of our wrappers."""
    setattr(fn, MARK, True)
    return fn


def is_hooked(fn: Any) -> bool:
    return bool(getattr(fn, MARK, False))


def patch(owner: type, name: str, wrap: Wrap) -> bool:
    """Replace `owner.name` by `wrap(owner.name)` where `owner` defines it itself (an inherited one is
    wrapped on the class that defines it); False, and nothing changed, when it is absent, already
    ours, or abstract (never called: every subclass overrides it)."""
    current = owner.__dict__.get(name)
    if current is None or not callable(current) or is_hooked(current) or getattr(current, "__isabstractmethod__", False):
        return False
    setattr(owner, name, mark(wrap(current)))
    return True


def subclasses(cls: type) -> list[type]:
    """Every class below `cls` defined so far, each once."""
    seen: list[type] = []
    stack = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in seen:
            seen.append(sub)
            stack.extend(sub.__subclasses__())
    return seen


def on_subclass(base: type, instrument: Callable[[type], None]) -> None:
    """Call `instrument(cls)` for every subclass of `base` defined from now on, after `base`'s own
    `__init_subclass__` (idempotent per base)."""
    own = base.__dict__.get("__init_subclass__")
    own_function = getattr(own, "__func__", None)
    if own_function is not None and is_hooked(own_function):
        return

    def __init_subclass__(cls: type, **kwargs: Any) -> None:
        if own_function is not None:
            own_function(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        instrument(cls)

    base.__init_subclass__ = classmethod(mark(__init_subclass__))  # type: ignore[method-assign]
