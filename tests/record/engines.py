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
    pinned = PINNED.get(package)
    installed = importlib.metadata.version(package) if pinned else None
    if pinned and installed != pinned:
        # Another release moves the engine's internals the adapter reads (transformers' continuous
        # batching config changed its arguments between releases): not this adapter's version.
        _skip(f"{package} {installed} is installed; the adapter is tested against {pinned} (.ci/install-{package}.sh)")
    return module


# The engine releases .ci/install-*.sh pins, for engines whose installs may differ elsewhere (the GPU
# machine's image has its own transformers).
PINNED = {"transformers": "5.20.2"}


def _skip(reason: str) -> NoReturn:
    if engines_required():
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)
