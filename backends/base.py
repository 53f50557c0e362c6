"""The small contract every kernel-library adapter follows.

An adapter says whether it can run here (library, GPU) and whether it can run a given trace
(feature support), derives its own plan from the batch in its library's vocabulary, and runs
given q, the KV cache and a plan, returning output and a natural-log LSE. It knows nothing of
engines, recordings or reports.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from attndbg.backends import plan_declaration, script_calls
from attndbg.backends.capabilities import Capabilities
from attndbg.backends.flashinfer_plan_info import Schedule
from attndbg.backends.host_hints import HostHint
from attndbg.backends.plan_declaration import PlanDeclaration
from attndbg.backends.plan_layout import PlanLayout
from attndbg.backends.plan_view import PlanView
from attndbg.trace.schema import Plan, Trace

if TYPE_CHECKING:
    from attndbg.backends.flashinfer_modules import Target


def coerce_option(options: Any, field: str, kind: type[enum.Enum]) -> None:
    """In a frozen options dataclass's __post_init__: accept the enum or its string value."""
    value = getattr(options, field)
    try:
        object.__setattr__(options, field, kind(value))
    except ValueError:
        choices = ", ".join(str(member.value) for member in kind)
        raise ValueError(f"{field}={value!r}: expected one of {choices}") from None


@dataclass(frozen=True)
class AttentionInputs:
    """One layer's data for one step, on the backend's device.

    The cache already holds this step's new K/V at `out_cache_loc` (engines write K/V before
    attending); k_new/v_new are the same rows again, for kernels that take them separately.
    """

    q: Tensor  # [T, Hq, Dk]
    k_new: Tensor  # [T, Hkv, Dk]
    v_new: Tensor  # [T, Hkv, Dv] (MLA: a view of k_new[..., :kv_lora_rank])
    k_cache: Tensor  # [N, Hkv, Dk]
    v_cache: Tensor  # [N, Hkv, Dv] (MLA: a view of k_cache[..., :kv_lora_rank])


class KernelError(RuntimeError):
    """The kernel library raised while planning or running; the message is its first line."""


class KernelUnsupported(KernelError):
    """The library cannot build or run this configuration (a JIT compile that fails for a head_dim,
    a plan for another implementation): reported as unsupported with this reason, not as an error."""


@dataclass(frozen=True)
class AttentionResult:
    output: Tensor  # [T, Hq, Dv]
    lse: Tensor  # [T, Hq] natural log


