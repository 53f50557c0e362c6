"""Do the ranges `attndbg record --timeline` pushes around an engine's steps hold those steps'
kernels? Read from the timeline file and the recording's manifest alone, so the GPU test on a live
engine (tests/gpu/test_timeline.py) and its CPU test (test_engine_enclosure.py) read the same.

Claims checked:
- one `engine` range per recorded step, in one process, naming the step, its mode and batch size
  as the recorded step file says (the range is labelled before the step runs, from the engine's
  host state; the file is built after, from the device's tensors), and the variant: `eager`,
  `graph capture bs=N` or `graph replay bs=N`;
- an eager step's range launched kernels, and no graph;
- a capture's range ran its warm-up forward (kernels) and recorded launches into the graph;
- a replay's range holds exactly one cudaGraphLaunch, its kernels are that launch's graph nodes,
  every replay of one graph runs the same node set, and as many nodes as the recorded capture of
  its size (graph_bs) recorded launches, where one was recorded;
- no graph node runs outside a replay range; CUPTI's NVTX records place every kernel's launch in
  the same range as attndbg's own (what nsys draws agrees).
Kernels outside every range are the engine's own work between steps: counted, never a problem.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from attndbg.timeline import chrome
from attndbg.trace.io import ManifestEntry
from tests.timeline import enclosure


@dataclass
class Report:
    steps: int = 0
    kernels: int = 0
    outside: int = 0
    by_variant: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # "eager", "graph capture", "graph replay" -> ranges
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        variants = ", ".join(f"{v} {n}" for v, n in sorted(self.by_variant.items()))
        return f"{self.steps} step ranges ({variants}), {self.kernels} kernels in them, {self.outside} outside every range"


def check(doc: dict[str, Any], entries: list[ManifestEntry]) -> Report:
    events = doc["traceEvents"]
    report = Report()
    named = chrome.range_names(doc)  # what each range names, from its message and its parents'
    ranges = {(e["pid"], e["args"]["range_id"]): e for e in events if e["ph"] == "X" and e.get("cat") == "attndbg" and named[(e["pid"], e["args"]["range_id"])].phase == "engine"}
    kernels = chrome.kernel_events(doc)
    launches = [e for e in events if e["ph"] == "X" and e.get("cat") == "cuda_api"]
    report.steps = len(ranges)
    by_step = {int(named[key].step): r for key, r in ranges.items() if named[key].step.isdigit()}
    if len(by_step) != len(ranges):
        report.problems.append(f"{len(ranges)} engine ranges name {len(by_step)} distinct steps")
    recorded = {e.step: e for e in entries}
    if set(by_step) != set(recorded):
        report.problems.append(f"ranges for steps {sorted(set(by_step) - set(recorded))[:10]} that were not recorded; recorded steps without a range: {sorted(set(recorded) - set(by_step))[:10]}")
    for step, r in sorted(by_step.items()):
        n, entry = named[(r["pid"], r["args"]["range_id"])], recorded.get(step)
        if entry is not None and (n.mode, n.batch_size) != (entry.mode, str(entry.batch_size)):
            report.problems.append(f"step {step}: the range says mode={n.mode} bs={n.batch_size}, the recorded file {entry.file} mode={entry.mode} bs={entry.batch_size}")
    kernels_in: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for k in kernels:
        rid = k["args"]["range"]
        key = (k["pid"], rid)
        if rid is None or key not in ranges:
            report.outside += 1
            if k["args"].get("graph_id"):
                report.problems.append(f"graph node {k['name']} (process {k['pid']}) ran outside every replay range")
            continue
        report.kernels += 1
        kernels_in[key].append(k)
    graph_calls = enclosure.graph_launches_by_range(launches)
    node_sets: dict[tuple[int, int], list[tuple[int, frozenset]]] = defaultdict(list)  # (pid, graph id) -> (step, nodes) per replay
    # (pid, graph size) -> launches each recorded capture of it recorded
    captured: dict[tuple[int, str], list[int]] = defaultdict(list)
    for (pid, rid), r in ranges.items():
        if named[(pid, rid)].variant.startswith("graph capture"):
            captured[(pid, named[(pid, rid)].variant.split("bs=")[-1])].append(int(r["args"].get("captured_launches", 0)))
    for key, r in ranges.items():
        a, n = r["args"], named[key]
        variant, where = n.variant, f"step {n.step} ({a['message']!r})"
        kind = variant if variant == "eager" else " ".join(variant.split()[:2])
        report.by_variant[kind] += 1
        launched = kernels_in.get(key, [])
        calls = graph_calls.get(key, [])
        if kind == "eager":
            if not launched:
                report.problems.append(f"{where}: an eager step whose range launched no kernel")
            if calls or any(k["args"].get("graph_id") for k in launched):
                report.problems.append(f"{where}: an eager step's range launched a graph")
        elif kind == "graph capture":
            if not a.get("captured_launches"):
                report.problems.append(f"{where}: a capture whose range recorded no launch into a graph")
            if not launched:
                report.problems.append(f"{where}: a capture whose warm-up forward launched no kernel")
        elif kind == "graph replay":
            if len(calls) != 1:
                report.problems.append(f"{where}: a replay range holding {len(calls)} graph launches, not one")
                continue
            correlation = calls[0]["args"]["correlation_id"]
            strays = [k["name"] for k in launched if k["args"].get("correlation_id") != correlation or not k["args"].get("graph_id")]
            if strays or not launched:
                report.problems.append(f"{where}: {len(launched)} kernels in the replay range, {len(strays)} of them not nodes of its graph launch ({strays[:3]})")
                continue
            graphs = {k["args"]["graph_id"] for k in launched}
            nodes = frozenset(k["args"]["graph_node_id"] for k in launched)
            captures = captured.get((key[0], variant.split("bs=")[-1]), [])
            if len(captures) == 1 and captures[0] != len(launched):
                report.problems.append(f"{where}: the replay ran {len(launched)} nodes, the recorded capture of its size recorded {captures[0]} launches")
            for graph in graphs:
                node_sets[(key[0], graph)].append((int(n.step), nodes))
        else:
            report.problems.append(f"{where}: the range names no variant (eager, graph capture bs=N, graph replay bs=N): {variant!r}")
    for (pid, graph), replays in node_sets.items():
        if any(nodes != replays[0][1] for _, nodes in replays):
            report.problems.append(f"graph {graph} (process {pid}): its replays ran different node sets ({[(s, len(n)) for s, n in replays]})")
    report.problems += enclosure.nvtx_problems(doc, report.kernels > 0)
    return report
