"""Inputs the fuzzer found breaking the bad-input contract: each is now one `error:` line
naming the field, exit 2, with no traceback and without allocating what the file claims."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from tests.factories import stored, write_raw


def _set(data: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    target = data
    for key in parents:
        target = target[key]
    target[last] = value
    return data


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("batch", None, "batch: is None, expected a dict"),
        ("seed", 2**64, "seed: = 18446744073709551616, does not fit in 64 bits"),
        ("model.sm_scale", 10**400, "model.sm_scale: expected a finite number"),
        ("model.sm_scale", [[[[[[[[1.0]]]]]]]], "model.sm_scale: expected a finite number"),
        ("source.backend", "x" * 10_000_000, "source.backend: = 'xxxx"),
        ("batch.slot_ids", torch.zeros(1, dtype=torch.int64).expand(2**31), "claims 2147483648 elements"),
        ("batch.kv_lens", torch.zeros(3, dtype=torch.int64, device="meta"), "expected plain CPU data"),
    ],
)
def test_hostile_values_are_one_line(tmp_path: Path, field: str, value, expected: str) -> None:
    path = write_raw(tmp_path / "t.pt", _set(stored("decode-gqa"), field, value))
    for command in ("show", "check"):
        result = CliRunner().invoke(main, [command, str(path)])
        assert result.exit_code == 2, result.output
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], result.output


def test_plan_scalars_no_engine_could_record_are_refused(tmp_path: Path) -> None:
    data = stored("decode-gqa")
    data["plan"] = {"backend": "triton", "tensors": {}, "scalars": {"max_kv_splits": float("inf")}}
    result = CliRunner().invoke(main, ["show", str(write_raw(tmp_path / "t.pt", data))])
    assert result.exit_code == 2 and "plan.scalars.max_kv_splits: = inf" in result.output


def test_a_fifo_and_dev_zero_are_refused_without_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.pt"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.pt"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        for command in (["show", str(path)], ["check", str(path)], ["diff", str(path), str(path)]):
            result = CliRunner().invoke(main, command)
            assert result.exit_code == 2 and "not a regular file" in result.output, (command, result.output)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (json.dumps({"file": None, "step": 0, "mode": "DECODE", "batch_size": 1, "graph": False, "layers": []}).encode(), "line 2.file: = None, expected str"),
        (json.dumps({"file": "a\nerror: forged", "step": 0, "mode": "DECODE", "batch_size": 1, "graph": False, "layers": []}).encode(), "must name a file"),
        (b"\xff\xfe{}", "line 2: not UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "line 2: not a manifest entry"),
    ],
)
def test_bad_manifest_lines_are_one_line(tmp_path: Path, line: bytes, expected: str) -> None:
    rec = tmp_path / "rec"
    rec.mkdir()
    write_raw(rec / "s0.pt", stored("decode-gqa"))
    good = json.dumps({"file": "s0.pt", "step": 0, "mode": "DECODE", "batch_size": 4, "graph": False, "layers": []}).encode()
    (rec / "manifest.jsonl").write_bytes(good + b"\n" + line + b"\n")
    result = CliRunner().invoke(main, ["check", str(rec), "--only", "invariants"])
    assert result.exit_code == 2, result.output
    errors = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], result.output


def test_a_plan_field_of_the_wrong_rank_is_a_finding(tmp_path: Path) -> None:
    from attndbg.trace import io
    from tests.factories import make_trace

    trace = make_trace("verify", "prefix_lens=4,7", "heads=2:1", "head_dim=32", plan=True)
    plan = trace.plan
    bad = replace(trace, plan=replace(plan, tensors={**plan.tensors, "kv_indices": plan.tensors["kv_indices"].reshape(1, -1)}))
    path = io.save(bad, tmp_path / "t.pt")
    report = tmp_path / "r.json"
    result = CliRunner().invoke(main, ["check", str(path), "--only", "invariants,tree-mask", "--backend", "reference", "--json", str(report)])
    assert result.exit_code == 1, result.output
    checks = [f["check"] for s in json.loads(report.read_text())["steps"] for f in s["findings"]]
    assert "plan-shape" in checks and "detector failed" not in result.output
