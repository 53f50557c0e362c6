"""Delta debugging over one step: `attndbg minimize`.

The step is checked once to find the failure to keep (`target.py`); then each reduction of
`shrink.py` is tried, largest first, and kept when the smaller step still shows that failure, of
the same kind:

    requests   ddmin (Zeller and Hildebrandt, 2002) over the batch's requests: halves, then
               complements, then finer partitions
    padding    one padded row of a graph step, then half of them
    heads      one KV head with one query head, then one KV head with its GQA group
    pages      page size 1, then half the page size (whole pages: a divisor)
    drafts     a verify step's trees cut to 2 draft tokens, then half, then one fewer; then
               pruned to topk 1, 2, ... children per node
    extends    a request's new tokens cut to 1, then half (a shorter chunk)
    columns    a request's whole cached prefix, then half of it (whole pages)

until a pass over all of them removes nothing. Every candidate is written as a trace (validated:
one that the loader would refuse is never run) and checked in a fresh worker process of
checks/workers.py, as many at once as `jobs`; of a round, the first candidate in order that
reproduces is kept, so the result does not depend on `jobs`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from attndbg.checks.selection import parse_only
from attndbg.checks.workers import CheckOne, check_in_workers
from attndbg.detector_api.context import CheckOptions
from attndbg.detector_api.findings import FindingClass
from attndbg.minimize import shrink, tokens
from attndbg.minimize.probe import probe_one
from attndbg.minimize.target import REPLAY, Failure, FailureKind, choose, failure_of, reproduces
from attndbg.trace import io
from attndbg.trace.errors import TraceError
from attndbg.trace.schema import Trace

# Passes over every reduction; each pass after the first only runs when the one before removed something.
MAX_PASSES = 3
# Rounds one reduction may keep in one pass (halving a long prefix takes about log2 of it).
MAX_ROUNDS = 12


class NothingToKeep(Exception):
    """The step does not show the failure asked for (the message says what it shows)."""


@dataclass(frozen=True)
class MinimizeOptions:
    backend: str
    wanted: tuple[str | None, str | None]  # --finding CLASS[/check]; (None, None): the step's first failure
    check: CheckOptions
    jobs: int = 2
    only: tuple[str, ...] = ()  # detectors the step's first check runs (check --only); (): those the target needs
    # What each worker runs on a candidate (checks/workers.py's check function, module level): the
    # detectors and the replay, and where the symptom is kept also the candidate's repro script.
    probe: CheckOne = probe_one
    symptom: str | None = None  # the original step's repro symptom every kept candidate must show ("crash", "nan-inf", "mismatch")


@dataclass(frozen=True)
class Outcome:
    original: Trace
    trace: Trace
    target: Failure
    symptom: str | None  # the repro symptom kept beside the target (None: the step's script did not reproduce)
    removed: tuple[str, ...]
    tried: int  # candidates checked
    invalid: int  # candidates the loader would refuse (never run)
    seconds: float


def _detectors_for(wanted: str | None, only: tuple[str, ...]) -> list[FindingClass]:
    """What the first check of the step runs: `only` when given, else the detector asked for, else
    every default one and the replay."""
    if only:
        return [*parse_only(",".join(n for n in only if n != REPLAY.value)), *([REPLAY] if REPLAY.value in only or wanted in (None, REPLAY.value) else [])]
    if wanted == REPLAY.value:
        return [REPLAY]
    if wanted is None or wanted == FindingClass.BACKEND_CRASH.value:
        return [*parse_only(None), REPLAY]
    return parse_only(wanted)


class _Search:
    def __init__(self, options: MinimizeOptions, workdir: Path, say: Callable[[str], None]):
        self.options, self.workdir, self.say = options, workdir, say
        self.tried = self.invalid = 0
        self.only: list[FindingClass] = []

    def failures(self, paths: list[Path]) -> list[list[Failure]]:
        results = check_in_workers(paths, self.only, self.options.check, jobs=len(paths), devices=None, check=self.options.probe)
        return [[failure_of(f) for f in r.report.findings] for r in results]

    def first_reproducing(self, candidates: Iterable[Callable[[], shrink.Reduced]]) -> shrink.Reduced | None:
        """The first of `candidates` (each built when its turn comes) that shows the target."""
        pending = iter(candidates)
        while True:
            batch: list[tuple[shrink.Reduced, Path]] = []
            for make in pending:
                try:
                    reduced = make()
                    path = self.workdir / f"candidate_{self.tried + self.invalid + len(batch)}.pt"
                    io.save(reduced.trace, path)  # validated: what the loader refuses is never run
                except (shrink.NotApplicable, TraceError):
                    self.invalid += 1
                    continue
                batch.append((reduced, path))
                if len(batch) == self.options.jobs:
                    break
            if not batch:
                return None
            self.tried += len(batch)
            for (reduced, _), found in zip(batch, self.failures([p for _, p in batch])):
                if reproduces(self.target, found, self.original_failures, self.options.symptom):
                    return reduced

    def run(self, path: str) -> Outcome:
        start = time.perf_counter()
        original = io.load(path)
        cls, check = self.options.wanted
        self.only = _detectors_for(cls, self.options.only)
        self.original_failures = self.failures([Path(path)])[0]
        target = choose(self.original_failures, self.options.wanted)
        if target is None:
            shown = ", ".join(sorted({f"{f.finding_class}/{f.check}" for f in self.original_failures})) or "nothing"
            wanted = f"{cls}/{check}" if check else cls or "a failure"
            raise NothingToKeep(f"{path}: shows no {wanted} with --backend {self.options.backend} (it shows {shown})")
        self.target = target
        # Candidates run only what the target needs.
        self.only = {FailureKind.MISMATCH: [REPLAY], FailureKind.FINDING: [FindingClass(target.finding_class)]}.get(target.kind, self.only)
        self.say(f"keeping {target}" + (f" and its repro's symptom ({self.options.symptom})" if self.options.symptom else ""))
        current, removed = original, []
        for _ in range(MAX_PASSES):
            before = len(removed)
            for reduction in (self._requests, self._padding, self._heads, self._pages, self._drafts, self._extends, self._columns):
                current = reduction(current, removed)
            if len(removed) == before:
                break
        return Outcome(original, current, target, self.options.symptom, tuple(removed), self.tried, self.invalid, time.perf_counter() - start)

    def _keep(self, reduced: shrink.Reduced, removed: list[str]) -> Trace:
        removed.append(reduced.removed)
        self.say(f"removed {reduced.removed}")
        return reduced.trace

    def _requests(self, current: Trace, removed: list[str]) -> Trace:
        n = 2
        while current.batch.batch_size >= 2:
            bs = current.batch.batch_size
            chunks = [list(range(bs))[i * bs // n : (i + 1) * bs // n] for i in range(n)]
            subsets = [c for c in chunks if c]
            complements = [[b for b in range(bs) if b not in c] for c in subsets] if n > 2 else []
            keeps = subsets + complements
            hit = self.first_reproducing((lambda keep=keep, t=current: shrink.keep_requests(t, keep) for keep in keeps))
            if hit is not None:
                was_subset = list(hit.rows[: hit.trace.batch.batch_size]) in subsets
                current = self._keep(hit, removed)
                n = 2 if was_subset else max(n - 1, 2)
                continue
            if n >= bs:
                break
            n = min(2 * n, bs)
        return current

    def _rounds(self, current: Trace, removed: list[str], cuts: Callable[[Trace], Iterable[Callable[[], shrink.Reduced]]]) -> Trace:
        """Keep the first of `cuts(current)` that reproduces, again on what it leaves, until none does."""
        for _ in range(MAX_ROUNDS):
            hit = self.first_reproducing(cuts(current))
            if hit is None:
                break
            current = self._keep(hit, removed)
        return current

    def _padding(self, current: Trace, removed: list[str]) -> Trace:
        return self._rounds(current, removed, self._padding_cuts)

    def _heads(self, current: Trace, removed: list[str]) -> Trace:
        model = current.model
        shapes = dict.fromkeys([(1, 1), (model.gqa_group, 1)])
        hit = self.first_reproducing((lambda s=s, t=current: shrink.fewer_heads(t, *s) for s in shapes))
        return self._keep(hit, removed) if hit is not None else current

    def _pages(self, current: Trace, removed: list[str]) -> Trace:
        return self._rounds(current, removed, self._page_cuts)

    def _drafts(self, current: Trace, removed: list[str]) -> Trace:
        return self._rounds(current, removed, self._draft_cuts)

    def _extends(self, current: Trace, removed: list[str]) -> Trace:
        return self._rounds(current, removed, self._extend_cuts)

    def _columns(self, current: Trace, removed: list[str]) -> Trace:
        return self._rounds(current, removed, self._column_cuts)

    @staticmethod
    def _padding_cuts(trace: Trace) -> Iterator[Callable[[], shrink.Reduced]]:
        graph = trace.graph
        pad = graph.capture_bs - trace.batch.batch_size if graph is not None else 0
        if pad > 1:
            for k in dict.fromkeys([1, pad // 2]):
                yield lambda k=k: shrink.keep_padding(trace, k)

    @staticmethod
    def _page_cuts(trace: Trace) -> Iterator[Callable[[], shrink.Reduced]]:
        page = trace.model.page_size
        for size in dict.fromkeys([1, page // 2]):
            if 1 <= size < page and page % size == 0:
                yield lambda size=size: shrink.smaller_pages(trace, size)

    @staticmethod
    def _draft_cuts(trace: Trace) -> Iterator[Callable[[], shrink.Reduced]]:
        spec = trace.spec
        if spec is None or not trace.is_tree_verify:
            return
        n = spec.draft_token_num
        for count in dict.fromkeys([2, (n + 1) // 2, n - 1]):  # fewer tokens, then fewer children per node
            if 1 <= count < n:
                yield lambda count=count: tokens.fewer_drafts(trace, count)
        for topk in range(1, spec.topk):
            yield lambda topk=topk: tokens.fewer_drafts(trace, n, topk)

    @staticmethod
    def _extend_cuts(trace: Trace) -> Iterator[Callable[[], shrink.Reduced]]:
        if trace.spec is not None:
            return
        lengths = trace.batch.extend_lens.tolist()
        for half in (False, True):  # one new token, then half of them, of each request in turn
            for b, extend in enumerate(lengths):
                keep = extend // 2 if half else 1
                if 1 <= keep < extend and not (half and keep == 1):
                    yield lambda b=b, keep=keep: tokens.shorter_extend(trace, b, keep)

    @staticmethod
    def _column_cuts(trace: Trace) -> Iterator[Callable[[], shrink.Reduced]]:
        page = trace.model.page_size
        prefixes = [int(p) // page * page for p in trace.batch.prefix_lens]
        for fraction in (1, 2):  # the whole cached prefix, then half of it, of each request in turn
            for b, prefix in enumerate(prefixes):
                count = prefix if fraction == 1 else prefix // 2 // page * page
                if count > 0 and (fraction == 1 or count < prefix):
                    yield lambda b=b, count=count: shrink.drop_columns(trace, b, count)


def minimize(path: str, options: MinimizeOptions, say: Callable[[str], None] = lambda _: None) -> Outcome:
    """Shrink the step at `path` while it shows the same failure; raises NothingToKeep when it shows none."""
    with tempfile.TemporaryDirectory(prefix="attndbg-minimize-") as workdir:
        return _Search(options, Path(workdir), say).run(path)
