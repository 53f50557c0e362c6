"""`--timeline` on a real GPU: attndbg's ranges enclose the kernels they launched.

Each command runs in its own process (CUPTI is per process) over every shipped trace with
`--backend all`, eager and under `--cuda-graph`, and the file it writes is read by
tests/timeline/enclosure.py: every kernel launched inside exactly one attndbg range naming step file,
step, backend, variant and phase; CUPTI's NVTX records agreeing; each graph replay one cudaGraphLaunch
running the captured node set. A check over worker processes writes one file with a pid per
worker (written gzip-compressed: its name ends in .gz). Under `attndbg record`, a live transformers engine with CUDA graphs: one range per recorded
step naming step, mode, batch size, graph batch size and capture/replay/eager, holding that step's
kernels (tests/timeline/engine_enclosure.py). Set ATTNDBG_TIMELINE_OUT=DIR to keep the files and the
counts (bench/timeline_check.sh).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attndbg.timeline import chrome
from attndbg.trace.io import read_manifest
from tests.gpu.engines import continuous_batching_missing
from tests.timeline import engine_enclosure, enclosure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("cupti") is None, reason="needs cupti-python (pip install 'attndbg[timeline]')"),
]

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "traces"
ENGINE_SCRIPT = ROOT / "attndbg" / "examples" / "transformers_generate.py"


def _read_as_memory(doc: dict) -> None:
    """Every process read CUPTI's buffers as memory (timeline/buffers.py), none through cupti-python's
    record objects: the collector says so in the notes when it falls back."""
    slow = [n for n in doc["otherData"]["attndbg"]["notes"] if "read through cupti-python's objects" in n or "records were lost" in n]
    assert slow == [], slow


def _keep(timeline: Path, name: str, header: str, report_line: str, problems: list[str], stderr: str) -> None:
    keep = os.environ.get("ATTNDBG_TIMELINE_OUT")
    if not keep:
        return
    Path(keep).mkdir(parents=True, exist_ok=True)
    # What comes back from the device is at most 16 MiB a file: a large timeline travels gzipped (Perfetto opens .json.gz).
    if timeline.name.endswith(".gz"):
        shutil.copy(timeline, Path(keep) / f"{name}.json.gz")
    elif timeline.stat().st_size > 4 << 20:
        with open(timeline, "rb") as src, gzip.open(Path(keep) / f"{name}.json.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    else:
        shutil.copy(timeline, Path(keep) / f"{name}.json")
    summary = stderr[stderr.index("timeline: "):]
    with open(Path(keep) / "timeline_check.txt", "a") as f:
        f.write(f"== {name}: {header}\n{report_line}\n" + "".join(f"PROBLEM {p}\n" for p in problems) + summary + "\n")


def _run(args: list[str], timeline: Path, name: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "attndbg", *args, "--timeline", str(timeline)], capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1, 3), f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "timeline: " in proc.stderr, proc.stderr[-3000:]
    raw = timeline.read_bytes()
    if timeline.name.endswith(".gz"):
        assert raw[:2] == b"\x1f\x8b", "a .gz timeline is gzip-compressed"
        raw = gzip.decompress(raw)
    doc = json.loads(raw)
    _read_as_memory(doc)
    report = enclosure.check(doc)
    kernels = chrome.kernel_events(doc)
    if kernels:  # the size a kernel costs (chrome.py, SIZE): the file, and the kernel events alone
        events = sum(len(json.dumps({k: v for k, v in e.items() if k != "kernel"}, separators=(",", ":"), ensure_ascii=False)) + 1 for e in kernels)
        print(f"{name}: {len(raw) / len(kernels):.0f} bytes per kernel in the file, {events / len(kernels):.0f} in kernel events; {len(kernels)} kernels")
    _keep(timeline, name, f"attndbg {' '.join(args)}", report.line(), report.problems, proc.stderr)
    print(name, report.line())
    return {"doc": doc, "report": report}


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_replay_ranges_enclose_their_kernels(tmp_path: Path, graph: bool) -> None:
    name = "replay_traces_all" + ("_graph" if graph else "_eager")
    args = ["replay", str(TRACES), "--backend", "all"] + (["--cuda-graph"] if graph else [])
    result = _run(args, tmp_path / "t.json", name)
    report = result["report"]
    assert report.problems == [], "\n".join(report.problems[:40])
    assert report.kernels > 0 and report.kernels_by_phase["run"] > 0
    # Every shipped file replayed, its ranges named for it: step numbers alone repeat (most shipped
    # traces are step 0), so the ranges carry the file's name (trace=, from its `step` range).
    files = {n.trace for n in chrome.range_names(result["doc"]).values()}
    assert files >= {p.name for p in TRACES.glob("*.pt")}, files
    if graph:
        assert report.graph_replays > 0 and report.kernels_by_phase["replay"] > 0
    else:
        assert report.graph_replays == 0


def test_check_workers_merge_into_one_file(tmp_path: Path) -> None:
    result = _run(["check", str(TRACES), "--jobs", "2"], tmp_path / "t.json.gz", "check_traces_jobs2")
    report = result["report"]
    assert report.problems == [], "\n".join(report.problems[:40])
    names = [e["args"]["name"] for e in result["doc"]["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    workers = [n for n in names if n.startswith("attndbg check worker")]
    assert len(workers) >= 2, names  # a pid per worker
    assert report.kernels > 0
    files = {n.trace for n in chrome.range_names(result["doc"]).values()}
    assert files >= {p.name for p in TRACES.glob("*.pt")}, files  # every shipped file checked, in one worker or the other


@pytest.mark.skipif(continuous_batching_missing() is not None, reason=str(continuous_batching_missing()))
def test_record_ranges_on_a_live_engine_with_cuda_graphs(tmp_path: Path) -> None:
    """`attndbg record --timeline` around transformers' continuous batching with CUDA graphs (its
    warm-up forward, captures, replays): one range per recorded step, labelled as the recorded file
    says, holding that step's kernels; a replay one cudaGraphLaunch running its graph's nodes."""
    rec, timeline = tmp_path / "rec", tmp_path / "t.json"
    args = ["record", "-o", str(rec), "--timeline", str(timeline), "--", sys.executable, str(ENGINE_SCRIPT), "--device", "cuda", "--cuda-graph", "--dtype", "bfloat16", "--new-tokens", "8"]
    proc = subprocess.run([sys.executable, "-m", "attndbg", *args], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    entries = read_manifest(rec)
    doc = json.loads(timeline.read_text())
    _read_as_memory(doc)
    report = engine_enclosure.check(doc, entries)
    _keep(timeline, "record_transformers_cuda_graph", "attndbg record -o REC --timeline T -- " + " ".join([ENGINE_SCRIPT.name, *args[8:]]), report.line(), report.problems, proc.stderr)
    print("record_transformers_cuda_graph", report.line())
    assert report.problems == [], "\n".join(report.problems[:40])
    assert report.steps == len(entries) >= 8  # a prefill and 7 decode steps at least (transformers' warm-up forwards are steps too)
    assert report.by_variant["graph capture"] >= 1 and report.by_variant["graph replay"] >= 1, dict(report.by_variant)
    processes = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(processes) == 1 and processes[0].startswith("engine process"), processes
