"""A backend added as one file (tests/backends/toy_backend.py) and one registry line (the fixture
below) is picked up everywhere: `attndbg backends` lists it and what it declares,
`attndbg replay` runs its kernels and compares them with the float64 reference, and `attndbg
check` reads a plan the toy engine recorded through the toy's own plan view and layout (an
out-of-cache block id is a finding and is never launched) and judges its graph padding by the toy's
fill requirement. Everything goes through the command line, in this process (CliRunner), so spies
on the toy and on our decode kernel see every launch.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attndbg import machine
from attndbg.backends.base import Padding
from attndbg.detectors import registry as detectors
from attndbg.trace import io
from attndbg.trace.schema import Trace
from tests.backends.toy_backend import ENGINE_NAME, ToyBackend
from tests.cli.helpers import invoke, replay_json
from tests.factories import make_trace, write_trace

# Pages of 16 tokens: request 0 and 1 read one block each, request 2 three.
DECODE = ("decode-paged", "heads=2:1", "head_dim=32", "kv_lens=5,16,33", "shared_prefix=0")
HUGE = 10**9


@pytest.fixture(autouse=True)
def toy_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNDBG_BACKENDS", "toy=tests.backends.toy_backend:ToyBackend")  # the one registry line


@pytest.fixture
def kernel_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(kv_indptr, kv_indices) of every launch of our decode kernel, by any backend."""
    machine.select_triton_mode()  # before the kernel module imports triton
    from attndbg.backends.triton_kernels import decode

    launches = []
    launch = decode.decode_attention_fwd

    def spy(**kw) -> None:
        launches.append((kw["kv_indptr"].cpu(), kw["kv_indices"].cpu()))
        launch(**kw)

    monkeypatch.setattr(decode, "decode_attention_fwd", spy)
    return launches


@pytest.fixture
def toy_runs(monkeypatch: pytest.MonkeyPatch) -> list:
    """The plan of every ToyBackend.run."""
    plans = []
    run = ToyBackend.run

    def counting(self, trace, inputs, plan):
        plans.append(plan)
        return run(self, trace, inputs, plan)

    monkeypatch.setattr(ToyBackend, "run", counting)
    return plans


def toy_step(path: Path, *, capture_bs: int | None = None, fill_value: int = 1, block: tuple[int, int] | None = None) -> Trace:
    """A decode step as the toy engine records it: source.backend is the toy's engine name and the
    plan is the toy's (padded to capture_bs with fill_value when recorded at a graph replay), with
    block_table[block] = HUGE when `block` is given."""
    graph = (f"capture_bs={capture_bs}", f"fill_value={fill_value}") if capture_bs else ()
    trace = make_trace(*DECODE, *graph)
    plan = ToyBackend().derive_plan(trace, Padding(capture_bs, fill_value) if capture_bs else None)
    if block is not None:
        table = plan.tensors["block_table"].clone()
        table[block] = HUGE
        plan = replace(plan, tensors={**plan.tensors, "block_table": table})
    trace = replace(trace, plan=plan, source=replace(trace.source, backend=ENGINE_NAME))
    io.save(trace, path)
    return trace


def check(path: Path, *, only: str | None = None) -> tuple[int, dict]:
    """`attndbg check PATH` in this process: exit code and the attndbg.check/1 object. Every
    detector (or `only` these) over every backend that runs here, the registered toy among them;
    no --backend: naming toy would be exit 3 on a step where no detector runs its kernels, which
    is what check must say then (test_check_says_the_toy_was_compared_only_when_its_kernels_ran)."""
    report = path.with_suffix(".check.json")
    select = ("--only", only) if only else ()
    result = invoke("check", str(path), *select, "--in-process", "--jobs", "1", "--json", str(report))
    assert result.exit_code in (0, 1), result.output
    data = json.loads(report.read_text())
    assert [step["checked"] for step in data["steps"]] == [True], data["steps"]
    return result.exit_code, data


def findings(data: dict) -> list[tuple[str, str, dict]]:
    return [(f["class"], f["check"], f["location"]) for step in data["steps"] for f in step["findings"]]


def replay(path: Path, *extra: str) -> tuple[int, dict]:
    """`attndbg replay PATH --backend toy`: exit code and the one step's object."""
    report = path.with_suffix(".replay.json")
    result = invoke("replay", str(path), "--backend", "toy", "--json", str(report), *extra)
    return result.exit_code, replay_json(report)["steps"][0]


