"""source.inferred: added within trace version 1, absent from older files (and from recorders'),
typed and bounded on load like every other field."""

from __future__ import annotations

from dataclasses import replace

import pytest

from attndbg.trace.schema import to_dict
from attndbg.trace.validate import MAX_INFERRED, TraceError, from_dict
from tests.factories import make_trace


def test_a_trace_without_it_stores_and_loads_as_before() -> None:
    trace = make_trace("decode-mha", "kv_lens=3,9")
    data = to_dict(trace)
    assert "inferred" not in data["source"]  # byte-identical to files written before it existed
    assert from_dict(data).source.inferred == {}


def test_it_round_trips() -> None:
    trace = make_trace("decode-mha", "kv_lens=3,9")
    trace = replace(trace, source=replace(trace.source, inferred={"model.sm_scale": "1/sqrt(head_dim)"}))
    assert from_dict(to_dict(trace)).source.inferred == {"model.sm_scale": "1/sqrt(head_dim)"}


@pytest.mark.parametrize(
    "value,named",
    [
        (["model.sm_scale"], "source.inferred"),
        ({"model.sm_scale": 3}, "source.inferred['model.sm_scale']"),
        ({"a\nb": "x"}, "source.inferred["),
        ({"k": "x" * 5000}, "source.inferred['k']"),
        ({f"k{i}": "x" for i in range(MAX_INFERRED + 1)}, "source.inferred"),
    ],
)
def test_a_hostile_one_is_refused_naming_the_field(value: object, named: str) -> None:
    data = to_dict(make_trace("decode-mha", "kv_lens=3,9"))
    data["source"]["inferred"] = value
    with pytest.raises(TraceError) as e:
        from_dict(data)
    assert str(e.value).startswith(named)
