"""Time `attndbg check` on a recording at server scale, as a user runs it.

On the GPU machine:

    bash .gpu/env.sh python bench/check_scale.py --steps 1000 --long 5000 --out $OUT

Builds a recording of metadata-only decode steps (`scale_recording.py`: bs 1-64, kv 1-8192, page 1
or 16, GQA 32:8 or 8:1, bf16), then runs `attndbg check REC --backend triton,flashinfer,fa3` in a
subprocess and reports, each as its own row:

  cold       a fresh process on a small sample with empty kernel caches (FlashInfer/Triton JIT)
  warm       the whole recording, caches filled (the number the issue targets: <= 60 s / 1000 steps)
  default    the whole recording with the default --jobs (auto: workers by cores, GPUs and steps)
  graph      the same with --cuda-graph (target <= 150 s); graph1: with --jobs 1
  jobs N     the same with --jobs N (one GPU)
  long       the default command on the recording and on one of `--long` steps (hard links to the
             first recording's files), for memory flatness: peaks must not grow with the length

Peak host RSS is the largest of the check process and its workers (getrusage of the children);
GPU memory is sampled from nvidia-smi every 0.1 s while the command runs. Results go to
`--out/check_scale.json` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import scale_recording  # noqa: E402


def build_parallel(out: Path, steps: int, workers: int) -> float:
    """scale_recording.build, spread over processes (each builds a contiguous block of steps)."""
    start = time.perf_counter()
    tmp = out.with_name(out.name + ".parts")
    blocks = [(i * steps // workers, (i + 1) * steps // workers) for i in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_build_block, [(str(tmp / f"b{i}"), a, b) for i, (a, b) in enumerate(blocks)]))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "manifest.jsonl", "w") as manifest:
        for i in range(workers):
            part = tmp / f"b{i}"
            for line in (part / "manifest.jsonl").read_text().splitlines():
                entry = json.loads(line)
                os.replace(part / entry["file"], out / entry["file"])
                manifest.write(line + "\n")
    return time.perf_counter() - start


def _build_block(args: tuple[str, int, int]) -> None:
    directory, first, last = args
    import random
    from dataclasses import replace

    from attndbg.trace import io, synth

    import torch

    torch.set_num_threads(1)  # one process per core
    Path(directory).mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    specs = [scale_recording.step_spec(rng, step, 64, 8192) for step in range(last)]  # same draws as build()
    for step in range(first, last):
        trace = synth.build(synth.parse_spec(specs[step]))
        io.append_to_recording(directory, replace(trace, source=replace(trace.source, step=step)))


def lengthen(src: Path, dst: Path, steps: int) -> None:
    """A recording of `steps` steps made of hard links to `src`'s files, cycled."""
    dst.mkdir(parents=True, exist_ok=True)
    entries = [json.loads(line) for line in (src / "manifest.jsonl").read_text().splitlines()]
    with open(dst / "manifest.jsonl", "w") as manifest:
        for step in range(steps):
            entry = dict(entries[step % len(entries)])
            name = f"step_{step:06d}.pt"
            if not (dst / name).exists():
                os.link(src / entry["file"], dst / name)
            entry["file"], entry["step"] = name, step
            manifest.write(json.dumps(entry) + "\n")


