"""Engine packages for the recorder tests: import them, or skip, or fail when CI requires them.

The SGLang and vLLM adapters are tested against the engines' own classes. Locally an engine may be
missing (it is a large install): its tests skip with the reason. CI installs the engines
(`.ci/install-*.sh`) and sets ATTNDBG_REQUIRE_ENGINES=1, so a broken install fails loudly instead of
turning the adapter tests into silent skips.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ENV = "ATTNDBG_REQUIRE_ENGINES"


def engines_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def import_engine(module_name: str) -> ModuleType:
    """The imported module, else `pytest.skip` (or `pytest.fail` under ATTNDBG_REQUIRE_ENGINES=1).

    Call it at module level of a test file: a skip there skips the whole file with the reason.
    Only a missing package is a skip; any other import error is a real failure and propagates.
    """
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        _skip(f"{module_name} cannot be imported ({e}); install it with .ci/install-*.sh to run these tests")
    package = module_name.split(".")[0]
    supported = SUPPORTED.get(package)
    installed = importlib.metadata.version(package) if supported else None
    if supported and not supported[0] <= _release(installed) <= supported[1]:
        # Another release moves the engine's internals the adapter reads (transformers' continuous
        # batching config changed its arguments between releases): not this adapter's version.
        _skip(f"{package} {installed} is installed; the adapter supports {_dotted(supported[0])} to {_dotted(supported[1])} (.ci/install-{package}.sh installs the oldest)")
    return module


# The releases the adapter is tested with, oldest and newest, for engines whose installs may differ
# elsewhere (the GPU machine's image has its own transformers). .ci/install-*.sh installs the oldest.
SUPPORTED = {"transformers": ((5, 20, 2), (5, 24, 0))}


def _release(version: str | None) -> tuple[int, ...]:
    """The release numbers of a version: "5.24.0" -> (5, 24, 0); a suffix (".dev0", "+cu12") ends them."""
    parts = []
    for part in (version or "").split("+")[0].split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def _dotted(release: tuple[int, ...]) -> str:
    return ".".join(map(str, release))


def _skip(reason: str) -> NoReturn:
    if engines_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
