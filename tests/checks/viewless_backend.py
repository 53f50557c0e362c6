"""A test adapter registered through ATTNDBG_BACKENDS: it runs (our Triton kernels) but declares
no plan (neither a plan view nor a plan layout follows), as a new adapter does before its author
writes its declaration."""

from __future__ import annotations

from attndbg.backends.base import Backend
from attndbg.backends.triton import TritonBackend


class ViewlessBackend(TritonBackend):
    name = "viewless"
    plan_declaration = Backend.plan_declaration  # the contract's default: no declaration
