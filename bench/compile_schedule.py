"""How well the compile phase keeps the cores busy: FlashInfer's build steps of a real recording, replayed.

The compile phase (attndbg/checks/precompile.py, backends/flashinfer_jit.build) builds each FlashInfer
module with its own ninja in its own directory, since one ninja over all of them left every module to
be rebuilt at its first load. Building modules apart, the question is scheduling: how many cores sit
idle while the last compile steps of a module run. A GPU machine's compile costs minutes of its
time, so this replays it here: each module's build file becomes a stand-in whose steps sleep for the
recorded step times (scaled down), and three ways of building them are timed on `--jobs` slots:

- `one-ninja`: one ninja over every module (`subninja`), as FlashInfer 0.7.2's build_jit_specs:
  ninja's own scheduling, the floor; not usable as such (the modules are rebuilt at first load);
- `one-at-a-time`: each module's ninja in turn with every job, as FlashInfer upstream now does
  (flashinfer-ai/flashinfer#2339);
- `attndbg`: `flashinfer_jit.build`.

Each step logs its start and end, so the result shows the wall time and how many steps ran at once
(mean over the wall time, and the peak). Sleeping steps use no CPU: oversubscribing costs nothing
here, so a peak above --jobs is shown, not penalised. Keep --scale at 0.025 or above: `build` looks at
its ninjas every 0.2 s, which at --scale 0.01 is 20 recorded seconds (1,010 s instead of 782).

    python bench/compile_schedule.py bench/data/flashinfer_jit_steps_h100.json --jobs 16 --scale 0.025

Input: {"modules": [{"module": NAME, "objects": [seconds...], "link": seconds}, ...]}, as written from a
ninja log of a real build (bench/data/flashinfer_jit_steps_h100.json: the 41 modules of
bench/server_sweep.py's 1,000-step recording on an H100, steps timed with all 16 cores busy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attndbg.backends import flashinfer_jit  # noqa: E402


def stand_ins(root: Path, modules: list[dict], scale: float, log: Path) -> list[flashinfer_jit.Unbuilt]:
    """A build file per module in FlashInfer's layout (JIT_DIR/NAME/build.ninja, library NAME/NAME.so)
    whose steps sleep the recorded seconds times `scale` and log their start and end."""
    jit = root / "cached_ops"
    out = []
    for m in modules:
        name = m["module"]
        d = jit / name
        d.mkdir(parents=True)
        step = f'echo "$$(date +%s.%N) +1" >> {log} && sleep $secs && echo "$$(date +%s.%N) -1" >> {log} && touch $out'
        lines = [f"rule step\n  command = {step}\n"]
        objects = [f"{d}/o{i}.o" for i in range(len(m["objects"]))]
        lines += [f"build {o}: step\n  secs = {s * scale:.4f}\n" for o, s in zip(objects, m["objects"])]
        lines.append(f"build {d}/{name}.so: step {' '.join(objects)}\n  secs = {m['link'] * scale:.4f}\n")
        (d / "build.ninja").write_text("".join(lines))
        out.append(flashinfer_jit.Unbuilt(name, str(d / "build.ninja"), str(jit)))
    return out


def one_ninja(modules: list[flashinfer_jit.Unbuilt], jobs: int) -> None:
    top = Path(modules[0].jit_dir) / "all.ninja"
    top.write_text("ninja_required_version = 1.3\n" + "".join(f"subninja {m.ninja_file}\n" for m in modules))
    subprocess.run(["ninja", "-C", modules[0].jit_dir, "-f", str(top), "-j", str(jobs)], check=True, capture_output=True)


def one_at_a_time(modules: list[flashinfer_jit.Unbuilt], jobs: int) -> None:
    for m in modules:
        subprocess.run(["ninja", "-C", str(Path(m.ninja_file).parent), "-f", m.ninja_file, "-j", str(jobs)], check=True, capture_output=True)


def concurrency(log: Path, wall: float) -> tuple[float, int]:
    """Mean steps running over the wall time, and the peak, from the steps' start/end log."""
    events = sorted((float(t), int(d)) for t, d in (line.split() for line in log.read_text().splitlines()))
    running = peak = 0
    area = 0.0
    for (t, d), nxt in zip(events, events[1:] + [(events[-1][0], 0)]):
        running += d
        peak = max(peak, running)
        area += running * (nxt[0] - t)
    return area / wall, peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("steps", type=Path, help="JSON of the modules' recorded step seconds")
    parser.add_argument("--jobs", type=int, default=16)
    parser.add_argument("--scale", type=float, default=0.025, help="seconds slept per recorded second")
    args = parser.parse_args()
    modules = json.loads(args.steps.read_text())["modules"]
    cpu = sum(sum(m["objects"]) + m["link"] for m in modules)
    longest = max(sum(sorted(m["objects"])[-1:]) + m["link"] for m in modules)
    print(f"{len(modules)} modules, {sum(len(m['objects']) for m in modules)} compile steps, {cpu:.0f} recorded step-seconds on {args.jobs} jobs: "
          f"at least {max(cpu / args.jobs, longest):.0f} s (recorded seconds; replayed at x{args.scale})")
    for label, run in (("one-ninja", one_ninja), ("one-at-a-time", one_at_a_time), ("attndbg", lambda ms, jobs: flashinfer_jit.build(ms, jobs=jobs))):
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "steps.log"
            ms = stand_ins(Path(tmp), modules, args.scale, log)
            start = time.monotonic()
            run(ms, args.jobs)
            wall = time.monotonic() - start
            mean, peak = concurrency(log, wall)
            print(f"  {label:14s} {wall / args.scale:6.0f} s (recorded seconds)  steps at once: mean {mean:5.1f}, peak {peak}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
