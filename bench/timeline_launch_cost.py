"""What `--timeline`'s collection costs per kernel launch, on the GPU, in isolation: a
loop of small kernel launches inside one attndbg range, timed without a collector, with CUPTI's
buffers read as memory (timeline/buffers.py), and through cupti-python's record objects (the
collector's fallback, forced here); each in a fresh process (CUPTI is per process). Each run also
checks that the collection saw what it should: every launch's kernel, launch call and external id,
the range's NVTX edges, a graph replay's nodes, and no note.

    python bench/timeline_launch_cost.py --launches 20000     # one GPU; ~30 s with cupti-python installed
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WAYS = ("plain", "memory", "objects")


def child(way: str, launches: int) -> dict:
    import torch

    from attndbg import profiling
    from attndbg.timeline import collector as collector_module

    collector = None
    if way != "plain":
        if way == "objects":
            def refused(library: str, on_buffer: object) -> None:
                raise OSError("forced by bench/timeline_launch_cost.py")

            collector_module.Buffers = refused  # type: ignore[assignment,misc]
        collector = collector_module.Collector(f"bench {way}")
        collector.start()
        profiling.observe(collector)
    x = torch.ones(256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with profiling.phase("warmup", "step=0"):
        for _ in range(100):
            x.add_(1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            for _ in range(4):
                x.mul_(1)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profiling.phase("launches", "step=1"):
        for _ in range(launches):
            x.add_(1)
        graph.replay()
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    out: dict = {"way": way, "us_per_launch": seconds / launches * 1e6}
    if collector is not None:
        take = time.perf_counter()
        records = collector.stop()
        out["stop_s"] = time.perf_counter() - take
        out.update(kernels=len(records.kernels), api_calls=len(records.api_calls), external_ids=len(records.external_ids),
                   markers=len(records.markers), graph_nodes=sum(1 for k in records.kernels if k.graph_id), notes=records.notes,
                   read_as_memory=collector._buffers is not None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.launches)))
        return
    failed = False
    for repeat in range(args.repeats):
        for way in WAYS:
            done = subprocess.run([sys.executable, __file__, "--child", way, "--launches", str(args.launches)], capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                print(f"{way}: exit {done.returncode}\n{done.stderr[-2000:]}")
                failed = True
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            line = f"{repeat} {way:8s} {r['us_per_launch']:7.2f} us/launch"
            if way != "plain":
                line += (f"  stop {r['stop_s']:.2f} s; kernels {r['kernels']}, launch calls {r['api_calls']}, external ids {r['external_ids']}, "
                         f"markers {r['markers']}, graph nodes {r['graph_nodes']}, read as memory {r['read_as_memory']}, notes {r['notes']}")
                expected = args.launches + 100 + 4  # the loop, the warm-up, the replay's nodes
                # The forced fallback's own note is expected; anything else is a problem.
                notes = [n for n in r["notes"] if "forced by bench" not in n]
                if r["kernels"] < expected or r["api_calls"] < args.launches or r["external_ids"] < args.launches or r["markers"] < 4 or r["graph_nodes"] != 4 or notes:
                    line += "  PROBLEM"
                    failed = True
                if r["read_as_memory"] != (way == "memory"):
                    line += "  PROBLEM: not read the way asked"
                    failed = True
            print(line, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
