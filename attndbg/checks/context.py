"""What detectors share for one step: the trace, which backends to use, and memoized replays.

Detectors consume replay results rather than re-running kernels themselves: `replay()` runs the
runner once per distinct (backends, options) and hands every detector the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attndbg.backends import registry
from attndbg.replay.runner import ReplayOptions, ReplayResult, replay
from attndbg.trace.schema import Trace


@dataclass(frozen=True)
class CheckOptions:
    backends: tuple[str, ...] | None = None  # None: every backend that can run here
    cuda_graph: bool = False  # also replay under CUDA graphs where a GPU is present
    layer: int | None = None


@dataclass
class CheckContext:
    trace: Trace
    path: str
    options: CheckOptions = CheckOptions()
    _replays: dict[ReplayOptions, ReplayResult] = field(default_factory=dict)
    _backends: tuple[str, ...] | None = None

    @property
    def step(self) -> int:
        return self.trace.source.step

    def backends(self) -> tuple[str, ...]:
        """Kernel backends to exercise (never the reference): asked for, or all that run here."""
        if self._backends is None:
            names = self.options.backends or tuple(registry.backend_names())
            usable = []
            for name in names:
                if name == "reference":
                    continue
                backend = registry.create(name)
                if backend.unavailable_reason() is None and backend.unsupported_reason(self.trace) is None:
                    usable.append(name)
            self._backends = tuple(usable)
        return self._backends

    def replay(self, options: ReplayOptions | None = None, backends: tuple[str, ...] | None = None) -> ReplayResult:
        options = options or ReplayOptions(layer=self.options.layer)
        names = backends if backends is not None else self.backends()
        key = (options, names)
        if key not in self._replays:
            self._replays[key] = replay(self.trace, self.path, list(names), options)
        return self._replays[key]
