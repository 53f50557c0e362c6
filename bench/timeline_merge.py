"""The end of a `--timeline` check over several workers (attndbg/timeline/merge.py), timed on the
CPU: reading the workers' files, matching, the summary and the trace events, in this process
against in one helper process per file, on the same files; the two texts must be identical.

The files are tests/timeline/data's processes (a check worker's, a graph replay's) repeated to
--kernels kernels in all (the H200 200-step cost run placed 104,679) and split into --workers
processes, each written as a worker writes it: a batch of JSON lines a second.

    python bench/timeline_merge.py --kernels 104679 --workers 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attndbg.timeline import merge, worker  # noqa: E402
from attndbg.timeline.records import ProcessRecords, to_json  # noqa: E402
from bench.timeline_processing import recorded  # noqa: E402

BATCHES = 30  # a worker's file: one batch a second of a 30 s check


def write_worker(directory: Path, records: ProcessRecords) -> None:
    """`records` as a worker writes them: in BATCHES lines, each with its share of every list."""
    with open(directory / f"worker-{records.pid}.jsonl", "w") as f:
        for b in range(BATCHES):
            batch = ProcessRecords(pid=records.pid, label=records.label)
            for name in ("ranges", "api_calls", "kernels", "external_ids", "markers"):
                items = getattr(records, name)
                getattr(batch, name).extend(items[b * len(items) // BATCHES : (b + 1) * len(items) // BATCHES])
            f.write(json.dumps(to_json(batch), separators=(",", ":")) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=104_679)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    what, processes = recorded(args.kernels // args.workers)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for w in range(args.workers):
            for p in processes:  # each worker: all of the data's processes' records, under its own pid
                write_worker(directory, dataclasses.replace(p, pid=1000 + w * 10 + processes.index(p)))
        files = worker.files(directory)
        size = sum(f.stat().st_size for f in files)
        kernels = sum(len(r.kernels) for f in files for r in worker.read_file(f))
        print(f"{what}: {len(files)} files, {size / 2**20:.1f} MiB, {kernels} kernels")
        texts = {}
        for label, threshold in (("this process", 1 << 62), ("helpers", 0)):
            merge.HELPERS_FROM_BYTES = threshold
            merge._cores = lambda: 16  # timed whatever the cores: on fewer than 4, render would not start them
            seconds = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                events, _, _, note = merge.render(None, files)
                seconds.append(time.perf_counter() - start)
                assert note is None, note
            texts[label] = events
            print(f"  {label:<14} " + "  ".join(f"{s:.2f} s" for s in seconds) + f"   ({len(events) / 2**20:.0f} MiB of events)")
        print("  texts identical:", texts["this process"] == texts["helpers"])


if __name__ == "__main__":
    main()
