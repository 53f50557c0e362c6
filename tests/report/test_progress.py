"""The spinner shows what runs on a terminal, steps aside for output, and writes nothing when piped."""

from __future__ import annotations

import io

from rich.console import Console
from rich.text import Text

from attndbg.report.progress import StepProgress


def test_spinner_on_a_terminal_names_the_step_and_keeps_output() -> None:
    spinner_stream, out_stream = io.StringIO(), io.StringIO()
    terminal = Console(file=spinner_stream, force_terminal=True, width=80)
    with StepProgress(2, "replaying", console=terminal) as progress:
        progress.show("1/2 a.pt: triton")
        progress.print(Console(file=out_stream, width=80), Text("table of a.pt"))
    assert "replaying 1/2 a.pt: triton" in spinner_stream.getvalue()
    assert out_stream.getvalue() == "table of a.pt\n"


def test_nothing_is_written_when_piped() -> None:
    piped, out = io.StringIO(), io.StringIO()
    with StepProgress(1, "replaying", console=Console(file=piped, force_terminal=False)) as progress:
        progress.show("1/1 a.pt: triton")
        progress.print(Console(file=out), Text("table"))
    assert piped.getvalue() == "" and out.getvalue() == "table\n"


# -- check ------------------------------------------------------------------

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from attndbg import profiling
from attndbg.report import progress as progress_module
from attndbg.report.progress import CheckProgress, describe_phases

TRACE = str(Path(__file__).resolve().parents[2] / "traces" / "decode_gqa.pt")


def test_phases_are_named_as_detector_backend_variant() -> None:
    phases = (
        "attndbg/step trace=decode_gqa.pt step=0 mode=DECODE bs=3",
        "attndbg/detector/split-merge step=0 mode=DECODE bs=3",
        "attndbg/backend/triton step=0 mode=DECODE bs=3",
        "attndbg/run step=0 mode=DECODE bs=3 backend=triton variant=eager",
    )
    assert describe_phases(phases) == "split-merge › triton › eager"
    assert describe_phases(("attndbg/backend/flashinfer x", "attndbg/capture+replay s backend=flashinfer capture_bs=8")) == "flashinfer › graph bs=8"
    assert describe_phases(("attndbg/backend/triton x", "attndbg/capture+replay s backend=triton variant=padded capture_bs=8")) == "triton › padded bs=8"
    assert describe_phases(("attndbg/reference step=0",)) == "float64 reference"
    assert describe_phases(()) == ""


def test_single_step_spinner_names_the_step_and_the_phase_running() -> None:
    stream = io.StringIO()
    with CheckProgress(["a.pt"], console=Console(file=stream, force_terminal=True, width=120, color_system=None)) as spinner:
        with profiling.phase("detector/tree-mask", "step=0"), profiling.phase("backend/triton"), profiling.phase("run", "backend=triton variant=eager"):
            spinner.show("a.pt")
    assert "checking a.pt: tree-mask › triton › eager" in stream.getvalue()


def test_what_a_worker_runs_is_shown_for_the_step_awaited_only() -> None:
    """A step checked in a worker: its phase comes from the worker (`now`), not this process."""
    stream = io.StringIO()
    with CheckProgress(["rec/a.pt", "rec/b.pt"], console=Console(file=stream, force_terminal=True, width=160, color_system=None)) as bar:
        bar.now(1, "fill-value › flashinfer › graph bs=8")  # not awaited yet: not shown
        bar.show("a.pt")
        assert "graph bs=8" not in stream.getvalue()
        bar.now(0, "split-merge › flashinfer › extend_path=cascade")
        bar.show("a.pt")
        assert "checking a.pt: split-merge › flashinfer › extend_path=cascade" in stream.getvalue()
        bar.done(None)  # step 0 came back: its phase goes with it
        bar.show("b.pt")
    assert "checking b.pt: split-merge" not in stream.getvalue()


def test_folder_bar_takes_rate_and_eta_from_completed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    paths = [f"rec/step_{i:06d}.pt" for i in range(6)]
    with CheckProgress(paths, console=Console(file=stream, force_terminal=True, width=160, color_system=None)) as bar:
        for at in (109.0, 109.01, 109.02):  # three steps come back in a burst after 9 s
            now[0] = at
            bar.done(None)
        bar.show("step_000003.pt")
    text = stream.getvalue()
    assert "3/6" in text and "checking step_000003.pt" in text
    assert "3.0 s/step · ETA 0:00:09" in text, text  # 9.02 s for 3 steps, 3 to go: not 122 steps/s
    assert "steps/s" not in text


