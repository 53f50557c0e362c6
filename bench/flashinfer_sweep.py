"""GPU: FlashInfer at the head dims engines use, through `attndbg check` (its kernels detector) and
`attndbg repro`: every crash or miss is a finding, and its repro command is run to see whether the
library's calls alone reproduce it.

    python bench/flashinfer_sweep.py OUT                       # every part, then OUT/flashinfer_sweep.md and .json
    python bench/flashinfer_sweep.py OUT --part decode-tc       # one part (decode-tc, decode-cuda, prefill); again: the next
    python bench/flashinfer_sweep.py OUT --report               # the table from the parts checked so far

Grid: head_dim 64, 80, 96, 128, 192, 256 x page 1 and 16, GQA 4 (16:4 heads), bf16:
  decode-tc    decode steps (4 requests, KV 37, 91, 300, 1025) on FlashInfer's tensor-core decode
               (--backend-option flashinfer.decode_tensor_cores=true)
  decode-cuda  the same steps on its CUDA-core decode (decode_tensor_cores=false)
  prefill      extend steps (3 requests, cached prefixes 0, 40, 129; 37, 5 and 64 new tokens) on its
               prefill path as SGLang picks it; FlashInfer's prefill kernels always use tensor cores
Each part is one `attndbg check DIR --backend flashinfer,triton --only kernels --jobs 6`: steps run
in worker processes (an illegal memory access is that step's backend-crash finding, and a fresh
worker goes on), and our Triton kernels run every step too, so a FlashInfer miss on a step Triton
passes is a claim about FlashInfer, not about the data or the reference. Head dims the installed
FlashInfer is known to get wrong (backends/flashinfer.py, decode_head_dim_defect) are run all the
same: check runs known defects and says whether the run confirms the declaration.

Then each finding's repro command is run (`attndbg repro ... && python repro_....py`, in OUT/repro):
"reproduced" when the script exits 1 (rows beyond tolerance of its inline float64 reference) or
dies in the library (a CUDA error), "not reproduced" when it exits 0. The table (markdown, ready for
docs/benchmarks.md) names FlashInfer's release, torch and the GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
PAGES = (1, 16)
HEADS = "16:4"
DECODE = ("mode=decode", "kv_lens=37,91,300,1025")
PREFILL = ("mode=extend", "prefix_lens=0,40,129", "extend_lens=37,5,64")
PARTS = {
    "decode-tc": (DECODE, ["--backend-option", "flashinfer.decode_tensor_cores=true"]),
    "decode-cuda": (DECODE, ["--backend-option", "flashinfer.decode_tensor_cores=false"]),
    "prefill": (PREFILL, []),
}
JOBS = 6
CHECK_TIMEOUT_S = 540
REPRO_TIMEOUT_S = 300
REPRO_PARALLEL = 4


def make_steps(folder: Path, spec: tuple[str, ...]) -> list[dict]:
    """One step file per (head_dim, page), numbered so each finding's repro script has its own name."""
    from attndbg.trace import io, synth

    folder.mkdir(parents=True, exist_ok=True)
    steps = []
    for i, (head_dim, page) in enumerate((h, p) for h in HEAD_DIMS for p in PAGES):
        words = [*spec, f"heads={HEADS}", f"head_dim={head_dim}", f"page_size={page}", "dtype=bfloat16", "shared_prefix=0"]
        trace = synth.build(synth.parse_spec(words))
        trace = replace(trace, source=replace(trace.source, step=i))
        path = folder / f"step_{i:03d}.pt"
        io.save(trace, path)
        steps.append({"step": i, "file": str(path), "head_dim": head_dim, "page": page, "spec": " ".join(words)})
    return steps


