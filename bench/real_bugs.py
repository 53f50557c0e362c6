"""The real-bug corpus (tests/corpus): write every bug and its correct twin as recordings, check each
with `attndbg check`, and print the table (docs/real-bugs.md explains it).

    python bench/real_bugs.py write DIR                 # needs SGLang and vLLM installed (the recorders' classes)
    python bench/real_bugs.py check DIR [--backend triton] [--cuda-graph] [--jobs 2] [--timeout 600] [--bugs ID,...]
    python bench/real_bugs.py all DIR [check options]   # write, then check
    python bench/real_bugs.py table DIR                 # the table again, from DIR/real_bugs.json

`write` records DIR/<bug>/bug/ and DIR/<bug>/twin/ (manifest.jsonl + step files, as `attndbg record`
writes them) and DIR/<bug>/bug.json (what the table needs: links, expected finding classes, the
words that name the mechanism); a bug the recorders cannot express gets only bug.json. `check`
needs attndbg alone (the GPU machine has no SGLang or vLLM): it runs `attndbg check <recording>
--backend ... --json` once per recording, each in its own process (a kernel that faults takes down
only its own check), and writes DIR/real_bugs.json and DIR/real_bugs.md.

Columns, per bug: caught = `check` exits 1 with a defect on the bug's recording; twin clean = exit 0
and no finding at all on the twin's; specific = a finding of the bug's expected class/check; named =
a finding's cause, or a diagnosis' reproduction, names the mechanism (one of the bug's words). The
counts end with the output-level bugs (whose recording holds the engine's output, `--layers`): those
diagnosis can name by reproducing the output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
META = "bug.json"
SIDES = ("bug", "twin")


def write(out: Path) -> None:
    """Record every encoded bug and twin; a bug.json per bug (not-expressible ones too)."""
    sys.path.insert(0, str(ROOT))  # tests/ is the repository's, not an installed package
    from tests.corpus import catalog

    out.mkdir(parents=True, exist_ok=True)
    for bug in catalog.BUGS:
        folder = out / bug.id
        if folder.exists():
            subprocess.run(["rm", "-rf", str(folder)], check=True)
        folder.mkdir()
        meta = {k: v for k, v in dataclasses.asdict(bug).items() if k != "write"}
        meta["capabilities"] = [c.name.lower() for c in bug.capabilities]
        meta["encoded"] = bug.write is not None
        (folder / META).write_text(json.dumps(meta, indent=1))
        if bug.write is not None:
            started = time.monotonic()
            bug.write(folder / "bug", folder / "twin")
            meta["output_level"] = catalog.holds_output(folder / "bug")
            (folder / META).write_text(json.dumps(meta, indent=1))
            print(f"{bug.id}: written in {time.monotonic() - started:.1f} s", flush=True)
        else:
            print(f"{bug.id}: not expressible ({bug.not_expressible[:80]}...)", flush=True)


def _check_one(recording: Path, options: list[str], timeout: float) -> dict:
    """`attndbg check` on one recording in its own process: exit code, findings, verdict."""
    report = recording.parent / f"{recording.name}.check.json"
    report.unlink(missing_ok=True)
    command = [sys.executable, "-m", "attndbg", "check", str(recording), "--json", str(report), *options]
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env={**os.environ, "COLUMNS": "200"})
        code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-3:]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"timed out after {timeout:.0f} s"]
    result = json.loads(report.read_text()) if report.exists() else {}
    findings = [f for step in result.get("steps", []) for f in step.get("findings", [])]
    return {
        "exit": code,
        "seconds": round(time.monotonic() - started, 1),
        "findings": findings,
        "verdict": result.get("verdict", {}).get("line", ""),
        "tail": tail if not result else [],
    }


def _named(findings: list[dict], words: list[str]) -> bool:
    """A finding's cause, or a reproduction (mechanism, summary), names the mechanism."""
    texts = [f.get("cause", "") for f in findings]
    for f in findings:
        for r in f.get("data", {}).get("reproductions", []) or []:
            texts += [str(r.get("mechanism", "")), str(r.get("summary", ""))]
    return any(word.lower() in text.lower() for word in words for text in texts)


def _specific(findings: list[dict], expected: list[str]) -> bool:
    labels = {f"{f.get('class')}/{f.get('check')}" for f in findings} | {f"{f.get('class')}/*" for f in findings}
    return any(e in labels for e in expected)


def judge(meta: dict, bug: dict, twin: dict) -> dict:
    defects = [f for f in bug["findings"] if f.get("severity", "defect") == "defect"]
    return {
        "caught": bug["exit"] == 1 and bool(defects),
        "twin_clean": twin["exit"] == 0 and not twin["findings"],
        "specific": _specific(bug["findings"], meta["expected"]),
        "named": _named(bug["findings"], meta["keywords"]),
        "bug_findings": sorted({f"{f.get('class')}/{f.get('check')} ({f.get('severity', 'defect')})" for f in bug["findings"]}),
        "twin_findings": sorted({f"{f.get('class')}/{f.get('check')} ({f.get('severity', 'defect')})" for f in twin["findings"]}),
    }


def table(out: Path) -> int:
    """Render the table again from DIR/real_bugs.json (no check runs)."""
    summary = json.loads((out / "real_bugs.json").read_text())
    text = render(summary["rows"], backend=summary["backend"], cuda_graph=summary["cuda_graph"])
    (out / "real_bugs.md").write_text(text + "\n")
    print(text)
    return 0


