"""Install engine adapters in a process whose engine we did not start ourselves.

`attndbg record` puts `attndbg/record/startup` on PYTHONPATH; its `sitecustomize` calls
`activate()` in every Python process of the engine (schedulers, workers). We do not import the
engines here (that would slow every process and break ones that never use them): a meta-path
finder waits until the module an adapter patches is imported, lets it load, then installs the
adapter. vLLM also reaches `attndbg.record.vllm:register` through its `vllm.general_plugins`
entry point; installing twice is harmless (adapters are idempotent).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType

from attndbg.record.engines import ENGINES

# module whose import triggers an adapter -> (engine, "package.module:function" that installs it)
TRIGGERS: dict[str, tuple[str, str]] = {engine.trigger: (engine.name, engine.install) for engine in ENGINES}


def _call(target: str) -> None:
    module_name, _, function = target.partition(":")
    getattr(importlib.import_module(module_name), function)()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched module finished executing."""

    def __init__(self, callbacks: dict[str, Callable[[ModuleType], None]]):
        self.callbacks = callbacks
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in self.callbacks or getattr(self._busy, fullname.replace(".", "_"), False):
            return None
        setattr(self._busy, fullname.replace(".", "_"), True)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            setattr(self._busy, fullname.replace(".", "_"), False)
        if spec is None or spec.loader is None:
            return None
        loader, callback = spec.loader, self.callbacks[fullname]

        class _Wrapped(importlib.abc.Loader):
            def create_module(self, spec):  # type: ignore[no-untyped-def]
                return loader.create_module(spec)

            def exec_module(self, module):  # type: ignore[no-untyped-def]
                loader.exec_module(module)
                callback(module)

        spec.loader = _Wrapped()
        return spec


_ACTIVE = False


def activate() -> None:
    """Arm the adapters of the engines the options name (once per process)."""
    global _ACTIVE
    if _ACTIVE:
        return
    from attndbg.record import problems
    from attndbg.record.options import RecordOptions

    options = RecordOptions.from_env()
    if options is None:
        return
    _ACTIVE = True
    if options.ring:
        from attndbg.record import signals

        signals.install()
    callbacks: dict[str, Callable[[ModuleType], None]] = {}
    for module_name, (engine, target) in TRIGGERS.items():
        if options.engines is not None and engine not in options.engines:
            continue

        def install(_module: ModuleType, target: str = target, engine: str = engine) -> None:
            try:
                _call(target)
            except Exception as e:  # noqa: BLE001 - never break the engine's import
                reason = f"cannot hook {engine} ({type(e).__name__}: {e})"
                problems.note(options, reason)
                print(f"attndbg record: {reason}; not recording it", file=sys.stderr, flush=True)

        if module_name in sys.modules:
            install(sys.modules[module_name])
        else:
            callbacks[module_name] = install
    if callbacks:
        sys.meta_path.insert(0, _AfterImport(callbacks))