def check_part(out: Path, part: str) -> dict:
    spec, options = PARTS[part]
    folder = out / part
    steps = make_steps(folder, spec)
    report = out / f"check_{part}.json"
    command = [sys.executable, "-m", "attndbg", "check", str(folder), "--backend", "flashinfer,triton", "--only", "kernels", "--jobs", str(JOBS), *options, "--json", str(report)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    seconds = time.perf_counter() - start
    (out / f"check_{part}.log").write_text(done.stdout + done.stderr)
    result = {"part": part, "command": "attndbg " + shlex.join(command[3:]), "exit": done.returncode, "seconds": round(seconds, 1), "steps": steps}
    result["repros"] = run_repros(out, json.loads(report.read_text())) if report.exists() else {}
    (out / f"part_{part}.json").write_text(json.dumps(result, indent=1))
    print(f"{part}: exit {done.returncode} in {seconds:.0f} s; {len(result['repros'])} repro commands run", flush=True)
    return result


def run_repros(out: Path, check: dict) -> dict[str, dict]:
    """Each finding's repro command, run once: command -> outcome."""
    commands = sorted({f["data"]["repro"] for s in check["steps"] for f in s.get("findings") or [] if f.get("data", {}).get("repro")})
    where = out / "repro"
    where.mkdir(exist_ok=True)
    with ThreadPoolExecutor(REPRO_PARALLEL) as pool:
        return dict(zip(commands, pool.map(lambda c: run_repro(c, where), commands)))


def run_repro(command: str, cwd: Path) -> dict:
    # The command as a finding gives it (`attndbg repro ... && python X.py`), with this interpreter.
    shell = command.replace("attndbg repro ", f"{shlex.quote(sys.executable)} -m attndbg repro ", 1).replace(" && python ", f" && {shlex.quote(sys.executable)} ", 1)
    try:
        done = subprocess.run(["bash", "-c", shell], cwd=cwd, capture_output=True, text=True, timeout=REPRO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"outcome": f"timed out after {REPRO_TIMEOUT_S} s", "reproduced": None}
    text = done.stdout + done.stderr
    lines = [line for line in text.splitlines() if line.strip()]
    said = next((line for line in reversed(lines) if line.startswith(("reproduced:", "not reproduced:"))), None)
    error = next((line for line in reversed(lines) if "CUDA error" in line or "illegal memory access" in line or "Error" in line), lines[-1] if lines else "")
    if done.returncode == 1 and said and said.startswith("reproduced:"):
        return {"outcome": said, "reproduced": True}
    if done.returncode == 0:
        return {"outcome": said or "exit 0", "reproduced": False}
    crashed = "CUDA error" in text or "illegal memory access" in text or done.returncode < 0
    return {"outcome": f"exit {done.returncode}: {error.strip()[:200]}", "reproduced": True if crashed else None}


def rows_of(result: dict, check: dict | None) -> list[dict]:
    """One row per step: what FlashInfer and Triton did on it, and the finding's repro outcome."""
    by_step = {s["step"]: s for s in (check or {}).get("steps", []) if s.get("step", -1) >= 0}
    skipped = (check or {}).get("verdict", {}).get("skipped", {})
    rows = []
    for step in result["steps"]:
        seen = by_step.get(step["step"], {})
        row = {"part": result["part"], "head_dim": step["head_dim"], "page": step["page"], "checked": seen.get("checked"), "compared": seen.get("backends", [])}
        findings = seen.get("findings") or []
        row["flashinfer"] = _verdict("flashinfer", findings, row["compared"], seen, skipped.get("flashinfer"))
        row["triton"] = _verdict("triton", findings, row["compared"], seen, skipped.get("triton"))
        flashinfer = [f for f in findings if f.get("data", {}).get("backend") == "flashinfer"]
        row["findings"] = [f"{f['class']}/{f['check']}" for f in flashinfer]
        repro = next((f["data"].get("repro") for f in flashinfer if f.get("data", {}).get("repro")), None)
        row["repro"] = repro
        row["repro_outcome"] = result.get("repros", {}).get(repro, {}).get("outcome") if repro else None
        row["version"] = next((f["data"].get("version") for f in flashinfer if f.get("data", {}).get("version")), None)
        rows.append(row)
    return rows


def _verdict(backend: str, findings: list[dict], compared: list[str], step: dict, skipped: str | None) -> str:
    mine = [f for f in findings if f.get("data", {}).get("backend") == backend]
    for f in mine:
        data = f["data"]
        if f["class"] == "backend-crash":
            return f"CRASH ({str(data.get('error') or data.get('death'))[:80]})"
        if f["check"] == "kernel-raised":
            return "ERROR (raised)"
        if f["check"] == "kernel-fails-reference":
            return f"WRONG ({data.get('failing_rows')}/{data.get('total_rows')} rows, max abs {data.get('max_abs', 0):.3g}, {data.get('nonfinite')} NaN/Inf)"
    if backend in compared:
        known = any(f["check"] == "known-defect-not-reproduced" for f in mine)
        return "ok (the known-defect table predicted wrong)" if known else "ok"
    if not step.get("checked", True):
        return f"not checked ({str(step.get('error'))[:80]})"
    return f"not run ({skipped[:80]})" if skipped else "not run (the step is unsupported by it here)"


def report(out: Path) -> str:
    parts = [json.loads((out / f"part_{p}.json").read_text()) for p in PARTS if (out / f"part_{p}.json").exists()]
    rows = []
    for result in parts:
        path = out / f"check_{result['part']}.json"
        rows += rows_of(result, json.loads(path.read_text()) if path.exists() else None)
    header = _versions()
    lines = [
        f"# FlashInfer sweep through attndbg check ({header})",
        "",
        f"GQA {HEADS} heads, bf16; decode: 4 requests, KV 37/91/300/1025; prefill: 3 requests, prefixes 0/40/129 with 37/5/64 new tokens. "
        "`repro`: the finding's `attndbg repro` command run (reproduced: its script, the library's calls alone, exits 1 or dies in a CUDA error).",
        "",
        "| part | head_dim | page | FlashInfer | Triton (same step) | finding | repro |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['part']} | {r['head_dim']} | {r['page']} | {r['flashinfer']} | {r['triton']} | {', '.join(r['findings']) or '-'} | {r['repro_outcome'] or '-'} |"
        )
    lines += ["", "Checks:", *(f"- {p['part']}: `{p['command']}` exit {p['exit']}, {p['seconds']} s" for p in parts)]
    commands = sorted({r["repro"] for r in rows if r["repro"]})
    if commands:
        lines += ["", "Repro commands:", *(f"- `{c}`" for c in commands)]
    text = "\n".join(lines) + "\n"
    (out / "flashinfer_sweep.md").write_text(text)
    (out / "flashinfer_sweep.json").write_text(json.dumps({"versions": header, "rows": rows}, indent=1))
    return text


def _versions() -> str:
    import torch

    from attndbg.environment import package_version

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"FlashInfer {package_version('flashinfer')}, torch {torch.__version__}, Triton {package_version('triton')}, {gpu}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--part", choices=list(PARTS), action="append", help="check only this part (repeatable; default: every part not checked yet)")
    parser.add_argument("--report", action="store_true", help="only write the table from the parts checked so far")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        for part in args.part or [p for p in PARTS if not (args.out / f"part_{p}.json").exists()]:
            check_part(args.out, part)
    print(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