def check(out: Path, backend: str, cuda_graph: bool, jobs: int, timeout: float, extra: list[str], bugs: str | None = None) -> int:
    metas = [json.loads(p.read_text()) for p in sorted(out.glob(f"*/{META}"))]
    if bugs:
        wanted = set(bugs.split(","))
        metas = [m for m in metas if m["id"] in wanted]
    if not metas:
        print(f"{out}: no {META} files: run `python bench/real_bugs.py write {out}` first", file=sys.stderr)
        return 2
    options = ["--backend", backend, *(["--cuda-graph"] if cuda_graph else []), *extra]
    jobs_list = [(m, side) for m in metas if m["encoded"] for side in SIDES]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        results = dict(zip(((m["id"], side) for m, side in jobs_list), pool.map(lambda job: _check_one(out / job[0]["id"] / job[1], options, timeout), jobs_list)))
    rows = []
    for meta in metas:
        row = {"meta": meta}
        if meta["encoded"]:
            row["bug"], row["twin"] = results[(meta["id"], "bug")], results[(meta["id"], "twin")]
            row.update(judge(meta, row["bug"], row["twin"]))
        rows.append(row)
    summary = {"backend": backend, "cuda_graph": cuda_graph, "seconds": round(time.monotonic() - started, 1), "rows": rows}
    earlier = out / "real_bugs.json"
    if bugs and earlier.exists():  # a part of the corpus: the other bugs' rows of the last run stay
        last = json.loads(earlier.read_text())
        if (last.get("backend"), last.get("cuda_graph")) == (backend, cuda_graph):
            done = {row["meta"]["id"] for row in rows}
            rows = sorted([r for r in last["rows"] if r["meta"]["id"] not in done] + rows, key=lambda r: r["meta"]["id"])
            summary["rows"] = rows
    earlier.write_text(json.dumps(summary, indent=1, default=str))
    table = render(rows, backend=backend, cuda_graph=cuda_graph)
    (out / "real_bugs.md").write_text(table + "\n")
    print(table)
    return 0


def _mark(value: bool) -> str:
    return "yes" if value else "no"


def _capability(name: str) -> str:
    """A capability's short name (bug.json of an older write holds its description)."""
    sys.path.insert(0, str(ROOT))
    from tests.corpus.bug import Capability

    by_value = {c.value: c.name for c in Capability}
    return by_value.get(name, name).lower()


def render(rows: list[dict], *, backend: str, cuda_graph: bool) -> str:
    """The table: one line per bug, then the counts."""
    lines = [
        f"`attndbg check --backend {backend}{' --cuda-graph' if cuda_graph else ''}` on each recording.",
        "",
        "| bug | fix | engine, mode | expected | caught | twin clean | specific | named | found on the bug | on the twin | what would catch it |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        m = row["meta"]
        head = f"| {m['id']}: {m['title']} | {m['links'][0]} | {m['engine']}, {m['mode']} |"
        capabilities = ", ".join(_capability(c) for c in m["capabilities"])
        if not m["encoded"]:
            lines.append(f"{head} not expressible: {m['not_expressible']} | | | | | | | {capabilities} |")
            continue
        expected = ", ".join(m["expected"])
        marks = " | ".join(_mark(row[k]) for k in ("caught", "twin_clean", "specific", "named"))
        done = row["caught"] and row["specific"] and row["named"]
        lines.append(f"{head} {expected} | {marks} | {', '.join(row['bug_findings']) or 'none'} | {', '.join(row['twin_findings']) or 'none'} | {'' if done else capabilities} |")
    encoded = [r for r in rows if r["meta"]["encoded"]]
    count = lambda key: sum(1 for r in encoded if r[key])  # noqa: E731
    output_level = [r for r in encoded if r["meta"].get("output_level")]
    lines += [
        "",
        f"{len(rows)} bugs, {len(encoded)} encoded: caught {count('caught')}, twin clean {count('twin_clean')}, "
        f"specific {count('specific')}, named {count('named')}; caught with a clean twin "
        f"{sum(1 for r in encoded if r['caught'] and r['twin_clean'])}; output-level (the engine's output recorded) "
        f"named {sum(1 for r in output_level if r['named'])} of {len(output_level)}.",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("write", "check", "all", "table"):
        p = sub.add_parser(name)
        p.add_argument("out", type=Path)
        if name in ("check", "all"):
            p.add_argument("--backend", default="triton", help="check's --backend (default triton: runs interpreted on a CPU)")
            p.add_argument("--cuda-graph", action="store_true", help="check's --cuda-graph (GPU)")
            p.add_argument("--jobs", type=int, default=2, help="checks run at once, each in its own process")
            p.add_argument("--timeout", type=float, default=600, help="seconds one check may take")
            p.add_argument("--bugs", help="only these bugs (comma-separated ids), e.g. to split a run over several commands")
            p.add_argument("extra", nargs="*", help="further check options, after --")
    args = parser.parse_args()
    if args.command == "table":
        return table(args.out)
    if args.command in ("write", "all"):
        write(args.out)
    if args.command in ("check", "all"):
        return check(args.out, args.backend, args.cuda_graph, args.jobs, args.timeout, args.extra, args.bugs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
