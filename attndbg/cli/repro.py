"""Commands that make a failure small and standalone: minimize (shrink a failing step) and repro (a
script calling only the kernel library).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from attndbg.cli import options
from attndbg.cli.common import BadInput, NotRunHere, check_outputs, handles_bad_input
from attndbg.cli.group import main
from attndbg.cli.options import parse_backend_options, parse_backends
from attndbg.cli.replay import data_layer
from attndbg.suggest import did_you_mean


@main.command()
@click.argument("trace", type=click.Path())
@options.backend("the one backend whose failure to keep", default="triton")
@click.option("--finding", "finding_spec", default=None, metavar="CLASS[/check]", help="the failure to keep: a detector's class (and check), backend-crash, or replay (the replay fails the float64 reference); default: the step's first crash, else its first defect, hazard, replay failure")
@options.output_file("the smallest step, as a trace file")
# Not options.jobs: check's workers each take steps of a recording (N or auto, sized by steps and
# cores); minimize's each check one candidate of one step, so it takes a number (default 2).
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=2, show_default=True, help="candidates checked at once, each in a fresh worker process")
@options.only("detectors the step's first check runs (as check --only; default: the --finding class's, else every default detector and the replay)")
@options.backend_option()
@handles_bad_input
def minimize(trace: str, backend_spec: str, finding_spec: str | None, output: str, jobs: int, only: str | None, backend_option_specs: tuple[str, ...]) -> None:
    """Shrink a failing step (requests, padded rows, heads, page size, draft tree, new tokens,
    cached columns) while it shows the same failure, of the same kind: a crash stays the same
    crash, a finding the same class and check.
    Each candidate is checked in a fresh worker process; a recorded plan keeps its mistakes.
    When the step's repro script reproduces (a crash, NaN or Inf, rows over tolerance), each
    smaller step's script must reproduce with the same symptom; a recorded engine output shrinks
    with the requests, heads and rows removed (cached columns, which it cannot follow, stay).

    \b
    Example:
      attndbg synth decode-mha heads=4:2 head_dim=16 kv_lens=5,20,33,9 --inject invariants:wrong-req-row -o bad.pt
      attndbg minimize bad.pt --backend triton --finding invariants/kv-index -o small.pt
    """
    from attndbg.detector_api.context import CheckOptions
    from attndbg.detector_api.findings import FindingClass
    from attndbg.detectors import registry as detectors
    from attndbg.minimize.search import MinimizeOptions, NothingToKeep, minimize as run_minimize
    from attndbg.minimize.target import REPLAY, parse_wanted
    from attndbg.report.minimize import render_outcome
    from attndbg.trace import io

    names = parse_backends(backend_spec)
    if len(names) != 1 or names[0] == "reference":
        raise BadInput(f"--backend {backend_spec}: minimize keeps one kernel backend's failure; name one (e.g. triton)")
    from attndbg.backends import registry

    unavailable = registry.create(names[0], options=parse_backend_options(backend_option_specs)).unavailable_reason()
    if unavailable:  # its failure cannot be shown here, let alone kept
        raise NotRunHere(f"minimize --backend {names[0]}: {names[0]} cannot run here ({unavailable})")
    wanted = parse_wanted(finding_spec)
    classes = [*detectors.names(), FindingClass.BACKEND_CRASH.value, REPLAY.value]
    if wanted[0] is not None and wanted[0] not in classes:
        raise BadInput(f"--finding: unknown class {wanted[0]!r}{did_you_mean(wanted[0], classes)}; classes: {', '.join(classes)}")
    detector_names = tuple(n.strip() for n in (only or "").split(",") if n.strip())
    if only is not None and not detector_names:
        raise BadInput(f"--only {only!r} names no detector; detectors: {', '.join(detectors.names())}, replay (leave --only out for the default ones)")
    unknown = [n for n in detector_names if n not in classes]
    if unknown:
        raise BadInput(f"--only: unknown detector {unknown[0]!r}{did_you_mean(unknown[0], classes)}; detectors: {', '.join(detectors.names())}, replay")
    check_outputs(output=output)
    io.load(trace)  # unreadable: bad input, before any worker starts
    options = MinimizeOptions(
        backend=names[0], wanted=wanted, jobs=jobs, only=detector_names, check=CheckOptions(backends=(names[0],), backend_options=parse_backend_options(backend_option_specs))
    )
    # The step's own repro script first: when it reproduces, every smaller step kept must too, with
    # the same symptom (a crash, NaN or Inf, rows over tolerance), not only the same finding.
    from attndbg.repro.symptom import probe_with_symptom, script_outcome

    script = script_outcome(trace, names[0])
    if script.symptom is not None:
        options = replace(options, probe=probe_with_symptom, symptom=script.symptom)
        click.echo(f"minimize: the step's repro reproduces ({script.describe()}): every smaller step's must too", err=True)
    else:
        click.echo(f"minimize: the step's repro does not reproduce here ({script.said}): only the finding is kept", err=True)
    try:
        outcome = run_minimize(trace, options, say=lambda line: click.echo(f"minimize: {line}", err=True))
    except NothingToKeep as e:
        raise BadInput(str(e)) from None
    io.save(outcome.trace, output)
    click.echo(render_outcome(outcome, names[0], output))


@main.command()
@click.argument("trace", type=click.Path(), metavar="TRACE|DIR")
@options.backend("the backend whose calls the script makes (triton, flashinfer, fa3 or mla)", default="triton")
@click.option("--step", "step_number", type=int, default=None, help="a recording's step, by its number (default: a file's only step; a DIR needs it)")
# Not replay's --plan (derived|recorded|both, default derived): a script makes one plan's calls,
# and a step that recorded this backend's plan is scripted with it unless told.
@click.option("--plan", "plan_source", type=click.Choice(["recorded", "derived"]), default=None, help="the plan the script runs (default: the recorded one when the trace holds one of this backend, else derived)")
@click.option("--graph/--eager", "graph", default=None, help="replay the step in a CUDA graph padded as the engine padded it (default for a step recorded as a graph replay), or run it eagerly")
@options.layer()
@options.backend_option()
@options.output_file("the script to write (its tensors go beside it as .pt when too large to embed)")
@handles_bad_input
def repro(
    trace: str, backend_spec: str, step_number: int | None, plan_source: str | None, graph: bool | None, layer: int | None, backend_option_specs: tuple[str, ...], output: str
) -> None:
    """Write a standalone script (torch and the kernel library only, no attndbg) that makes the
    library calls the adapter makes for one step and checks them against an inline float64
    reference: exit 1 when it reproduces, 0 when not. A step recorded as a CUDA-graph replay is
    scripted as one (the padded batch through the library's graph wrappers) unless --eager.

    \b
    Example:
      attndbg synth decode-mha heads=4:2 head_dim=16 kv_lens=5,20,33,9 --inject invariants:wrong-req-row -o bad.pt
      attndbg repro bad.pt --backend triton -o repro.py && python repro.py   # exit 1: reproduced
    """
    from attndbg.repro.script import Mode, build, write
    from attndbg.trace import io

    names = parse_backends(backend_spec)
    if len(names) != 1:
        raise BadInput(f"--backend {backend_spec}: a script calls one library; name one (triton, flashinfer, fa3 or mla)")
    check_outputs(output=output)
    path = _repro_step(trace, step_number)
    loaded = io.load(path)
    if loaded.merge is not None:
        raise BadInput(f"{path}: a merge step (trace.merge): repro scripts attention calls; replay it with --backend triton,flashinfer")
    chosen_layer, _ = data_layer(loaded, layer, str(path), single=True)
    try:
        mode = None if graph is None else Mode.GRAPH if graph else Mode.EAGER
        script = build(
            loaded, names[0], plan_source=plan_source, layer=chosen_layer, source_name=str(path), mode=mode, backend_options=parse_backend_options(backend_option_specs)
        )
    except (ValueError, NotImplementedError) as e:
        raise BadInput(f"{path}: {e}") from None
    written = write(script, output)
    where = "embedded" if script.embedded else f"in {written[-1]}"
    if script.note:
        click.echo(f"repro: {script.note}", err=True)
    click.echo(f"wrote {output} ({script.mode.value}, {script.plan_source} plan, tensors {where}): python {output} exits 1 when it reproduces, 0 when not")


def _repro_step(target: str, step_number: int | None) -> Path:
    """The step file `repro` writes a script for: TRACE itself, or step N of a recording DIR."""
    from attndbg.checks.selection import select_paths
    from attndbg.trace import io

    if not Path(target).is_dir():
        return Path(target)
    if step_number is None:
        raise BadInput(f"{target}: a recording; name the step with --step N")
    paths = select_paths(target)
    numbered = {e.step: Path(target) / e.file for e in io.read_manifest(target)} if (Path(target) / io.MANIFEST).exists() else dict(enumerate(paths))
    if step_number not in numbered:
        raise BadInput(f"{target}: --step {step_number} is not one of its steps ({min(numbered, default=0)}..{max(numbered, default=-1)})")
    return numbered[step_number]
