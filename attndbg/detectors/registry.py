"""Detector kinds -> detectors: the built-in packages, plus third parties, as backends have them.

The one list that `check --only` (checks/selection.py parse_only), `synth --inject`, `synth --list`, the help texts and docs/checking.md's
detector table read. A third-party package registers its `Detector` object with
`[project.entry-points."attndbg.detectors"] KIND = "pkg.mod:DETECTOR"`; one still in development,
not packaged, can be named in the environment instead: `ATTNDBG_DETECTORS="KIND=pkg.mod:DETECTOR,..."`
(check's worker processes inherit it). A built-in kind is never replaced by a third party's.

Free of torch: the built-in packages' `DETECTOR` objects name their hooks by string, so listing
them imports nothing they run.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from attndbg.detector_api.findings import FindingClass
from attndbg.detectors.base import Detector, Injection
from attndbg.detectors.catalog import injection_lines
from attndbg import plugins
from attndbg.plugins import PluginVariable

if TYPE_CHECKING:
    from attndbg.trace.schema import Trace

ENTRY_POINT_GROUP = "attndbg.detectors"
ENVIRONMENT = PluginVariable("ATTNDBG_DETECTORS", "detector", "KIND=pkg.module:attr")
# In the order they run and are listed.
BUILTIN = (
    FindingClass.INVARIANT,
    FindingClass.FILL_VALUE,
    FindingClass.TREE_MASK,
    FindingClass.SPLIT_MERGE,
    FindingClass.KERNELS,
    FindingClass.BATCH_INVARIANCE,
    FindingClass.EXPOSURE,
)


def _builtin_target(kind: FindingClass) -> str:
    return f"attndbg.detectors.{kind.value.replace('-', '_')}:DETECTOR"


def names() -> list[str]:
    """Every detector kind here: the built-in ones, then entry points, then the environment's."""
    return plugins.registered_names([kind.value for kind in BUILTIN], ENTRY_POINT_GROUP, ENVIRONMENT)


def kinds() -> list[FindingClass]:
    return [FindingClass(name) for name in names()]


def default_names() -> list[str]:
    """The detectors `check` runs without `--only`: every one but the opt-in ones (Detector.opt_in),
    which run only when named. Loads each (its package's `DETECTOR`, not what it runs)."""
    return [name for name in names() if not load(name).opt_in]


def load(kind: FindingClass | str) -> Detector:
    """The detector of `kind`; KeyError when none has it, LoadError when it cannot be loaded."""
    name = kind.value if isinstance(kind, FindingClass) else kind
    return _load(name, _target(name))


def _target(name: str) -> str:
    if name in (kind.value for kind in BUILTIN):
        return _builtin_target(FindingClass(name))
    if (ep := plugins.entry_point(ENTRY_POINT_GROUP, name)) is not None:
        return ep.value
    target = ENVIRONMENT.named().get(name)
    if target is None:
        raise KeyError(name)
    return target


class LoadError(Exception):
    """A registered detector that cannot be loaded: one line naming it, its target and why."""


@cache  # one object per (kind, target) and process: loading imports the package once
def _load(name: str, target: str) -> Detector:
    try:
        detector = plugins.load(target)
    except (ImportError, AttributeError) as e:
        raise LoadError(f"detector {name!r}: cannot load {target} ({type(e).__name__}: {e})") from None
    if not isinstance(detector, Detector):
        raise LoadError(f"detector {name!r}: {target} is a {type(detector).__name__}, not an attndbg.detectors.base.Detector")
    if detector.kind.value != name:
        raise LoadError(f"detector {name!r}: {target} is the detector of {detector.kind.value!r}")
    return detector


def detectors() -> list[Detector]:
    return [load(name) for name in names()]


def injection_catalog() -> dict[str, str]:
    """KIND:MISTAKE -> one line, for every detector: read from source where it can be (instant)."""
    return {kind: line for detector in detectors() for kind, line in injection_lines(detector).items()}


def injections() -> dict[str, Injection]:
    """KIND:MISTAKE -> the function that plants it (imports every detector's injections)."""
    return {kind: func for detector in detectors() for kind, func in detector.injection_table().items()}


def inject(trace: Trace, kind: str) -> Trace:
    """`trace` carrying the mistake `kind` ("tree-mask:bit-order"); KeyError when no detector has it,
    ValueError when it does not apply to this trace."""
    detector_kind, sep, _ = kind.partition(":")
    try:
        table = load(detector_kind).injection_table() if sep else {}
    except KeyError:  # not a detector's kind
        table = {}
    if kind not in table:
        raise KeyError(kind)
    return table[kind](trace)