@dataclass(frozen=True)
class PartialStates:
    """Partial attention states given to a backend's merge on their own: a detector's probe of the
    merge with crafted states (split-merge's empty-split cases), launched by the runner's `merge`.

    Each row has up to `parts` states, each a normalised output with its LSE, in the backend's own
    LSE base (`capabilities().lse_base`; nothing is converted: a probe judges the kernel in its own
    convention). With `kv_lens` and `num_splits` the kernel tells a row's empty splits by the split
    rule, as our stage 2 does (row b: `num_splits[b]` splits of `kv_lens[b]` tokens); without them
    every state is merged by its LSE alone (FlashInfer's merge_state)."""

    output: Tensor  # [rows, Hq, parts, Dv]
    lse: Tensor  # [rows, Hq, parts] float32
    kv_lens: Tensor | None = None  # [rows] int64
    num_splits: Tensor | None = None  # [rows] int64, each in [1, parts]
    # [rows] bool: merge only these rows (two states, merge_state_in_place's mask); the others keep
    # state 0 as given.
    rows: Tensor | None = None

    def to(self, device: str) -> PartialStates:
        def moved(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return PartialStates(self.output.to(device), self.lse.to(device), moved(self.kv_lens), moved(self.num_splits), moved(self.rows))


@dataclass(frozen=True)
class Padding:
    """How a CUDA-graph batch is padded, the way engines pad (SGLang's CudaGraphRunner).

    Requests [bs, capture_bs) are padding: each has the step's tokens per request (1 for decode,
    draft_token_num for verify) and `fill_value` KV columns, all at `dummy_slot`; their new K/V go
    to `dummy_slot` too (SGLang zeroes out_cache_loc: "padded slot 0 is used for writing dummy
    outputs from padded tokens").
    """

    capture_bs: int
    fill_value: int
    dummy_slot: int = 0


@dataclass(frozen=True)
class FillRequirement:
    """What a backend's kernels need of the requests a CUDA graph pads (fill-value judges recorded
    padding by it)."""

    min_seq_len: int  # the smallest padded seq_len its kernels take
    why: str  # the reason, with its source
    # Where its verify plan reads padded positions: why stale ones there hurt (None: they do not).
    stale_positions: str | None = None
    # Below min_seq_len the kernel reads outside its tensors (an illegal memory access: a defect of
    # the step), not only writes NaN into the padded rows' own output (a hazard).
    out_of_bounds: bool = False


@dataclass(frozen=True)
class LibraryRelease:
    """The kernel library an adapter's runs call, and its installed release, as a defect report
    names them ("FlashInfer 0.7.2.post1")."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}"


@dataclass(frozen=True)
class GraphCapacity:
    """Sizes the static buffers of a captured graph must hold, for every batch replayed into it."""

    capture_bs: int
    max_tokens: int  # query tokens, padding included
    max_kv_slots: int  # sum of KV lengths (the length of kv_indices), padding included
    max_kv_len: int  # the longest request's KV
    max_mask: int  # elements of a custom mask (0 when none)


@dataclass(frozen=True)
class ScriptLibrary:
    """What a standalone reproduction script (`attndbg repro`) needs to make this adapter's library
    calls with torch and the library alone, never attndbg: stated by the adapter, written out by
    repro/, which knows no backend by name."""

    label: str  # the library as the script names it: "flashinfer (backend='fa3', SM90)"
    imports: str  # Python lines importing it (a missing module makes the script exit 2, naming `install`)
    install: str  # what to install when an import fails: "pip install flashinfer-python"
    needs_gpu: bool  # its calls run only on a CUDA GPU (the script exits 2 without one)
    version: str  # a Python expression of its version, printed by the script
    setup: str = ""  # lines before `imports` (Triton's interpreter chosen when there is no GPU)
    prelude: str = ""  # module-level code the calls need after the imports (kernels' source, a choice made where the script runs)
    tensors_on_device: bool = False  # every tensor the calls take goes to the device (Triton's kernels take no host tensors)


@dataclass(frozen=True)
class ScriptMerge:
    """Torch code a script runs after the library calls to make the step's output, as the adapter
    makes it after them (fa3's two-call verify merges two runs' states)."""

    lines: tuple[str, ...]  # statements, reading the runs' results and `T[...]` (tensors below)
    output: str  # the expression of the step's output once they ran
    tensors: dict[str, Tensor]  # what the lines load from the script's data, by name


class GraphState(abc.ABC):
    """One backend's static buffers for one captured graph.

    The runner calls, in order: `load_plan` for a decoy batch, `forward` under warm-up and under
    `torch.cuda.graph` capture, then for each replayed batch `load_plan` (outside the graph; it
    must write into the same buffers in place: a graph keeps the pointers it saw at capture)
    followed by `graph.replay()`. `forward` reads only static buffers and returns static outputs.
    """

    @abc.abstractmethod
    def load_plan(self, plan: Plan) -> None:
        """Outside the graph: copy a (padded) plan into the static buffers, or re-plan a wrapper on them."""

    @abc.abstractmethod
    def forward(self, inputs: AttentionInputs) -> AttentionResult:
        """Inside the graph: launch the kernels on static buffers; output [capture tokens, Hq, Dv], LSE natural log."""

    def poison_scratch(self) -> None:
        """Fill workspace/scratch with garbage before a replay: a correct kernel never reads it unwritten."""

    def plan_pointers(self) -> dict[str, int]:
        """data_ptr of every static plan buffer, so the runner can check they never move.

        States keep those buffers in `self.buffers` (name -> tensor); a state without one has none."""
        buffers: dict[str, Tensor] = getattr(self, "buffers", {})
        return {name: buffer.data_ptr() for name, buffer in buffers.items()}


class Backend(abc.ABC):
    name: ClassVar[str]
    # The seq_len an engine gives padded requests for this backend (SGLang: 1 for every GPU backend).
    cuda_graph_fill_value: ClassVar[int] = 1
    # What its kernels need of padded requests (None: it declares nothing; fill-value then judges
    # by cuda_graph_fill_value).
    fill_requirement: ClassVar[FillRequirement | None] = None
    # The engine backends whose kernels this adapter reproduces, by the name a trace's
    # `source.backend` carries (SGLang's attention backend names, vLLM's
    # AttentionBackend.get_name()), each with its own requirement where it differs from
    # `fill_requirement` (None: the adapter's). Names no adapter answers to: engine_names.py.
    engine_names: ClassVar[Mapping[str, FillRequirement | None]] = {}
    # Engine backends among `engine_names` whose kernels this adapter reads the plans of but never
    # runs (they need hardware it is not built for), each with why: their steps are judged by the
    # invariants and the reference, never replayed as another library's kernel, and the verdict says so.
    kernels_elsewhere: ClassVar[Mapping[str, str]] = {}
    # The host-side hints (max_seq_len, max_query_len, ...) the kernels of each engine backend it
    # answers to read beside their tensors, by that name (backends/host_hints.py).
    host_hints: ClassVar[Mapping[str, tuple[HostHint, ...]]] = {}
    # Its options: a frozen dataclass the constructor takes as its one argument (None: it takes
    # none). `--backend-option NAME.FIELD=VALUE` sets its fields, parsed from their types
    # (backends/options.py), so what a user may choose is declared here and nowhere else.
    options_class: ClassVar[type | None] = None
    # Whether a step at the shape of a known library defect (`known_defect`) is run. A check's
    # adapters run it (CheckContext.adapter): a crash stays in its worker, and the kernels detector
    # confirms or contradicts the prediction by the run; repro scripts it (a script is how a defect
    # is shown). Elsewhere (replay, which has no crash boundary; the compile phase) it is refused
    # with the defect as the reason.
    run_known_defects: bool = False

    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this backend can run on this machine, else exactly why not."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What runs, e.g. 'our Triton kernels, triton 3.6 compiled for sm90'."""

    @abc.abstractmethod
    def device(self) -> str:
        """Where its tensors must live ('cpu' or 'cuda')."""

    def first_use_note(self) -> str | None:
        """What a new kernel shape costs on first use, when the library compiles it then (None: nothing)."""
        return None

    def library(self) -> LibraryRelease:
        """The kernel library its runs call on this machine, with the installed release."""
        return LibraryRelease(f"the {self.name} adapter's kernels", "version unknown")

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What its kernels can run, as data (for its options and this machine's implementation)."""

    def configuration_reason(self, trace: Trace) -> str | None:
        """What the capabilities cannot say: an option that picks a path this step cannot take.
        None: nothing."""
        return None

    def known_defect(self, trace: Trace) -> str | None:
        """A defect measured in the installed library release at this step's shape, which the
        capabilities otherwise claim (None: none known): why a run would crash or be wrong, with
        its standalone reproduction. A prediction, not a gap: see `run_known_defects`."""
        return None

    def unsupported_reason(self, trace: Trace) -> str | None:
        """None when this trace's features are supported, else exactly which one is not: the first
        gap in the declared capabilities, then the adapter's configuration_reason, then (unless
        `run_known_defects`) a known library defect at this shape."""
        reason = self.capabilities().gap(trace) or self.configuration_reason(trace)
        if reason is None and not self.run_known_defects:
            reason = self.known_defect(trace)
        return reason

    @abc.abstractmethod
    def derive_plan(self, trace: Trace, padding: Padding | None = None) -> Plan:
        """The plan a correct engine backend builds for this batch, from the batch alone.

        With `padding`, the plan covers `padding.capture_bs` requests: the real ones first, then
        padded ones as `Padding` describes, in this backend's own conventions.
        """

    @abc.abstractmethod
    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        """Run the real kernels with `plan`; output in q's dtype, LSE natural log."""

    def plan_declaration(self, trace: Trace, plan: Plan) -> PlanDeclaration | None:
        """`plan` (in this backend's layout, possibly recorded by an engine) declared once, as data
        (backends/plan_declaration.py): which tensors are offsets, ids, lengths, tables and masks,
        what each indexes, the scalars the launch reads, the kernel's quirks. Read leniently: from
        the plan's scalars and which tensors it holds, never their values, so it exists for any plan.

        None: this backend declares no plan, so a recorded plan for it cannot be guarded (never
        launched) and the plan detectors cannot read it."""
        return None

    def plan_schedule(self, plan: Plan, requests: int) -> Schedule | None:
        """The library's own work-item schedule of a recorded plan (`plan.plan_info`: the vector its
        plan() returned and the host int workspace it indexes), read for a wrapper of `requests`
        requests. None where this backend keeps no such schedule or the plan recorded none. Raises
        PlanInfoError where the stored vector places an array outside the stored workspace."""
        return None

    def plan_view(self, trace: Trace, plan: Plan) -> PlanView | None:
        """The declaration read strictly, for the replay guard: every index tensor the kernels read
        with its bound, in checking order. Raises PlanUnreadable when the plan lacks a declared field
        or holds one that cannot be read (the plan is not read, not launched, not a finding),
        PlanViewError when a field holds a value no kernel could take. None: no declaration."""
        return plan_declaration.view(self.plan_declaration(trace, plan), trace, plan)

    def plan_layout(self, trace: Trace, plan: Plan) -> PlanLayout | None:
        """The declaration read leniently, for the detectors: each request's KV ids and length, the
        columns they cover, the encoding of a verify step's visibility; a plan missing a field
        still has one. None: no declaration (or one whose form is unknown)."""
        return plan_declaration.layout(self.plan_declaration(trace, plan))

    def jit_specs(self, trace: Trace, at: Target) -> list[Any]:
        """The FlashInfer JIT specs (`flashinfer.jit.JitSpec`) running `trace`'s step with this
        adapter's options would load on the machine `at` (backends/flashinfer_modules.py), named
        without running it: check's compile phase builds them all at once before the first step.
        Empty for a backend that compiles nothing on first use, or cannot take the step."""
        return []

    def merge_states(self, states: PartialStates) -> AttentionResult:
        """The library's merge of `states` (on this backend's device) alone: per row, the merged
        output [rows, Hq, Dv] and LSE [rows, Hq] in the backend's LSE base. Errors propagate as the
        library raised them. Only the runner calls it (replay/runner.py's `merge`)."""
        raise KernelUnsupported(f"{self.name} has no merge of partial states of its own")

    @classmethod
    def merge_path(cls, trace: Trace) -> str | None:
        """Beyond split-KV decode (every engine backend that splits long rows): the merge of partial
        attention states the engine backends this adapter reproduces run for `trace`'s step, named
        for a reader; None when the step's path merges nothing."""
        return None

    def graph_unsupported_reason(self, trace: Trace) -> str | None:
        """None when this trace's step can be replayed under a CUDA graph by this backend: derived
        from the capabilities' graph_modes, then graph_configuration_reason."""
        capabilities = self.capabilities()
        if not capabilities.graph_modes:
            return f"{self.name} has no CUDA-graph support yet"
        return self.unsupported_reason(trace) or capabilities.graph_gap(trace) or self.graph_configuration_reason(trace)

    def graph_configuration_reason(self, trace: Trace) -> str | None:
        """Beyond the capabilities: why this step is not captured by this backend (None: it is)."""
        return None

    def graph_state(self, trace: Trace, capacity: GraphCapacity) -> GraphState:
        """Allocate static buffers for graphs of `trace`'s model and mode at `capacity`."""
        raise NotImplementedError(self.graph_unsupported_reason(trace))

    # -- standalone scripts (attndbg repro) -----------------------------------------------------

    def script_library(self) -> ScriptLibrary | None:
        """What a script making this adapter's library calls needs (None: it writes no scripts)."""
        return None

    def library_calls(self, library: Any) -> contextlib.AbstractContextManager[None]:
        """While open, this adapter's calls into its kernel library go to `library`, a recorder
        standing in for the library's top module (None: none are made), and it decides as it would
        where the script runs (its implementation, its kernel family): `attndbg repro` runs the
        adapter's own `run` and graph state under it, on the host, and writes the calls it records.
        Adapters look their library up through backends/script_calls.py, so the default serves all."""
        if self.script_library() is None:
            raise NotImplementedError(f"{self.name} writes no repro scripts: it states no library calls (script_library)")
        return script_calls.recording_into(library)

    def script_merge(self, plan: Plan, runs: list[str]) -> ScriptMerge | None:
        """The torch code that makes the step's output from the library runs' results (`runs`: the
        script's expression of each run call's result, in order), when the adapter makes it after
        the calls rather than a library call writing it (None: a call writes it)."""
        return None
