"""A test adapter registered through ATTNDBG_BACKENDS: it runs (our Triton kernels) but declares
neither a plan view nor a plan layout, as a new adapter does before its author writes them."""

from __future__ import annotations

from attndbg.backends.base import Backend
from attndbg.backends.triton import TritonBackend


class ViewlessBackend(TritonBackend):
    name = "viewless"
    plan_view = Backend.plan_view  # the contract's default: no view
    plan_layout = Backend.plan_layout
