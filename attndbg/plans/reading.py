"""What one step's recorded plan says, read once: `read(trace) -> PlanReading`.

Every part that judges a recorded plan reads it here (the detectors through the check context's
memoised `ctx.plan()`, the mistake models through the reading they are handed, the minimiser), so
the plan's meaning is written in one place and computed once per step. Each fact is read when first
asked for and kept:

    adapter, layout       the adapter `plan.backend` names (made once) and the layout it declares
    view, unread          the strict view of the whole plan (backends/plan_view.py), and why the
                          plan cannot be read as its kernel would, when it cannot
    tensors               the plan's tensors, index tensors as int64, those of a wrong dtype or rank
                          left out (index_problems)
    well_formed_offsets   the offsets lists that keep the offsets rule (offsets_problems)
    kv, coverage          the per-request KV (kv_problems) and the KV columns each real request's
                          ids cover
    visibility            on a tree-verify step, what each draft row may see (mask_problems)
    scalars               window, page size, prefix skipping, each with its source
    real_plan, refusal    the real requests' part of a graph-padded plan, and the guard's answer
                          on it (launch_view: its view when the guard lets it run)
    padded_offsets        the per-request offsets lists over the possibly padded batch
    kernel_seq_lens       the seq_lens an engine's builder hands its kernels (padded rows included)
    builder_copies, builder_counts, builder_paged_kv, builder_split_schedule, engine_field
                          an engine's own metadata and its builder's copies of it (engine_metadata.py)
    pieces                how each plan tensor divides into per-request pieces
    schedule              the kernel library's own work-item schedule (plan.plan_info) and the
                          plan's batch it must match (schedule.py)

Facts, not findings: a structural problem is data (plans/problems.py); the detectors word and
judge. This package imports only backends/ and trace/.
"""

from __future__ import annotations

from functools import cached_property

import torch
from torch import Tensor

from attndbg.backends import registry
from attndbg.backends.base import Backend
from attndbg.backends.plan_layout import KvEnd, MaskReading, PlanLayout, expected_dims, is_index
from attndbg.backends.plan_view import USUAL_OFFSETS, Offsets, PlanUnreadable, PlanView, PlanViewError, RequestKV
from attndbg.plans import engine_metadata, guard, scalars
from attndbg.plans.kv import kv_ends, read_kv, request_coverage
from attndbg.plans.offsets import is_indptr, offsets_problem
from attndbg.plans.pieces import Piece, metadata_pieces, pieces_of
from attndbg.plans.problems import PlanProblem, ProblemKind
from attndbg.plans.scalars import PlanScalar
from attndbg.plans.schedule import PlanSchedule, read_schedule
from attndbg.plans.visibility import Coverage, MaskSettings, PlanVisibility, read_visibility
from attndbg.trace.engines import engine_conventions
from attndbg.trace.schema import Plan, Trace


