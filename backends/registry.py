"""Backend names -> adapters: the built-in ones (one table, ADAPTERS), plus third parties through
an entry point.

A third-party package registers `[project.entry-points."attndbg.backends"] NAME = "pkg.mod:Class"`;
the class follows `attndbg.backends.base.Backend`. An adapter still in development, not packaged,
can be named in the environment instead: `ATTNDBG_BACKENDS="NAME=pkg.mod:Class,..."` (check's
worker processes inherit it).
"""

from __future__ import annotations

from typing import Any, Protocol

from attndbg import plugins
from attndbg.backends import environment
from attndbg.backends.base import Backend
from attndbg.trace.schema import Plan


class OptionsByName(Protocol):
    """Each adapter's options by its name: what `create` takes (backends/options.py's
    BackendOptions, which reads adapters through this registry, so it is not imported here)."""

    def of(self, name: str) -> Any: ...

ENTRY_POINT_GROUP = "attndbg.backends"
# The built-in adapters: name -> "module:Class", in the form a plugin names one, imported when first
# asked for (vLLM's backend enum holds class paths the same way). The order is the listing's
# (`attndbg backends`, `--backend all`). An adapter of an optional library imports nothing heavy at
# import time and says why it cannot run when its library is missing.
ADAPTERS = {
    "reference": "attndbg.backends.reference:ReferenceBackend",
    "triton": "attndbg.backends.triton:TritonBackend",
    "flashinfer": "attndbg.backends.flashinfer:FlashInferBackend",
    "fa3": "attndbg.backends.fa3:FA3Backend",
    "mla": "attndbg.backends.mla:MLABackend",
    "vllm_paged": "attndbg.backends.vllm_paged:VllmPagedBackend",
}
BUILTIN = tuple(ADAPTERS)


ENVIRONMENT_VARIABLE = environment.VARIABLE


def backend_names() -> list[str]:
    return plugins.registered_names(list(BUILTIN), ENTRY_POINT_GROUP, environment.ENVIRONMENT)


def create(name: str, *, options: OptionsByName | None = None) -> Backend:
    """The adapter named `name`, given its entry of `options` (its defaults when it has none)."""
    cls = adapter_class(name)
    chosen = options.of(name) if options is not None else None
    return cls(chosen) if chosen is not None else cls()


def adapter_class(name: str) -> type[Backend]:
    """The class of the adapter named `name`, without creating one (its capabilities are class
    attributes); KeyError when no adapter has that name."""
    if name in ADAPTERS:
        return plugins.load(ADAPTERS[name])
    if (ep := plugins.entry_point(ENTRY_POINT_GROUP, name)) is not None:
        return ep.load()
    target = environment.ENVIRONMENT.named().get(name)
    if target is not None:
        return plugins.load(target)
    raise KeyError(name)


def adapter_of(plan: Plan) -> Backend | None:
    """The adapter whose layout `plan` is in (the one `plan.backend` names), or None when no
    adapter has that name (an engine's own backend, e.g. vLLM's)."""
    try:
        return create(plan.backend)
    except KeyError:
        return None


def resolve(spec: str) -> list[str]:
    """'triton,reference' or 'all' -> names; unknown names raise KeyError naming the first."""
    if spec.strip() == "all":
        return backend_names()
    names = [n.strip() for n in spec.split(",") if n.strip()]
    known = backend_names()
    for n in names:
        if n not in known:
            raise KeyError(n)
    return names
