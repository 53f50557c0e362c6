"""`attndbg check` (the detectors over a step or a recording) and `attndbg compile` (the kernels a
recording needs, built before checking it).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from attndbg.cli import options
from attndbg.cli.common import EXIT_FAILED, EXIT_NOT_RUN, EXIT_OK, BadInput, NotRunHere, check_outputs, handles_bad_input, make_console, print_verdict, write_json
from attndbg.cli.group import main
from attndbg.cli.options import is_every_backend, parse_backend_options, parse_backends, parse_devices, parse_jobs, parse_max_memory, parse_step_selection, require_gpu_for_cuda_graph

if TYPE_CHECKING:
    from attndbg.detector_api.findings import FindingClass


class _CheckCommand(click.Command):
    """`check --help` lists the detectors of the registry (built-in and third-party), read when the
    help is shown: the registry can grow after this module is imported."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from attndbg.detectors import registry as detectors

        rows = []
        for name in detectors.names():
            try:
                rows.append((name, detectors.load(name).summary))
            except detectors.LoadError as e:
                rows.append((name, f"cannot be loaded: {e}"))
        with formatter.section("Detectors (--only KIND,...)"):
            formatter.write_dl(rows)
        super().format_epilog(ctx, formatter)


@main.command(cls=_CheckCommand)
@click.argument("target", type=click.Path())
@options.only("detectors to run, by kind (listed below; default: all but the opt-in ones, which run only when named here)")
@options.backend("kernel backends the detectors may use (default: all that run here)")
@options.cuda_graph("detectors also replay under CUDA graphs (GPU)")
@options.steps()
@options.sample()
@options.jobs()
@options.devices()
@click.option("--in-process", is_flag=True, help="check in this process, even on a GPU (where worker processes are the default: a crashing kernel then costs only its step); here a CUDA fault is the step's backend-crash finding and the steps after it are not checked, the context being unrecoverable")
@options.max_memory("do not check a step (one file: exit 2) whose data would need more than SIZE, e.g. 8G or 512M (default: what the device has free)")
@options.backend_option()
@options.json_output("findings", "attndbg.check/1")
@click.option("--strict", is_flag=True, help="hazards fail the check too (exit 1): findings correct on this step, wrong under the condition each states")
@click.option(
    "--compile-first/--no-compile-first", default=None,
    help="on a GPU, first compile the FlashInfer modules the recording's steps need, named without running them, all at once (as `attndbg compile`; "
    "modules on disk are skipped); default: when FlashInfer's cache lacks 2 or more of those one step of each kernel shape needs",
)
@handles_bad_input
@options.terminal(quiet=True)
@options.timeline("check")
def check(
    target: str,
    only: str | None,
    backend_spec: str | None,
    cuda_graph: bool,
    steps_spec: str | None,
    sample: int | None,
    jobs_spec: str,
    devices_spec: str | None,
    in_process: bool,
    json_path: str | None,
    max_memory_spec: str | None,
    backend_option_specs: tuple[str, ...],
    strict: bool,
    compile_first: bool | None,
) -> None:
    """Run the detectors on a step or a recording directory and explain what they find.

    Exit 0 when clean or with hazards only (findings right on this step, wrong under the condition
    each states; --strict: 1), 1 with defects, 2 on bad input, 3 when a backend named with --backend
    could not run here (or a step could not be checked) and nothing failed (--backend all skips the
    backends that cannot run here and names them).

    \b
    Examples:
      attndbg synth verify mask_layout=qlen_only_bitpacked --inject tree-mask:bit-order -o bad.pt
      attndbg check bad.pt --only tree-mask   # exit 1: names the big-endian packing, the request and row, the expected word
      attndbg examples traces
      attndbg check traces --steps 1:3 --only invariants,fill-value --json check.json
    """
    began = time.monotonic()
    from attndbg.checks.run import check_steps
    from attndbg.checks.selection import select_paths
    from attndbg.detector_api.context import CheckOptions
    from attndbg.report.checks import check_verdict, checks_to_json, render_step, render_summary
    from attndbg.report.progress import CheckProgress
    from attndbg.report.terminal import duration
    from attndbg.trace import io

    classes = _detectors(only)
    names = tuple(parse_backends(backend_spec)) if backend_spec else None
    backend_options = parse_backend_options(backend_option_specs)
    require_gpu_for_cuda_graph(cuda_graph)
    selection = parse_step_selection(steps_spec, sample)
    max_memory = parse_max_memory(max_memory_spec)
    devices = parse_devices(devices_spec)
    jobs = parse_jobs(jobs_spec)
    if in_process and jobs not in (None, 1):
        raise BadInput(f"--in-process checks in one process: it cannot take --jobs {jobs}")
    check_outputs(json=json_path)
    options = CheckOptions(backends=names, cuda_graph=cuda_graph, max_memory=max_memory, backend_options=backend_options)
    console = make_console(stderr=json_path == "-")
    if not Path(target).is_dir():
        io.load(target)  # one file: unreadable is bad input (exit 2); in a recording it is one step's error
    paths = select_paths(target, selection)
    if not paths:
        raise BadInput(f"{target}: no steps to check" + (f" in the selection (--steps/--sample): {_steps_held(target)}" if steps_spec or sample else ""))
    reports = []
    with CheckProgress(paths, console=make_console(stderr=True)) as progress:  # on stderr, only on a terminal
        for report in check_steps(target, classes, options, progress.done, selection=selection, jobs=1 if in_process else jobs, devices=devices, isolate=False if in_process else None, now=progress.now, compile_first=compile_first):
            reports.append(report)
            single_error = len(paths) == 1 and report.bad_input  # raised as bad input below
            if (report.findings or report.error or len(paths) == 1) and not single_error:
                progress.print(console, render_step(report))
    if len(paths) == 1 and not Path(target).is_dir() and reports and reports[0].bad_input:
        raise BadInput(f"{target}: {reports[0].error}")  # one file that cannot be checked here is bad input
    if len(paths) > 1:
        console.print(render_summary(reports))
    selection = _selection_note(target, paths, steps_spec, sample)
    verdict = check_verdict(reports, classes, names, backend_options, selection=selection, every=is_every_backend(backend_spec))
    print_verdict(make_console(stderr=json_path == "-", details=False), f"{verdict.line}; took {duration(time.monotonic() - began)}")
    if json_path:
        write_json(json_path, checks_to_json(reports, verdict))
    if verdict.defects or (strict and verdict.hazards):
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_NOT_RUN if verdict.incomplete else EXIT_OK)