class PlanReading:
    """The facts of `trace.plan` (every one empty or None when the step recorded no plan)."""

    def __init__(self, trace: Trace):
        self.trace = trace
        self.plan: Plan | None = trace.plan

    # -- the adapter and its declarations --------------------------------------------------------

    @cached_property
    def adapter(self) -> Backend | None:
        """The adapter whose layout the plan is in (the one `plan.backend` names, default options);
        None when no adapter has that name (an engine's own backend, e.g. vLLM's)."""
        return registry.adapter_of(self.plan) if self.plan is not None else None

    @cached_property
    def layout(self) -> PlanLayout | None:
        """The lenient reading its backend declares; None when it declares none."""
        return self.adapter.plan_layout(self.trace, self.plan) if self.adapter is not None else None

    @cached_property
    def _strict(self) -> tuple[PlanView | None, PlanViewError | None]:
        if self.adapter is None:
            return None, None
        try:
            return self.adapter.plan_view(self.trace, self.plan), None
        except PlanViewError as e:
            return None, e

    @property
    def view(self) -> PlanView | None:
        """The strict view of the whole plan (padded requests included); None where there is none
        or the plan breaks it (the guard's refusal says how)."""
        return self._strict[0]

    @property
    def incomplete(self) -> bool:
        """The plan lacks a field its view declares, or holds one the view cannot read."""
        return isinstance(self._strict[1], PlanUnreadable)

    @cached_property
    def unread(self) -> str | None:
        """Why the plan detectors cannot read this plan as its kernel would (no adapter has the
        plan's backend name, the adapter declares no plan view or no layout for it, or the plan
        lacks a field its layout declares or holds one that cannot be read: "plan has no scalar
        window_left"); None when they can, or the step recorded no plan. A plan view that refuses
        the plan for a violated bound is not this: the refusal is a finding (invariants' plan-unsafe)."""
        if self.plan is None:
            return None
        if self.adapter is None:
            if engine_conventions(self.trace).metadata is not None:
                # vLLM's builders: their copies, counts and paged-KV lists are judged against the
                # engine's own fields (engine_metadata.py); no adapter's layout reads the rest.
                return "the engine's own metadata, judged by its builder rules; no adapter's plan layout reads it"
            return "no adapter here"
        view, error = self._strict
        if isinstance(error, PlanUnreadable):
            return str(error)  # incomplete, not unsafe: never launched, named on the verdict line
        if view is None and error is None:
            return f"the {self.adapter.name} adapter declares no plan view"
        if self.layout is None:
            return f"the {self.adapter.name} adapter declares no plan layout for it"
        return None

    # -- tensors and offsets ---------------------------------------------------------------------

    @cached_property
    def _typed(self) -> tuple[dict[str, Tensor], list[PlanProblem]]:
        tensors: dict[str, Tensor] = {}
        problems: list[PlanProblem] = []
        for name, value in (self.plan.tensors.items() if self.plan is not None else ()):
            if is_index(name) and (value.is_floating_point() or value.is_complex() or value.dtype is torch.bool):
                problems.append(PlanProblem(ProblemKind.INDEX_DTYPE, name, detail={"dtype": str(value.dtype).replace("torch.", "")}))
                continue
            dims = expected_dims(name)
            if dims is not None and value.dim() != dims:
                problems.append(PlanProblem(ProblemKind.INDEX_RANK, name, detail={"shape": list(value.shape), "dims": dims}))
                continue
            tensors[name] = value.to(torch.int64) if is_index(name) else value
        return tensors, problems

    @property
    def tensors(self) -> dict[str, Tensor]:
        """The plan's tensors in plan order, index tensors as int64; those of a dtype or rank no
        kernel takes as indices are left out (index_problems)."""
        return self._typed[0]

    @property
    def index_problems(self) -> list[PlanProblem]:
        return self._typed[1]

    @cached_property
    def _offsets(self) -> tuple[frozenset[str], list[PlanProblem]]:
        good, problems = [], []
        for name, values in self.tensors.items():
            if not is_indptr(name):
                good.append(name)
                continue
            problem = offsets_problem(name, values)
            if problem is None:
                good.append(name)
            else:
                problems.append(problem)
        return frozenset(good), problems

    @property
    def well_formed_offsets(self) -> frozenset[str]:
        """The names of `tensors` that are no offsets list, or one that keeps the offsets rule."""
        return self._offsets[0]

    @property
    def offsets_problems(self) -> list[PlanProblem]:
        """Each offsets list that breaks the rule, in plan order."""
        return self._offsets[1]

    # -- scalars -----------------------------------------------------------------------------------

    @cached_property
    def scalars(self) -> dict[str, PlanScalar]:
        """The scalars the layout reads, by role ("window", "page_size", "skip_prefix"), each with
        its source."""
        if self.layout is None:
            return {}
        found = {
            "window": scalars.kernel_window(self.trace, self.plan, self.layout.window),
            "page_size": scalars.page_size(self.trace, self.plan, self.layout),
        }
        skip = scalars.skip_prefix(self.plan, self.layout)
        if skip is not None:
            found["skip_prefix"] = skip
        return found

    # -- the per-request KV ----------------------------------------------------------------------

    @cached_property
    def _kv(self) -> tuple[RequestKV | None, list[PlanProblem]]:
        # An incomplete plan is not read per request: how its layout reads it may hang on the
        # missing field (fa3's verify_path picks one call or two), so what it would say is a guess.
        # The verdict names it (unread); checks of the tensors it holds still run.
        if self.layout is None or self.incomplete:
            return None, []
        return read_kv(self.layout, self.scalars["page_size"].value, self.tensors, set(self.well_formed_offsets))

    @property
    def kv(self) -> RequestKV | None:
        """Every request the plan covers (padded ones included): the ids its kernel reads and the
        tokens they hold; None when the plan has no layout, is incomplete or malformed (kv_problems)."""
        return self._kv[0]

    @property
    def kv_problems(self) -> list[PlanProblem]:
        return self._kv[1]

    @property
    def ends(self) -> tuple[KvEnd, ...]:
        """Where a request's listed columns may end on this step, in the order tried."""
        return kv_ends(self.trace, self.layout) if self.layout is not None else ()

    def request_coverage(self, b: int) -> tuple[int, int] | None:
        """(start, end) of request b's KV columns its ids cover; None when its length fits no rule."""
        assert self.kv is not None
        return request_coverage(self.trace, self.kv, self.ends, b)

    @cached_property
    def coverage(self) -> Coverage | None:
        """Per real request, the columns [start, end) of its KV row that the plan reads (None where
        its length fits no rule); None overall when the plan is absent, has no layout or its KV
        cannot be read."""
        kv = self.kv
        if kv is None or kv.requests < self.trace.batch.batch_size:
            return None
        return [self.request_coverage(b) for b in range(self.trace.batch.batch_size)]

    # -- a verify step's visibility -----------------------------------------------------------------

    @cached_property
    def _visibility(self) -> tuple[PlanVisibility | None, list[PlanProblem]]:
        layout, coverage = self.layout, self.coverage
        if not self.trace.is_tree_verify or layout is None or coverage is None:
            return None, []
        skip = self.scalars.get("skip_prefix")
        full = layout.mask is MaskReading.FULL_BLOCKS
        settings = MaskSettings(window=self.scalars["window"].value, skip_prefix=full and skip is not None and bool(skip.value), window_right=scalars.window_right(self.plan))
        return read_visibility(self.trace, layout, coverage, settings)

    @property
    def visibility(self) -> PlanVisibility | None:
        """On a tree-verify step, what the plan's kernel lets each draft row of each real request see;
        None on other steps, or when the plan's mask cannot be read (mask_problems)."""
        return self._visibility[0]

    @property
    def mask_problems(self) -> list[PlanProblem]:
        return self._visibility[1]

    # -- padded rows and the guard ------------------------------------------------------------------

    @cached_property
    def real_plan(self) -> Plan | None:
        """The real requests' part of a plan recorded at a CUDA-graph replay (guard.real_requests_only);
        any other plan as it is."""
        return guard.real_requests_only(self.trace, self.plan, self.adapter) if self.plan is not None else None

    @cached_property
    def _guarded(self) -> tuple[PlanView | None, guard.Refusal | None]:
        if self.plan is None:
            return None, None
        # A plan that is all real requests is guarded on the strict view already made of it.
        viewed = self._strict if self.real_plan is self.plan and self.adapter is not None else None
        return guard.guarded_view(self.trace, self.real_plan, self.adapter, viewed=viewed)

    @property
    def refusal(self) -> guard.Refusal | None:
        """Why the guard does not launch the real requests' plan; None when it does (or no plan)."""
        return self._guarded[1]

    @property
    def launch_view(self) -> PlanView | None:
        """The real requests' plan as its kernels read it, when the guard lets it run."""
        return self._guarded[0]

    @cached_property
    def padded_offsets(self) -> dict[str, int]:
        """The plan tensors that are per-request offsets over the possibly padded batch, each with
        its entries per request (a two-call verify's expand_ tables have one per draft token): the
        usual names (plan_view.USUAL_OFFSETS), whether or not the consuming kernel reads them (an
        engine may hand a stale one to another kernel of the step), then every other Offsets the
        strict view declares (a third-party layout names its own)."""
        offsets = dict.fromkeys(USUAL_OFFSETS, 1)
        view = self.view
        if view is not None:
            stride = {name: rows.per_request for rows in view.layout or () for name, _ in rows.offsets}
            for bound in view.bounds:
                if isinstance(bound, Offsets):
                    offsets.setdefault(bound.field, stride.get(bound.field, 1))
        return offsets

    @cached_property
    def kernel_seq_lens(self) -> tuple[str, Tensor] | None:
        """(plan name, [rows] int64) of the seq_lens an engine's builder hands its kernels, padded
        rows included, where the engine records them beside the runner's (vLLM: the builder's
        output, which may clamp what the runner padded); None where it records none."""
        metadata = engine_conventions(self.trace).metadata
        if metadata is None or self.plan is None:
            return None
        for name in metadata.kernel_seq_lens:
            value = self.plan.tensors.get(name)
            if value is not None and value.dim() == 1 and not value.is_floating_point() and value.dtype is not torch.bool:
                return name, value.to(torch.int64)
        return None

    @cached_property
    def builder_copies(self) -> list[engine_metadata.BuilderCopy]:
        """The builder's tensors that copy one of the engine's own fields (vLLM), each with the
        request its row 0 is; empty for an engine that records no metadata of its own."""
        metadata = engine_conventions(self.trace).metadata
        return engine_metadata.builder_copies(self.plan, metadata) if metadata is not None and self.plan is not None else []

    @cached_property
    def builder_counts(self) -> dict[str, int]:
        """The builder's request and token counts (num_decodes, num_decode_tokens, ...) it recorded."""
        metadata = engine_conventions(self.trace).metadata
        return engine_metadata.counts(self.plan, metadata) if metadata is not None and self.plan is not None else {}

    @cached_property
    def builder_paged_kv(self) -> list[engine_metadata.PagedKv]:
        """The builder's paged-KV lists (paged_kv_indptr, paged_kv_last_page_len), per part."""
        metadata = engine_conventions(self.trace).metadata
        return engine_metadata.paged_kv(self.plan, metadata) if metadata is not None and self.plan is not None else []

    @cached_property
    def builder_split_schedule(self) -> engine_metadata.SplitSchedule | None:
        """The builder's ahead-of-time split-KV schedule for the step and its split bound (vLLM's
        FA3 scheduler_metadata and max_num_splits), where it recorded both."""
        metadata = engine_conventions(self.trace).metadata
        return engine_metadata.split_schedule(self.plan, metadata) if metadata is not None and self.plan is not None else None

    def engine_field(self, meaning: str) -> engine_metadata.EngineField | None:
        """The engine's own field `meaning` ("seq_lens", "query_start_loc", "block_table",
        "slot_mapping") as recorded, the verbatim evidence first."""
        metadata = engine_conventions(self.trace).metadata
        if metadata is None or self.plan is None:
            return None
        return engine_metadata.engine_field(self.plan, getattr(metadata, meaning))

    # -- per-request pieces -----------------------------------------------------------------------

    @cached_property
    def pieces(self) -> dict[str, Piece]:
        """How each plan tensor its backend declares per request divides into per-request pieces
        (plans/pieces.py); for a plan of no adapter, its engine's declared attention metadata."""
        if self.plan is None:
            return {}
        if self.adapter is not None:
            return pieces_of(self.adapter.plan_declaration(self.trace, self.plan))
        metadata = engine_conventions(self.trace).metadata
        return metadata_pieces(metadata) if metadata is not None else {}

    # -- the library's own schedule -------------------------------------------------------------------

    @cached_property
    def schedule(self) -> PlanSchedule | None:
        """The kernel library's work-item schedule the plan recorded (plan.plan_info) with the batch
        it must match (plans/schedule.py); None where none was recorded or the plan's KV cannot be
        read. Raises TraceError where the stored vector places an array outside its workspace."""
        if self.plan is None or self.plan.plan_info is None or self.layout is None or self.kv is None:
            return None
        return read_schedule(self.trace, self.adapter, self.kv, self.scalars["page_size"].value, self.scalars["window"].value)

    # -- every problem ------------------------------------------------------------------------------

    @property
    def problems(self) -> tuple[PlanProblem, ...]:
        """Every structural problem the reading met, in reading order."""
        return (*self.index_problems, *self.offsets_problems, *self.kv_problems, *self.mask_problems)


def read(trace: Trace) -> PlanReading:
    """The reading of `trace`'s recorded plan (each fact computed when first asked for)."""
    return PlanReading(trace)