def table_row(output: str, column: str, name: str) -> dict[str, str]:
    """The row of `name` in the table with a column `column`, cells by column name."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┃") and f" {column} " in line)
    columns = [cell.strip() for cell in lines[start].strip("┃").split("┃")]
    row = next(line for line in lines[start:] if line.startswith(f"│ {name} "))
    return dict(zip(columns, (cell.strip() for cell in row.strip("│").split("│"))))


# -- backends -----------------------------------------------------------------------------------


def test_backends_lists_the_toy_and_what_it_declares() -> None:
    result = invoke("backends", "--capabilities", columns=400)
    assert result.exit_code == 0, result.output
    status = table_row(result.output, "available", "toy")
    assert status == {"backend": "toy", "available": "yes", "what runs / why not": ToyBackend().describe()}
    if machine.kernel_device() == "cpu":
        assert status["what runs / why not"].endswith("interpreted on the CPU (no CUDA GPU)")
    declared = table_row(result.output, "attention: modes", "toy")
    assert (declared["attention: modes"], declared["CUDA graph"], declared["masks"], declared["window"]) == ("mha: decode", "-", "none", "no")
    assert declared["padded seq_len"] == ">= 1"


# -- replay -------------------------------------------------------------------------------------


def test_replay_runs_our_kernels_through_the_toy_plan_and_passes_the_reference(tmp_path: Path, kernel_launches) -> None:
    path = write_trace(tmp_path / "decode.pt", *DECODE)
    code, step = replay(path)
    assert code == 0, step
    assert step["compared"] == ["toy"] and step["skipped"] == [] and step["verdict"] == "passed"
    [run] = step["backends"]
    assert (run["backend"], run["variant"], run["status"]) == ("toy", "eager", "passed")
    assert (run["failing_rows"], run["total_rows"], run["nonfinite"]) == (0, 3, 0)
    # The toy's block table reached the kernel as the step's own slots: one launch, every slot of every request.
    batch = io.load(path).batch
    [(kv_indptr, kv_indices)] = kernel_launches
    assert torch.equal(kv_indptr.long(), batch.slot_indptr) and torch.equal(kv_indices, batch.slot_ids)


@pytest.mark.parametrize(
    "spec,says",
    [
        (("extend-noprefix", "heads=2:1", "head_dim=32", "extend_lens=3,4"), "decode only (a test adapter: decode is all it launches)"),
        (("window-decode", "heads=2:1", "head_dim=32", "kv_lens=10,40"), "the toy's Triton decode kernels have no sliding window"),
    ],
    ids=["extend", "window"],
)
def test_replay_says_exactly_why_the_toy_cannot_run_a_step(tmp_path: Path, toy_runs, spec: tuple[str, ...], says: str) -> None:
    path = write_trace(tmp_path / "step.pt", *spec)
    reason = ToyBackend().unsupported_reason(io.load(path))
    assert says in reason
    code, step = replay(path)
    assert code == 3  # the backend named with --backend compared nothing
    assert step["compared"] == [] and step["skipped"] == [{"backend": "toy", "variant": "eager", "status": "unsupported", "reason": reason}]
    assert toy_runs == []


# -- check: the recorded plan, through the toy's plan view and layout ----------------------------


def test_check_reads_a_clean_toy_plan(tmp_path: Path) -> None:
    path = tmp_path / "toy.pt"
    toy_step(path)
    code, data = check(path)
    assert code == 0 and findings(data) == []
    assert data["verdict"]["plans_unread"] == {}  # the plan detectors read the toy's plan
    # A garbage block id in a column no request reads (request 0 reads one block) is not read: clean.
    toy_step(path, block=(0, 2))
    code, data = check(path, only="invariants")
    assert code == 0 and findings(data) == []


def test_check_says_the_toy_was_compared_only_when_its_kernels_ran(tmp_path: Path, toy_runs) -> None:
    path = tmp_path / "toy.pt"
    toy_step(path)
    _, data = check(path)
    assert ("toy" in data["verdict"]["compared"]) == bool(toy_runs), (data["verdict"]["line"], len(toy_runs))


def test_an_out_of_cache_block_id_is_a_finding_and_is_never_launched(tmp_path: Path, kernel_launches, toy_runs) -> None:
    path = tmp_path / "toy.pt"
    trace = toy_step(path, block=(1, 0))
    slots = trace.batch.kv_cache_size
    pages = slots // 16
    code, data = check(path)
    assert code == 1
    assert findings(data) == [("invariants", "index-outside-cache", {"step": 0, "request": 1, "column": 0, "field": "plan.block_table[1, 0]"})]
    assert data["steps"][0]["findings"][0]["data"] == {"found": HUGE, "limit": pages}
    # Whatever check launched read inside the cache: never the recorded plan.
    assert all(int(kv_indices.max()) < slots for _, kv_indices in kernel_launches)
    assert all(int(plan.tensors["block_table"].max()) < pages for plan in toy_runs)

    toy_runs.clear()
    code, step = replay(path, "--plan", "recorded")
    assert code == 1 and step["compared"] == ["toy recorded plan"]
    [run] = step["backends"]
    assert (run["variant"], run["status"]) == ("recorded plan", "error")
    assert run["reason"] == f"recorded plan block_table[1, 0] = {HUGE} is outside [0, {pages}): pages of the KV cache ({slots} slots / page 16) (not launched)"
    assert toy_runs == []
    toy_step(path)  # the same step's clean recorded plan is launched, and passes
    code, step = replay(path, "--plan", "recorded")
    assert code == 0 and [run["status"] for run in step["backends"]] == ["passed"]
    assert len(toy_runs) == 1


def test_an_injection_plants_an_out_of_cache_id_in_the_toy_block_table(tmp_path: Path) -> None:
    clean = toy_step(tmp_path / "clean.pt")
    path = io.save(detectors.inject(clean, "invariants:index-outside-cache"), tmp_path / "toy.pt")
    table, before = io.load(path).plan.tensors["block_table"], clean.plan.tensors["block_table"]
    [(b, j)] = torch.nonzero(table != before).tolist()
    code, data = check(path, only="invariants")
    assert code == 1
    assert findings(data) == [("invariants", "index-outside-cache", {"step": 0, "request": b, "column": j * 16, "field": f"plan.block_table[{b}, {j}]"})]


def test_an_injection_plants_a_wrong_request_row_in_the_toy_block_table(tmp_path: Path) -> None:
    clean = toy_step(tmp_path / "clean.pt")
    path = io.save(detectors.inject(clean, "invariants:wrong-req-row"), tmp_path / "toy.pt")
    changed = torch.nonzero(io.load(path).plan.tensors["block_table"] != clean.plan.tensors["block_table"]).tolist()
    code, data = check(path, only="invariants")
    assert code == 1
    [(kind, _, where)] = findings(data)
    assert kind == "invariants" and where["request"] == changed[0][0] and where["field"].startswith("plan.block_table[")


# -- check: graph padding, by the toy's fill requirement -----------------------------------------


@pytest.mark.parametrize("fill_value", [0, 1])
def test_padded_seq_lens_are_judged_by_the_toy_fill_requirement(tmp_path: Path, fill_value: int) -> None:
    path = tmp_path / "toy.pt"
    toy_step(path, capture_bs=4, fill_value=fill_value)
    code, data = check(path)
    assert data["verdict"]["plans_unread"] == {}  # the plan padded to capture_bs is read too
    if fill_value >= ToyBackend.fill_requirement.min_seq_len:
        assert code == 0 and findings(data) == []
        return
    assert code == 0  # a hazard: the real rows do not read the padded ones (check --strict fails on it)
    assert findings(data) == [("fill-value", "padded-seq-len-unsupported", {"step": 0, "request": 3, "field": "graph.padded_seq_lens[3]"})]
    [finding] = data["steps"][0]["findings"]
    assert finding["severity"] == "hazard" and data["verdict"]["hazards_by_check"] == {"fill-value/padded-seq-len-unsupported": 1}
    assert f"the step ran on {ENGINE_NAME}, which needs >= 1" in finding["evidence"] and f"{ToyBackend.name} >= 1" in finding["evidence"]  # the summary names attndbg's adapters
    assert finding["cause"] == (
        f"The graph runner padded with a fill value {ENGINE_NAME} cannot take: {ToyBackend.fill_requirement.why}."
        " The real rows do not read the padded ones; this hurts where a later op mixes padded rows into real ones"
        " (a per-batch reduction), or where the kernel faults on it, which this detector's padded replay at the"
        " recorded fill shows wherever the backend runs."
    )
    assert (finding["data"]["backend"], finding["data"]["min_seq_len"], finding["data"]["fill_value"]) == (ENGINE_NAME, 1, 0)
