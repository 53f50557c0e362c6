"""In-situ pointer audit: at every real CUDA-graph replay, the data pointers of the attention
metadata a graph reads are compared with those seen when the graph was captured.

A graph keeps the device addresses it was captured with. An engine that rebuilds a metadata
tensor before a replay (a new `torch.empty`, a reassigned attribute) instead of writing into the
captured buffer leaves the graph reading the old address: stale or freed memory, garbage
attention, at worst an illegal memory access. vLLM PR #52440 proposes this check inside vLLM
(DEBUG mode, per FULL graph descriptor); here it runs for any engine attndbg hooks, from outside.

An adapter names the graph (`key`: what the engine keys its graphs by) and hands over the object
holding the metadata (a dict of tensors, a metadata dataclass, a backend's wrappers): its device
tensors are collected by attribute path, a few levels deep. Only paths present at capture are
compared. Each moved path is reported once per graph (the first replay that shows it); the
caller logs it and fires the flight recorder's ring.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import types
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

MAX_DEPTH = 4  # batch dict -> per-layer-type dict -> tensor; metadata -> wrapper -> buffer
MAX_TENSORS = 512  # per object: enough for any metadata, bounded for an object graph that is not
MAX_VISITS = 4096  # containers and attributes looked at per object, for the same reason


def on_device(t: Tensor) -> bool:
    return t.device.type != "cpu"  # host mirrors are rebuilt every step by design; the graph reads device memory


# How a path's step is taken: an item of a dict, list or tuple (by its own key), or an attribute.
ITEM, ATTRIBUTE = 0, 1
Route = tuple[tuple[int, Any], ...]


def addresses(obj: Any, *, keep: Callable[[Tensor], bool] = on_device) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{path: (data_ptr, shape)} of the tensors reachable from `obj` (dicts, lists, tuples,
    dataclasses, plain objects' attributes), `keep` choosing which (device tensors by default)."""
    return {path: found for path, (found, _) in _walk(obj, keep).items()}


def _walk(obj: Any, keep: Callable[[Tensor], bool]) -> dict[str, tuple[tuple[int, tuple[int, ...]], Route]]:
    """addresses(), each path with its route from `obj` (how a replay finds the tensor again)."""
    found: dict[str, tuple[tuple[int, tuple[int, ...]], Route]] = {}
    seen: set[int] = set()

    def walk(value: Any, path: str, route: Route, depth: int) -> None:
        if len(found) >= MAX_TENSORS or depth > MAX_DEPTH or len(seen) >= MAX_VISITS:
            return
        if isinstance(value, Tensor):
            if keep(value):
                found[path] = ((value.data_ptr(), tuple(value.shape)), route)
            return
        if value is None or isinstance(value, (str, bytes, int, float, bool, types.ModuleType, enum.Enum)) or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, dict):
            items = [(str(k), (ITEM, k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            items = [(str(i), (ITEM, i), v) for i, v in enumerate(value)]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            items = [(f.name, (ATTRIBUTE, f.name), getattr(value, f.name, None)) for f in dataclasses.fields(value)]
        elif hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
            items = [(k, (ATTRIBUTE, k), v) for k, v in vars(value).items() if not k.startswith("__")]
        else:
            return
        for name, step, item in items:
            walk(item, f"{path}.{name}" if path else name, (*route, step), depth + 1)

    walk(obj, "", (), 0)
    return found


def _follow(obj: Any, route: Route) -> Any:
    """The value at `route` from `obj`, or None where the route no longer leads anywhere."""
    try:
        for how, key in route:
            obj = obj[key] if how == ITEM else getattr(obj, key)
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    return obj


def _pointers(obj: Any, routes: tuple[Route, ...]) -> tuple[int | None, ...]:
    """The data_ptr of the tensor at each route from `obj` (None where there is none)."""
    found = []
    for route in routes:
        value = _follow(obj, route)
        found.append(value.data_ptr() if isinstance(value, Tensor) else None)
    return tuple(found)


@dataclass(frozen=True)
class Moved:
    key: Hashable
    path: str
    captured: int  # data_ptr at capture
    now: int  # data_ptr at this replay

    def message(self, what: str) -> str:
        return f"{what} {self.path} moved since its CUDA graph {self.key!r} was captured (data_ptr {self.captured:#x} -> {self.now:#x}): the graph still reads the old address"


def report_moved(session: Any, moved: list[Moved], *, step: int | None, what: str) -> None:
    """Say each moved buffer once (session.note_once) and, in ring mode, fire the ring."""
    if not moved:
        return
    from attndbg.record.triggers import Trigger, TriggerKind

    for m in moved:
        message = m.message(what)
        session.note_once(message)
        if session.flight is not None:
            session.flight.fire(Trigger(kind=TriggerKind.POINTER, step=step, message=message))


class PointerAudit:
    """Addresses at capture per graph key; each replay compared against them."""

    def __init__(self, keep: Callable[[Tensor], bool] = on_device):
        self._keep = keep
        # per key: the paths found at capture (with their routes), and their routes and pointers
        # as two tuples, so that a replay where nothing moved is one tuple comparison
        self._captured: dict[Hashable, tuple[dict[str, tuple[tuple[int, tuple[int, ...]], Route]], tuple[Route, ...], tuple[int, ...]]] = {}
        self._reported: set[tuple[Hashable, str]] = set()
        self._lock = threading.Lock()

    def captured(self, key: Hashable, obj: Any) -> None:
        found = _walk(obj, self._keep)
        routes = tuple(route for _, route in found.values())
        pointers = tuple(ptr for (ptr, _), _ in found.values())
        with self._lock:
            self._captured[key] = (found, routes, pointers)
            self._reported = {r for r in self._reported if r[0] != key}

    def replayed(self, key: Hashable, obj: Any) -> list[Moved]:
        """The paths whose pointer differs from capture, not reported before (none for a key never
        captured). Every replay pays this: only the captured paths are followed, by the routes
        found at capture, instead of walking the whole object again, and their pointers compared
        at once; only a replay where one differs looks at each path."""
        with self._lock:
            captured = self._captured.get(key)
        if captured is None or not captured[0]:
            return []
        before, routes, pointers = captured
        if _pointers(obj, routes) == pointers:
            return []  # every captured path still holds a tensor at its captured address
        moved = []
        for path, ((ptr, _), route) in before.items():
            current = _follow(obj, route)
            if not isinstance(current, Tensor) or not self._keep(current):
                continue  # gone since capture (only paths present at both are compared)
            now = current.data_ptr()
            if now == ptr or (key, path) in self._reported:
                continue
            moved.append(Moved(key=key, path=path, captured=ptr, now=now))
        with self._lock:
            self._reported.update((key, m.path) for m in moved)
        return moved
