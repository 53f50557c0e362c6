"""Do attndbg's ranges enclose the kernels they launched? Read from a `--timeline` file alone, so
the GPU test (tests/gpu/test_timeline.py) and its CPU test (test_enclosure.py) read the same.

Claims checked:
- every kernel was launched inside an attndbg range (its `range`), which names the step, the
  step file (`trace`, from the `step` range around the file's work: step numbers repeat across
  files) and its phase; a range inside a backend's (plan, run, capture+replay and a graph replay's
  parts) names the backend and the variant (eager, recorded plan, graph bs=N fill=V, or padded
  bs=N fill=V where the padded sequence ran eagerly, nothing captured), or, for a launch on crafted
  inputs that is no run of the step (a detector's merge probe), the probe. The step's shared data
  and float64 reference (`data`, `reference`) belong to no backend; attndbg's own CUDA-context
  probe after each detector (`context-probe`) is in a range of its own;
- CUPTI's NVTX records (what nsys draws) put every kernel's launch in the same range;
- each graph replay range holds exactly one cudaGraphLaunch, the kernels carrying its correlation
  id are graph nodes, the same node set for every replay of one capture, as many as the launches
  captured beside it; no graph node runs outside a replay range.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from attndbg.timeline import chrome

SHARED_PHASES = ("data", "reference", "compare")  # one step's data, shared by every backend
GRAPH_LAUNCH = ("cudaGraphLaunch", "cuGraphLaunch")


@dataclass
class Report:
    kernels: int = 0
    ranges: int = 0
    processes: int = 0
    graph_replays: int = 0
    kernels_by_phase: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        phases = ", ".join(f"{phase} {n}" for phase, n in sorted(self.kernels_by_phase.items()))
        return f"{self.kernels} kernels in {self.ranges} ranges of {self.processes} process(es), {self.graph_replays} graph replays ({phases})"


def check(doc: dict[str, Any]) -> Report:
    events = doc["traceEvents"]
    report = Report()
    ranges = {(e["pid"], e["args"]["range_id"]): e for e in events if e["ph"] == "X" and e.get("cat") == "attndbg"}
    named = chrome.range_names(doc)  # what each range names, from its message and its parents'
    kernels = chrome.kernel_events(doc)
    launches = [e for e in events if e["ph"] == "X" and e.get("cat", "").startswith("cuda_api")]
    report.ranges, report.kernels = len(ranges), len(kernels)
    report.processes = len({e["pid"] for e in kernels} | {pid for pid, _ in ranges})
    for k in kernels:
        where = f"kernel {k['kernel'].get('demangled', k['kernel']['cupti_name'])} (process {k['pid']}, at {k['ts']} us)"
        rid = k["args"]["range"]
        if rid is None:
            report.problems.append(f"{where} was launched outside every attndbg range")
            continue
        r = ranges.get((k["pid"], rid))
        if r is None:
            report.problems.append(f"{where} names range {rid}, which is not in the file")
            continue
        a, n = r["args"], named[(k["pid"], rid)]
        report.kernels_by_phase[n.phase] += 1
        if not n.step:
            report.problems.append(f"{where} ran in {a['message']!r}, which names no step")
        if not n.trace:
            report.problems.append(f"{where} ran in {a['message']!r}, which is in no step file's range (no trace= named)")
        if n.backend and n.phase not in SHARED_PHASES and not n.phase.startswith(("backend/", "detector/")) and not (n.variant or n.probe):
            report.problems.append(f"{where} ran in {a['message']!r} of backend {n.backend}, which names no variant")
        if k["args"].get("graph_id") and not (n.phase == "replay" and n.variant.startswith("graph")):
            report.problems.append(f"{where} is a graph node but ran in {a['message']!r}, not a graph replay range")
    report.problems += nvtx_problems(doc, bool(kernels))
    _check_graphs(ranges, named, kernels, launches, report)
    return report


def nvtx_problems(doc: dict[str, Any], any_kernel: bool) -> list[str]:
    """What CUPTI's NVTX records (what nsys draws) say against attndbg's own ranges, from the
    file's summary: none reached CUPTI at all, or kernels whose NVTX range is another."""
    attndbg = doc["otherData"]["attndbg"]
    problems = []
    if any_kernel and not attndbg["nvtx_markers"]:
        problems.append("no NVTX marker reached CUPTI: the NVTX ranges were not checked against the launches")
    if attndbg["nvtx_disagreements"]:
        problems.append(f"{attndbg['nvtx_disagreements']} kernels sit in another NVTX range than the one attndbg pushed for them")
    return problems


def graph_launches_by_range(launches: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """(pid, range_id) -> the graph launch calls among `launches` made in that range."""
    by_range: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in launches:
        if e["name"].startswith(GRAPH_LAUNCH):
            by_range[(e["pid"], e["args"]["range_id"])].append(e)
    return by_range


def _check_graphs(ranges: dict, named: dict, kernels: list, launches: list, report: Report) -> None:
    graph_launches = graph_launches_by_range(launches)
    nodes_of = defaultdict(set)
    for k in kernels:
        if k["args"].get("graph_id"):
            nodes_of[(k["pid"], k["args"]["correlation_id"])].add((k["args"]["graph_id"], k["args"]["graph_node_id"]))
    by_parent: dict[tuple[int, int], list[set]] = defaultdict(list)
    for key, r in ranges.items():
        n = named[key]
        if n.phase != "replay" or not n.variant.startswith("graph"):
            continue
        report.graph_replays += 1
        calls = graph_launches.get(key, [])
        if len(calls) != 1:
            report.problems.append(f"graph replay range {r['args']['message']!r} (process {key[0]}) holds {len(calls)} graph launches, not one")
            continue
        nodes = nodes_of.get((key[0], calls[0]["args"]["correlation_id"]), set())
        by_parent[(key[0], r["args"].get("parent_id"))].append(nodes)
    for (pid, parent), node_sets in by_parent.items():
        captures = [r["args"] for (p, rid), r in ranges.items() if p == pid and r["args"].get("parent_id") == parent and named[(p, rid)].phase == "capture"]
        captured = captures[0].get("captured_launches", 0) if len(captures) == 1 else None
        what = ranges[(pid, parent)]["args"]["message"] if (pid, parent) in ranges else f"range {parent}"
        if any(nodes != node_sets[0] for nodes in node_sets):
            report.problems.append(f"the replays of {what!r} ran different node sets: {[len(n) for n in node_sets]}")
        if captured is None:
            report.problems.append(f"{what!r} has {len(captures)} capture ranges, not one")
        elif captured != len(node_sets[0]):
            report.problems.append(f"{what!r}: {captured} kernel launches captured, but each replay ran {len(node_sets[0])} nodes")
