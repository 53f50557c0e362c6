"""Cold start: seconds from `attndbg check` to its verdict on a fresh machine.

Takes the first step of each mode (DECODE, TARGET_VERIFY, EXTEND, MIXED) of a recording, e.g.
`bench/server_sweep.py make`'s, into a 4-step recording, then runs the check on it once per
command form given, each line of its output stamped with the seconds since the command started, so
the log shows what the user waited on (FlashInfer's JIT builds, Triton's compile) and whether
progress was shown throughout. Run it first on a fresh device machine: only then are the JIT
caches (~/.cache/flashinfer, ~/.triton/cache) empty; the caches' sizes before each form are logged.

    python bench/cold_start.py SRC_RECORDING OUT_DIR --backend triton,flashinfer,fa3,mla --form default --form no-compile-first --fresh-caches

With --fresh-caches each form gets empty caches of its own (FLASHINFER_WORKSPACE_BASE and
TRITON_CACHE_DIR pointed at new folders), so every form is measured cold in one call; without it a
later form runs on the caches the earlier ones filled.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODES = ("DECODE", "TARGET_VERIFY", "EXTEND", "MIXED")
# default: check decides from what FlashInfer's cache holds (checks/precompile.py, worth_compiling);
# the other two force the compile phase, or leave every module to compile on first use.
FORMS = {"default": [], "compile-first": ["--compile-first"], "no-compile-first": ["--no-compile-first"]}
CACHES = ("~/.cache/flashinfer", "~/.triton/cache")


def fresh_caches(root: Path) -> dict[str, str]:
    """Environment pointing FlashInfer's JIT workspace and Triton's cache at empty folders."""
    root.mkdir(parents=True, exist_ok=False)
    return {"FLASHINFER_WORKSPACE_BASE": str(root), "TRITON_CACHE_DIR": str(root / "triton")}


def four_steps(source: Path, out: Path) -> list[dict]:
    """The first step of each mode of `source`, copied into `out` with their manifest lines."""
    chosen: dict[str, dict] = {}
    for line in (source / "manifest.jsonl").read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            chosen.setdefault(entry["mode"], entry)
    missing = [m for m in MODES if m not in chosen]
    if missing:
        sys.exit(f"{source}: no step of mode {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "manifest.jsonl", "w") as manifest:
        for mode in MODES:
            shutil.copy(source / chosen[mode]["file"], out / chosen[mode]["file"])
            manifest.write(json.dumps(chosen[mode]) + "\n")
    return [chosen[m] for m in MODES]


def cache_bytes(path: str) -> int:
    root = Path(os.path.expanduser(path))
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# What changes on every refresh of the progress display (spinner, clocks, rate): not news.
TICKING = re.compile(r"[\u2800-\u28ff]|\d+:\d\d:\d\d|[\d.]+ s/step|ETA|-:--:--")


def timed(command: list[str], log: Path, extra_env: dict[str, str]) -> tuple[int, float, float]:
    """Run `command` on a pseudo-terminal, so its progress display shows as a user sees it; log
    each distinct line of what it shows, stamped with the seconds since the start. (exit code,
    seconds, longest time the display's text, its clocks aside, stood still in seconds)."""
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="160", TERM="xterm", **extra_env)
    start = last_change = time.monotonic()
    still = 0.0
    shown = ""
    buffered = ""
    with open(log, "w") as f:
        f.write("$ " + " ".join(command) + "\n")
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
        os.close(slave)
        while True:
            try:
                chunk = os.read(master, 65536).decode(errors="replace")
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            buffered += ANSI.sub("", chunk)
            *lines, buffered = re.split(r"[\r\n]", buffered)
            for line in lines:
                line = line.rstrip()
                key = TICKING.sub("", line).strip()
                if not key or key == shown:
                    continue
                now = time.monotonic()
                still = max(still, now - last_change)
                last_change, shown = now, key
                stamped = f"[{now - start:7.1f} s] {line}"
                print(stamped, flush=True)
                f.write(stamped + "\n")
        rc = proc.wait()
        os.close(master)
    return rc, time.monotonic() - start, max(still, time.monotonic() - last_change)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--backend", default="triton,flashinfer,fa3,mla")
    p.add_argument("--form", action="append", choices=sorted(FORMS), help="command forms, in order (default: default)")
    p.add_argument("--fresh-caches", action="store_true", help="each form with empty JIT caches of its own")
    args = p.parse_args()
    rec = args.out / "cold4"
    steps = four_steps(args.source, rec)
    rows = []
    for form in args.form or ["default"]:
        extra_env = fresh_caches(args.out / f"caches_{form}") if args.fresh_caches else {}
        caches = {c: cache_bytes(c) for c in (extra_env.values() or CACHES)}
        command = ["attndbg", "check", str(rec), "--backend", args.backend, "--json", str(args.out / f"cold_{form}.json"), *FORMS[form]]
        rc, seconds, silence = timed(command, args.out / f"cold_{form}.log", extra_env)
        rows.append({"form": form, "exit": rc, "seconds": round(seconds, 1), "longest_still_display_s": round(silence, 1), "caches_before_bytes": caches})
        print(json.dumps(rows[-1]), flush=True)
    summary = {"steps": [{k: s[k] for k in ("file", "mode", "batch_size", "graph")} for s in steps], "backend": args.backend, "runs": rows}
    (args.out / "cold_start.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
