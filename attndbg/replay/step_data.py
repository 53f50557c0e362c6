"""What every run of one step shares: its inputs and its references, built once.

A check runs a step many times (each backend, split counts, recorded plan, padded graph replays,
detectors' probes); all of them read the same queries and KV cache and are judged against the same
float64 reference. `StepData` builds each of those once, on the device the kernels use, and hands
out per-device views. Everything is lazy: a metadata-only detector pays for nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attndbg import machine
from attndbg.backends import reference
from attndbg.backends.base import AttentionInputs, AttentionResult
from attndbg.compare.tolerance import Comparison, ReferenceBasis, reference_basis
from attndbg.profiling import phase, step_label
from attndbg.replay.data import build_inputs, to_device
from attndbg.trace.schema import DTYPES, Trace
from attndbg.trace.subbatch import SubBatch


def default_device() -> str:
    """Where a step's data and reference live: the GPU when there is one."""
    return "cuda" if machine.cuda_available() else "cpu"


class StepData:
    def __init__(self, trace: Trace, *, layer: int | None = None, device: str | None = None, max_memory: int | None = None, cuda_graph: bool = False):
        self.trace = trace
        self.layer = layer
        self.device = device or default_device()
        # The memory bound its data is checked against before allocating (data.check_fits).
        self.max_memory, self.cuda_graph = max_memory, cuda_graph
        self.label = step_label(trace)
        self._inputs: dict[str, AttentionInputs] = {}
        self._reference: AttentionResult | None = None
        self._lowp: AttentionResult | None = None
        self._basis: ReferenceBasis | None = None
        # The reference's gather/mask tables, shared by the float64 and the low-precision reference.
        self._tables: list[reference.GroupTables] = []
        # Eager runs of derived plans, by (backend, its options, repeat): the runner's memo, so the
        # variants of a step (graph fills, split counts) do not rerun the same eager launch.
        self.eager_runs: dict[tuple, Any] = {}

    @property
    def inputs(self) -> AttentionInputs:
        """On the step's device."""
        return self.on(self.device)

    def on(self, device: str) -> AttentionInputs:
        """The same inputs on `device` (copied once per device)."""
        kind = torch.device(device).type
        if kind not in self._inputs:
            if not self._inputs:
                with phase("data", self.label):
                    self._inputs[torch.device(self.device).type] = build_inputs(self.trace, layer=self.layer, device=self.device, max_memory=self.max_memory, cuda_graph=self.cuda_graph)
            if kind not in self._inputs:
                self._inputs[kind] = to_device(self.inputs, device)
        return self._inputs[kind]

    @property
    def reference(self) -> AttentionResult:
        """float64, on the CPU (comparisons happen there)."""
        if self._reference is None:
            with phase("reference", self.label):
                if self.trace.merge is not None:  # a merge of given states: no inputs to build
                    self._reference = reference.merge(self.trace.merge)
                else:
                    self._reference = _cpu(reference.attention(self.trace, self.inputs, torch.float64, tables=self._tables))
        return self._reference

    @property
    def lowp(self) -> AttentionResult:
        """The same math in the run's dtype, on the CPU: it sizes the tolerance."""
        if self._lowp is None:
            with phase("reference", self.label):
                dtype = DTYPES[self.trace.model.q_dtype]
                if self.trace.merge is not None:
                    self._lowp = reference.merge(self.trace.merge, dtype)
                else:
                    self._lowp = _cpu(reference.attention(self.trace, self.inputs, dtype, tables=self._tables))
        return self._lowp

    @property
    def basis(self) -> ReferenceBasis:
        """The reference and its tolerances as every comparison of this step reads them."""
        if self._basis is None:
            self._basis = reference_basis(self.trace, self.reference, self.lowp)
        return self._basis

    def compare(self, result: AttentionResult) -> Comparison:
        with phase("compare", self.label):
            return self.basis.compare(result.output, result.lse)

    def output_tolerance(self) -> Tensor:
        """[T, Hq] float64: the absolute output error each row/head may have (tolerance.py's model)."""
        return self.basis.tol

    def sub_batch(self, part: SubBatch) -> StepData:
        """The data of a sub-batch of this step (attndbg.trace.subbatch): its rows of the queries
        and new K/V, this step's KV cache itself (the same keys at the same slots), and its rows of
        the references. The float64 reference is per request, so those rows are the sub-batch's
        own reference, and sharing the low-precision rows gives a request the same tolerance alone
        as in the whole batch."""
        sub = StepData(part.trace, layer=self.layer, device=self.device, max_memory=self.max_memory, cuda_graph=self.cuda_graph)
        full, rows = self.inputs, part.rows.to(self.inputs.q.device)
        k_new = full.k_new[rows]
        # MLA's values are a view of the keys' latent part: keep them one (as data.build_inputs makes them).
        latent = full.v_cache.data_ptr() == full.k_cache.data_ptr()
        v_new = k_new[..., : full.v_new.shape[-1]] if latent else full.v_new[rows]
        sub._inputs[torch.device(self.device).type] = AttentionInputs(q=full.q[rows], k_new=k_new, v_new=v_new, k_cache=full.k_cache, v_cache=full.v_cache)
        sub._reference = AttentionResult(output=self.reference.output[part.rows], lse=self.reference.lse[part.rows])
        sub._lowp = AttentionResult(output=self.lowp.output[part.rows], lse=self.lowp.lse[part.rows])
        return sub

    def partial(self, columns: Tensor) -> AttentionResult:
        """float64 partial states: request b over its KV columns [columns[b,0], columns[b,1]) only."""
        with phase("reference", self.label):
            return _cpu(reference.attention(self.trace, self.inputs, torch.float64, columns=columns))


def _cpu(result: AttentionResult) -> AttentionResult:
    return AttentionResult(output=result.output.cpu(), lse=result.lse.cpu())
