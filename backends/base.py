"""The small contract every kernel-library adapter follows.

An adapter says whether it can run here (library, GPU) and whether it can run a given trace
(feature support), derives its own plan from the batch in its library's vocabulary, and runs
given q, the KV cache and a plan, returning output and a natural-log LSE. It knows nothing of
engines, recordings or reports.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from attndbg.trace.schema import Plan, Trace


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


@dataclass(frozen=True)
class AttentionResult:
    output: Tensor  # [T, Hq, Dv]
    lse: Tensor  # [T, Hq] natural log


class Backend(abc.ABC):
    name: ClassVar[str]

    @abc.abstractmethod
    def unavailable_reason(self) -> str | None:
        """None when this backend can run on this machine, else exactly why not."""

    @abc.abstractmethod
    def describe(self) -> str:
        """What runs, e.g. 'our Triton kernels, triton 3.6 compiled for sm90'."""

    @abc.abstractmethod
    def device(self) -> str:
        """Where its tensors must live ('cpu' or 'cuda')."""

    @abc.abstractmethod
    def unsupported_reason(self, trace: Trace) -> str | None:
        """None when this trace's features are supported, else exactly which one is not."""

    @abc.abstractmethod
    def derive_plan(self, trace: Trace) -> Plan:
        """The plan a correct engine backend builds for this batch, from the batch alone."""

    @abc.abstractmethod
    def run(self, trace: Trace, inputs: AttentionInputs, plan: Plan) -> AttentionResult:
        """Run the real kernels with `plan`; output in q's dtype, LSE natural log."""
