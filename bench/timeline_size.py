"""Bytes a `--timeline` file spends per kernel (timeline/chrome.py, SIZE), measured on real CUPTI
records: the trimmed ones of tests/timeline/data (an H200's check worker and graph replays), and any
attndbg.timeline/1 file given (its records rebuilt by bench/timeline_processing.py, then written in
the current format). For each: kernels, ranges per kernel, the file's bytes per kernel and where
they go (kernel events, range events, the rest of the events, the kernel table, the summary), and
gzip's. `--scale N` repeats each process's records N times (fresh ids, later times), as a longer
run of the same work: what is written once per distinct kernel (the table) then weighs less.

    python bench/timeline_size.py
    python bench/timeline_size.py OLD_TIMELINE.json.gz --scale 30
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timeline_processing import DATA, records_from_chrome, scaled  # noqa: E402

from attndbg.timeline import chrome, summary  # noqa: E402
from attndbg.timeline.matching import match  # noqa: E402
from attndbg.timeline.records import ProcessRecords, from_json  # noqa: E402


def _size(event: dict) -> int:
    return len(json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()) + 1  # and its comma


def measure(label: str, records: list[ProcessRecords]) -> None:
    matched = [match(r) for r in records]
    text = chrome.text(matched, summary.summarize(matched), command="check")
    doc = json.loads(text)
    kernels = sum(len(r.kernels) for r in records)
    ranges = sum(len(r.ranges) for r in records)
    kernel_events = sum(_size({k: v for k, v in e.items() if k != "kernel"}) for e in chrome.kernel_events(doc))
    range_events = sum(_size(e) for e in doc["traceEvents"] if e.get("cat") == "attndbg")
    events = sum(_size(e) for e in doc["traceEvents"])
    per = lambda n: f"{n / kernels:6.1f}"  # noqa: E731
    print(
        f"{label}: {kernels} kernels, {ranges / kernels:.2f} ranges a kernel; bytes per kernel: file {per(len(text.encode()))} "
        f"(kernel events {per(kernel_events)}, ranges {per(range_events)}, other events {per(events - kernel_events - range_events)}, "
        f"kernel table {per(len(json.dumps(doc['otherData']['kernels']).encode()))}, summary {per(len(json.dumps(doc['otherData']['attndbg']).encode()))}); "
        f"gzip {per(len(gzip.compress(text.encode(), 6)))}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="attndbg.timeline/1 files (.json or .json.gz)")
    parser.add_argument("--scale", type=int, default=1, help="repeat each process's records this many times")
    args = parser.parse_args()
    sources = [(f.name, [from_json(json.loads(line)) for line in f.read_text().splitlines()]) for f in sorted(DATA.glob("*.jsonl"))]
    for path in args.files:
        raw = path.read_bytes()
        sources.append((path.name, records_from_chrome(json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw))))
    for label, records in sources:
        measure(label + (f" x{args.scale}" if args.scale > 1 else ""), [scaled(r, args.scale) if args.scale > 1 else r for r in records])


if __name__ == "__main__":
    main()
