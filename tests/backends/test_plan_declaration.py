"""One plan declaration per adapter: each adapter declares its plan in one method,
`plan_declaration`, and the guard's strict view and the detectors' lenient layout are both derived
from it (backends/plan_declaration.py), so the two can no longer drift apart."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.backends import plan_declaration as pd
from attndbg.backends import plan_layout as pl
from attndbg.backends import registry
from attndbg.backends.base import Backend
from attndbg.backends.flashinfer import FlashInferBackend
from attndbg.backends.mla import MLABackend, MLAOptions
from attndbg.backends.plan_view import PlanUnreadable
from tests.backends.toy_backend import ToyBackend
from tests.factories import make_trace


@pytest.mark.parametrize("name", registry.backend_names())
def test_an_adapter_declares_its_plan_once_and_derives_view_and_layout(name: str) -> None:
    cls = registry.adapter_class(name)
    overridden = {method for klass in cls.__mro__ if klass is not Backend and issubclass(klass, Backend) for method in ("plan_view", "plan_layout") if method in vars(klass)}
    assert overridden == set(), f"{name} reads its plan twice: declare it in plan_declaration only"


def test_the_toy_declares_its_whole_plan_in_one_method() -> None:
    assert {"plan_view", "plan_layout"}.isdisjoint(vars(ToyBackend)) and "plan_declaration" in vars(ToyBackend)
    trace = make_trace("decode-paged", "heads=2:1", "head_dim=32")
    toy = ToyBackend()
    plan = toy.derive_plan(trace)
    layout = toy.plan_layout(trace, plan)
    view = toy.plan_view(trace, plan)
    assert (layout.kv, layout.ids, layout.count, layout.length_field, layout.page_size) == (pl.KvIds.TABLE, "block_table", "seq_lens", "seq_lens", None)
    assert view.requests == trace.batch.batch_size and [b.field for b in view.bounds] == ["seq_lens.numel()", "seq_lens", "block_table"]
    assert view.kv.lengths.tolist() == trace.batch.kv_lens.tolist()


def test_an_unknown_setting_is_unreadable_yet_may_keep_a_layout() -> None:
    """FlashInfer's layout of an unknown path is still the paged one (the detectors read it); MLA's
    unknown impl has none. Neither plan can be viewed."""
    trace = make_trace("decode-paged", "heads=2:1", "head_dim=32")
    plan = FlashInferBackend().derive_plan(trace)
    odd = replace(plan, scalars={**plan.scalars, "path": "sideways"})
    with pytest.raises(PlanUnreadable, match="plan scalar path = 'sideways'") as e:
        FlashInferBackend().plan_view(trace, odd)
    assert e.value.field == "scalars.path"
    assert FlashInferBackend().plan_layout(trace, odd).ends == (pl.KvEnd.KV, pl.KvEnd.PREFIX)
    mla = MLABackend(MLAOptions(impl="triton"))
    trace = make_trace("mla-decode", "heads=2", "kv_lens=3,9")
    plan = mla.derive_plan(trace)
    odd = replace(plan, scalars={**plan.scalars, "impl": "auto"})
    assert mla.plan_layout(trace, odd) is None
    with pytest.raises(PlanUnreadable, match="expected one of triton, flashinfer, flashmla, trtllm"):
        mla.plan_view(trace, odd)


def test_no_declaration_gives_neither_view_nor_layout() -> None:
    trace = make_trace("decode-mha", "kv_lens=3,20", "heads=2:1", "head_dim=32")
    assert pd.view(None, trace, trace.plan) is None and pd.layout(None) is None