class GpuMemorySampler:
    """Peak `memory.used` of the GPUs this process sees (CUDA_VISIBLE_DEVICES, as nvidia-smi -i takes
    it: UUIDs, or indices when CUDA_DEVICE_ORDER=PCI_BUS_ID; else every GPU), from nvidia-smi, while
    a command runs."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                visible = os.environ.get("CUDA_VISIBLE_DEVICES")
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", *(["-i", visible] if visible else [])],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
                self.peak_mib = max([self.peak_mib] + [int(x) for x in out.split() if x.strip().isdigit()])
            except (OSError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.1)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# A fresh wrapper per run reports the peak RSS of the check process and its workers (getrusage of
# its children): the parent's own RUSAGE_CHILDREN would be a running maximum over every run.
_WRAPPER = (
    "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
    "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
)


RUN_TIMEOUT = 300  # seconds (--run-timeout); a run past it is recorded as timed out (exit -9), the others go on


def timed_check(label: str, args: list[str], log_dir: Path, cwd: str | None = None, timeout: float = RUN_TIMEOUT) -> dict:
    """Run `attndbg check ARGS` in a fresh process; wall time, exit code, peaks, verdict line."""
    command = [sys.executable, "-c", _WRAPPER, sys.executable, "-m", "attndbg", "check", *args]
    with GpuMemorySampler() as gpu:
        start = time.perf_counter()
        try:
            proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            proc = subprocess.CompletedProcess(command, -9, out, err + f"\ntimed out after {timeout:.0f} s")
        seconds = time.perf_counter() - start
    (log_dir / f"check_{''.join(c if c.isalnum() else '_' for c in label)}.log").write_text(proc.stdout + proc.stderr)
    rss = [int(line.split()[1]) for line in proc.stderr.splitlines() if line.startswith("PEAK_RSS_KIB")]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("checked ")]
    return {
        "label": label,
        "args": args,
        "seconds": round(seconds, 2),
        "exit": proc.returncode,
        "peak_rss_mib": round(rss[-1] / 1024, 1) if rss else None,
        "peak_gpu_mib": gpu.peak_mib,
        "verdict": lines[-1] if lines else (proc.stderr.strip().splitlines() or [""])[-1],
    }


def profile(rec: Path, base: list[str], sample: int, out: Path) -> str:
    """cProfile of `attndbg check --sample N` in one process: where the remaining time goes."""
    raw, text = out / "check_scale_profile.prof", out / "check_scale_profile.txt"
    subprocess.run([sys.executable, "-m", "cProfile", "-o", str(raw), "-m", "attndbg", "check", str(rec), *base, "--sample", str(sample)], check=False, capture_output=True)
    with open(text, "w") as f:
        stats = pstats.Stats(str(raw), stream=f)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
    raw.unlink()
    return str(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--long", type=int, default=5000, help="length of the memory-flatness recording")
    parser.add_argument("--backends", default="triton,flashinfer,fa3")
    parser.add_argument("--jobs", default="4", help="comma-separated --jobs values to time (one GPU)")
    parser.add_argument("--cold-sample", type=int, default=16)
    parser.add_argument("--before", default=None, help="a checkout of the code before the change (its `attndbg` package dir's parent)")
    parser.add_argument("--before-steps", type=int, default=10)
    parser.add_argument("--profile-sample", type=int, default=100)
    parser.add_argument("--runs", default="cold,before,warm,profile,jobs,graph,long")
    parser.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT, help="seconds one timed check may take")
    parser.add_argument("--devices", default=None, help="also time --jobs J --devices D (e.g. 0,1) for the multi-GPU speed-up")
    parser.add_argument("--work", default="/tmp/attndbg_scale")
    parser.add_argument("--out", default="out/bench")
    parser.add_argument("--tag", default="")
    parser.add_argument("--recording", type=Path, default=None, help="time this recording (e.g. server_sweep.py make's) instead of building the decode-only one")
    parser.add_argument(
        "--system-caches", action="store_true", help="use the JIT caches a user's check uses (filled by `attndbg compile`) instead of empty ones under --work"
    )
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    work, out = Path(args.work), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rec = args.recording or work / f"rec{args.steps}"
    if args.recording:
        args.steps = sum(1 for line in (rec / "manifest.jsonl").read_text().splitlines() if line.strip())
    rows = []

    def record(label: str, check_args: list[str], steps: int, cwd: str | None = None) -> None:
        row = timed_check(label, check_args, out, cwd, timeout=args.run_timeout)
        row["steps_checked"] = steps
        rows.append(row)
        print(row, flush=True)

    if not args.recording and not (rec / "manifest.jsonl").exists():
        built = build_parallel(rec, args.steps, min(16, os.cpu_count() or 1))
        print(f"built {args.steps} steps in {built:.1f} s", flush=True)
    base = ["--backend", args.backends]
    # One JIT cache directory for every run: the cold run fills it, as a new user's first run does.
    if not args.system_caches:
        os.environ.update({"FLASHINFER_WORKSPACE_BASE": str(work / "fi_cache"), "TRITON_CACHE_DIR": str(work / "triton_cache")})
    jobs_list = [int(j) for j in args.jobs.split(",") if j]
    if "cold" in runs:
        record("cold", [str(rec), *base, "--sample", str(args.cold_sample)], args.cold_sample)
    if "before" in runs and args.before:
        short = work / f"rec{args.before_steps}"
        lengthen(rec, short, args.before_steps)
        # `python -m` puts the working directory first on sys.path: run the old code from its checkout.
        # The old code replays padded graphs in every check: a first run compiles those kernels.
        lengthen(rec, work / "rec2", 2)
        timed_check("before, warm-up", [str(work / "rec2"), *base], out, cwd=args.before)
        record("before", [str(short), *base], args.before_steps, cwd=args.before)
        record("after, jobs 1", [str(short), *base, "--jobs", "1"], args.before_steps)
    if "warm" in runs:
        record("warm, jobs 1", [str(rec), *base, "--jobs", "1", "--json", str(work / "warm.json")], args.steps)
    if "default" in runs:
        record("warm, default jobs", [str(rec), *base], args.steps)
    if "profile" in runs:
        print(f"profile: {profile(rec, [*base, '--jobs', '1'], args.profile_sample, out)}", flush=True)
    if "jobs" in runs:
        for jobs in jobs_list:
            record(f"jobs {jobs}", [str(rec), *base, "--jobs", str(jobs), "--devices", "0", "--json", str(work / f"jobs{jobs}.json")], args.steps)
    if args.devices:
        jobs = max(jobs_list)
        record(f"jobs {jobs} devices {args.devices}", [str(rec), *base, "--jobs", str(jobs), "--devices", args.devices], args.steps)
    if "graph" in runs:
        record("graph, default jobs", [str(rec), *base, "--cuda-graph"], args.steps)
    if "graph1" in runs:
        record("graph, jobs 1", [str(rec), *base, "--cuda-graph", "--jobs", "1"], args.steps)
    if "long" in runs:
        # The command as a user runs it (default --jobs) on both lengths: peaks must not grow.
        long_rec = work / f"rec{args.long}"
        lengthen(rec, long_rec, args.long)
        record(f"length {args.steps}", [str(rec), *base], args.steps)
        record(f"length {args.long}", [str(long_rec), *base], args.long)
    same = None
    warm_json = work / "warm.json"
    for jobs in jobs_list:
        other = work / f"jobs{jobs}.json"
        if warm_json.exists() and other.exists():
            same = (same is not False) and json.loads(warm_json.read_text())["steps"] == json.loads(other.read_text())["steps"]
    result = {"steps": args.steps, "backends": args.backends, "rows": rows, "jobs_json_identical_to_jobs_1": same}
    (out / f"check_scale{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'run':24s} {'steps':>6s} {'seconds':>8s} {'ms/step':>8s} {'exit':>4s} {'rss MiB':>8s} {'gpu MiB':>8s}")
    for row in rows:
        n = row["steps_checked"]
        print(
            f"{row['label']:24s} {n:6d} {row['seconds']:8.1f} {1000 * row['seconds'] / n:8.1f} {row['exit']:4d} "
            f"{str(row['peak_rss_mib']):>8s} {row['peak_gpu_mib']:8d}"
        )
    print(f"--jobs JSON identical to --jobs 1: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