def _selection_note(target: str, paths: list[Path], steps_spec: str | None, sample: int | None) -> Any:
    """For the verdict under --steps/--sample: which steps (by the numbers the selection counts:
    the manifest's, else file order) of how many."""
    from attndbg.checks.selection import numbered_paths
    from attndbg.report.checks import Selection

    flags = " ".join(flag for flag in (f"--steps {steps_spec}" if steps_spec else "", f"--sample {sample}" if sample else "") if flag)
    if not flags:
        return None
    numbers = {path: step for step, path in numbered_paths(target)}
    return Selection(recording_steps=len(numbers), steps=tuple(numbers[p] for p in paths if p in numbers), options=flags)


def _steps_held(target: str) -> str:
    """'it has 5 steps, numbered 0-4': what --steps A:B can choose from, for a selection of none."""
    from attndbg.checks.selection import numbered_paths
    from attndbg.plural import counted

    numbers = [step for step, _ in numbered_paths(target)]
    if not numbers:
        return "it has no steps"
    low, high = min(numbers), max(numbers)
    return f"it has {counted(len(numbers), 'step')}, numbered {low}" + (f"-{high}" if high != low else "")


@main.command("compile")
@click.argument("target", type=click.Path())
@options.only("the detectors check will run (their kernels are compiled too)")
@options.backend("kernel backends check will use (default: all that run here)")
@options.steps()
@handles_bad_input
def compile_kernels(target: str, only: str | None, backend_spec: str | None, steps_spec: str | None) -> None:
    """Compile the FlashInfer modules a recording's steps need, named without running them, all at once.

    What `check --compile-first` does before its first step; on its own it warms a fresh machine. Exit 0
    when done, 3 when nothing could be compiled here (no CUDA GPU, no FlashInfer) or the phase ended
    early.

    \b
    Example:
      attndbg examples traces
      attndbg compile traces     # GPU: builds the FlashInfer modules the example traces need
    """
    from attndbg import machine
    from attndbg.checks.precompile import precompile
    from attndbg.checks.selection import select_paths
    from attndbg.detector_api.context import CheckOptions

    classes = _detectors(only)
    paths = select_paths(target, parse_step_selection(steps_spec, None))
    if not paths:
        raise BadInput(f"{target}: no steps" + (f" in the selection (--steps {steps_spec}): {_steps_held(target)}" if steps_spec else ""))
    if not machine.cuda_available():
        raise NotRunHere("compile: nothing compiled: no CUDA GPU here (FlashInfer's modules are built for one; Triton runs interpreted on a CPU)")
    names = tuple(parse_backends(backend_spec)) if backend_spec else None
    done = precompile(paths, classes, CheckOptions(backends=names))
    if done is None:
        click.echo("attndbg compile: nothing to compile: no FlashInfer here, or every kernel shape's modules are already built")
        sys.exit(EXIT_OK)
    click.echo(f"attndbg compile: {done.modules} of the {done.needed} FlashInfer modules the steps need compiled in {done.seconds:.0f} s (the rest were on disk)")
    sys.exit(EXIT_NOT_RUN if done.problem else EXIT_OK)


def _detectors(only: str | None) -> list[FindingClass]:
    """`--only` as detector kinds; an unknown one, or one that cannot be loaded, is bad input
    before any step runs."""
    from attndbg.checks.selection import parse_only
    from attndbg.checks.step import detectors_of
    from attndbg.detectors.registry import LoadError

    try:
        classes = parse_only(only)
        detectors_of(classes)
    except ValueError as e:
        raise BadInput(f"--only: {e}") from None
    except LoadError as e:
        raise BadInput(str(e)) from None
    return classes