def test_eta_counts_down_and_never_reaches_0_while_a_step_is_left() -> None:
    # 3 steps done in 9 s (3 s a step), 3 left.
    eta = lambda now, total=6: progress_module.eta_seconds(total=total, done=3, began=100.0, last=109.0, now=now)  # noqa: E731
    assert eta(109.0) == 9.0 and eta(111.0) == 7.0  # on schedule: counting down
    assert eta(112.0) == 6.0  # the step running used its share: 2 steps of 3 s left
    assert eta(120.0) == 14.0  # 8 s over: as much again expected, then the 2 steps
    last = [eta(now, total=4) for now in (109.0, 111.0, 111.9, 112.0, 112.5, 130.0)]  # the last step, running long
    assert last == [3.0, 1.0, 1.0, 1.0, 1.0, 18.0]  # never 0, growing the longer it runs over
    assert eta(130.0, total=3) == 0.0  # nothing left


def _last_line(stream: io.StringIO) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue()).replace("\r", "\n")
    return [line for line in text.split("\n") if line.strip()][-1]


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_bar_keeps_its_labelled_times_on_one_line(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    """At any width: 'ETA' and 'elapsed' labelled, each beside its own time, on the bar's one line;
    what gives is the step and phase text, cut with '…' (at 80 columns the bar goes too)."""
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    paths = [f"rec/step_{i:06d}.pt" for i in range(6)]
    with CheckProgress(paths, console=Console(file=stream, force_terminal=True, width=width, color_system=None)) as bar:
        for at in (109.0, 109.01, 109.02):
            now[0] = at
            bar.done(None)
        bar.now(3, "split-merge › flashinfer › extend_path=cascade")
        bar.show("step_000003.pt")
    line = _last_line(stream)
    assert len(line) <= width and " 3/6 checking step_000003.pt" in line, line
    assert re.search(r" 3\.0 s/step · ETA 0:00:09 elapsed \d:\d\d:\d\d$", line), line
    assert ("━" in line) == (width >= progress_module.BAR_FROM)
    assert ("extend_path=cascade" in line) == (width >= 200) and ("…" in line) == (width < 200)


def test_one_step_says_elapsed_beside_its_time() -> None:
    stream = io.StringIO()
    with CheckProgress(["a.pt"], console=Console(file=stream, force_terminal=True, width=80, color_system=None)) as spinner:
        spinner.show("a.pt")
    assert re.search(r"checking a\.pt +elapsed \d:\d\d:\d\d$", _last_line(stream))


def test_quiet_shows_no_progress() -> None:
    stream = io.StringIO()
    with CheckProgress(["a.pt", "b.pt"], console=Console(file=stream, force_terminal=True, width=80, quiet=True)) as bar:
        bar.show("a.pt")
        bar.done(None)
    assert stream.getvalue() == ""


def _run_on_a_pty(argv: list[str]) -> str:
    pty = pytest.importorskip("pty")
    pid, fd = pty.fork()
    if pid == 0:  # the child: attndbg with a terminal on stdin, stdout and stderr
        os.environ["COLUMNS"] = "120"
        os.environ["TERM"] = "xterm"
        os.execv(sys.executable, [sys.executable, "-m", "attndbg", *argv])
    out = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 120)
        if not ready:
            break
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        out += data
    os.waitpid(pid, 0)
    return out.decode("utf-8", "replace")


def test_single_file_check_shows_a_spinner_on_a_terminal_and_nothing_when_piped() -> None:
    argv = ["check", TRACE, "--only", "invariants"]
    on_terminal = _run_on_a_pty(argv)
    assert f"checking {TRACE}" in on_terminal, on_terminal[-2000:]
    piped = subprocess.run([sys.executable, "-m", "attndbg", *argv], capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert "checking" not in piped.stderr and "checking" not in piped.stdout
    assert piped.stdout.splitlines()[-1].startswith("checked 1 of 1 step;")
