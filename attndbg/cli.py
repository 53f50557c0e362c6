"""`attndbg` command line: each command parses, calls one core function, renders, exits 0/1/2/3.

Exit codes: 0 all good, 1 a backend failed (or findings), 2 bad input (one line on stderr),
3 nothing failed but something asked for did not run (a backend named with --backend), 4 (record
only) the command exited 0 but a hook failed before any step was recorded.

Only click and rich are imported here: torch and the kernels load inside the commands that use
them, so `--version`, `--help` and `synth --list` answer at once.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from attndbg.trace.errors import TraceError
from attndbg.suggest import did_you_mean
from attndbg.trace.synth_spec import SpecError

F = TypeVar("F", bound=Callable[..., Any])
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
# Nothing failed, but something asked for did not run (a named backend unavailable, a step not checked).
EXIT_NOT_RUN = 3
# record: the command exited 0 but no step was recorded because a hook failed (named on stderr).
EXIT_NOT_RECORDED = 4


class BadInput(Exception):
    """Any user-input problem that is not a TraceError (unknown backend, bad option combination)."""


def _console(*, stderr: bool = False) -> Console:
    """The terminal's width; piped, $COLUMNS when set, else 160. `stderr` when stdout carries JSON."""
    stream = sys.stderr if stderr else sys.stdout
    piped_default = None if stream.isatty() or os.environ.get("COLUMNS", "").isdigit() else 160
    return Console(highlight=False, soft_wrap=False, width=piped_default, stderr=stderr)


def handles_bad_input(func: F) -> F:
    """Turn bad input into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (TraceError, SpecError, BadInput) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(EXIT_BAD_INPUT)

    return wrapper  # type: ignore[return-value]


def _backend_names(spec: str) -> list[str]:
    """--backend NAME[,NAME...] or all -> names; an unknown name is bad input."""
    from attndbg.backends import registry

    try:
        names = registry.resolve(spec)
    except KeyError as e:
        known = registry.backend_names()
        raise BadInput(f"--backend: unknown backend {e.args[0]!r}{did_you_mean(e.args[0], known)}; known: {', '.join(known)}") from None
    if not names:
        raise BadInput(f"--backend {spec!r}: names no backend; known: {', '.join(registry.backend_names())}, or all")
    return names


BACKEND_OPTION_HELP = "NAME.FIELD=VALUE, repeatable: a field of that backend's options, e.g. fa3.verify_path=two-call, flashinfer.extend_path=paged, mla.impl=flashmla, triton.num_kv_splits=1"


def _backend_options(specs: tuple[str, ...], num_kv_splits: int | None = None) -> Any:
    """--backend-option NAME.FIELD=VALUE... (and --num-kv-splits N, the same as
    triton.num_kv_splits=N) -> BackendOptions; what each backend takes is its options dataclass."""
    from attndbg.backends import options as backend_options

    if num_kv_splits is not None:
        if any(spec.strip().startswith("triton.num_kv_splits=") for spec in specs):
            raise BadInput("--num-kv-splits and --backend-option triton.num_kv_splits set the same thing: give one")
        specs = (*specs, f"triton.num_kv_splits={num_kv_splits}")
    try:
        return backend_options.parse(specs)
    except backend_options.OptionError as e:
        raise BadInput(str(e)) from None


def _write_json(path: str, data: Any) -> None:
    """Write `data` to `path`, or to stdout when `path` is "-"."""
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        click.echo(text, nl=False)
        return
    try:
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        raise BadInput(f"--json {path}: cannot write ({e.strerror or e})") from None


def _check_outputs(**paths: str | None) -> None:
    """Refuse an output file whose folder does not exist before a long run, not after it."""
    for option, path in paths.items():
        if path and path != "-" and not Path(path).absolute().parent.is_dir():
            raise BadInput(f"--{option.replace('_', '-')} {path}: the folder {Path(path).parent} does not exist")


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    """--version: one line naming the versions a bug report needs first, without importing torch."""
    if not value or ctx.resilient_parsing:
        return
    from attndbg.environment import version_line

    click.echo(version_line())
    ctx.exit()


class _Group(click.Group):
    """click's usage errors (unknown option, bad value) as one line on stderr and exit 2, like
    every other bad input, instead of click's usage block."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            code = super().main(*args, **kwargs)
        except getattr(click.exceptions, "NoArgsIsHelpError", ()) as e:  # bare `attndbg`: the help
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"error: {e.format_message()}{hint}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except click.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)  # as a shell reports SIGINT
        sys.exit(code if isinstance(code, int) else EXIT_OK)  # --help/--version return 0


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version, help="attndbg, Python, torch with its CUDA, triton and flashinfer versions, and exit (attndbg env: the whole report)")
def main() -> None:
    """Record, replay, diff and explain LLM attention backends.

    \b
    Example:
      attndbg synth verify -o verify.pt && attndbg replay verify.pt --backend triton
    """
    from attndbg.backends import environment
    from attndbg.detectors import registry as detectors

    # The environment is input too: one line, never a traceback.
    problem = environment.ENVIRONMENT.problem() or detectors.ENVIRONMENT.problem()
    if problem:
        click.echo(f"error: {problem}", err=True)
        sys.exit(EXIT_BAD_INPUT)


@main.command()
@click.argument("spec", nargs=-1)
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), help="trace file to write")
@click.option("--list", "list_presets", is_flag=True, help="list presets, spec keys and injectable mistakes")
@click.option("--inject", "inject_kind", default=None, metavar="KIND:MISTAKE", help="carry a realistic mistake a detector finds, e.g. tree-mask:bit-order (see --list)")
@handles_bad_input
def synth(spec: tuple[str, ...], output: str | None, list_presets: bool, inject_kind: str | None) -> None:
    """Build a trace from a spec: a preset, then key=value overrides.

    \b
    Example:
      attndbg synth decode-gqa kv_lens=1,33,2000 page_size=16 -o decode.pt
    """
    from attndbg.detectors import registry as detectors
    from attndbg.trace import synth_spec

    if list_presets:
        # Read from torch-free modules and the injections' source: listing is instant.
        click.echo(synth_spec.__doc__)
        for name, values in synth_spec.PRESETS.items():
            click.echo(f"  {name:16s} " + " ".join(f"{k}={v}" for k, v in values.items()))
        click.echo("\nInjectable mistakes (--inject KIND):")
        try:
            catalog = detectors.injection_catalog()
        except detectors.LoadError as e:
            raise BadInput(str(e)) from None
        for kind, doc in sorted(catalog.items()):
            click.echo(f"  {kind:32s} {doc}")
        return
    if not output:
        raise BadInput("synth: give -o FILE (or --list to see presets)")
    from attndbg.replay.plans import with_engine_plan
    from attndbg.trace import io, synth as synth_mod

    trace = with_engine_plan(synth_mod.build(synth_spec.parse_spec(spec)))
    for note in synth_spec.unused_keys(spec):
        click.echo(f"note: {note}", err=True)
    if inject_kind:
        try:
            trace = detectors.inject(trace, inject_kind)
        except KeyError:
            raise BadInput(f"--inject: unknown mistake {inject_kind!r}{_mistake_hint(inject_kind)}; see attndbg synth --list") from None
        except detectors.LoadError as e:
            raise BadInput(f"--inject {inject_kind}: {e}") from None
        except ValueError as e:
            raise BadInput(f"--inject {inject_kind}: {e}") from None
    io.save(trace, output)
    b = trace.batch
    click.echo(f"wrote {output}: {b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} kv_lens={b.kv_lens.tolist()[:8]}")


def _mistake_hint(kind: str) -> str:
    """The suggestion for a mistake typed wrong (`--inject bit-order`: tree-mask:bit-order), or ""."""
    from attndbg.detectors import registry as detectors

    try:
        return did_you_mean(kind, detectors.injection_catalog())
    except detectors.LoadError:  # a detector that cannot load has its own error elsewhere
        return ""


@main.command()
@click.argument("trace", type=click.Path())
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), help="also write the summary as JSON (attndbg.show/1; - for stdout)")
@handles_bad_input
def show(trace: str, json_path: str | None) -> None:
    """Summarise a trace: mode, batch, lengths, slots, plan, tree masks.

    \b
    Example:
      attndbg show traces/verify_tree.pt
    """
    from attndbg.report.show import render_trace, trace_to_json
    from attndbg.trace import io

    _check_outputs(json=json_path)
    loaded = io.load(trace)
    _console(stderr=json_path == "-").print(render_trace(loaded, trace))
    if json_path:
        _write_json(json_path, trace_to_json(loaded, trace))


@main.command()
@click.argument("trace", type=click.Path(), metavar="TRACE|DIR")
@click.option("--backend", "backend_spec", default="triton", show_default=True, help="NAME[,NAME...] or all (all skips, and names, what cannot run here)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), help="also write the results as JSON (attndbg.replay/1; - for stdout)")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), help="keep outputs for `attndbg diff`")
@click.option("--layer", type=int, default=None, help="use this recorded layer's tensors (default: the first recorded layer, else seeded data)")
@click.option("--num-kv-splits", type=click.IntRange(min=1), default=None, help="force split-KV count (triton, decode steps); the same as --backend-option triton.num_kv_splits=N")
@click.option("--backend-option", "backend_option_specs", multiple=True, metavar="NAME.FIELD=VALUE", help=BACKEND_OPTION_HELP)
@click.option("--plan", "plan_source", type=click.Choice(["derived", "recorded", "both"]), default="derived", show_default=True, help="run the plan derived from the batch, the one the engine recorded, or both")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="eager runs per backend; any bit difference between them fails")
@click.option("--cuda-graph", is_flag=True, help="also replay inside a real CUDA graph, padded as engines pad")
@click.option("--capture-bs", type=click.IntRange(min=1), default=None, help="graph capture batch size (with --cuda-graph; default: next SGLang size above the batch)")
@click.option("--fill-value", type=click.IntRange(min=0), default=None, help="seq_len of padded rows (with --cuda-graph; default: each backend's own)")
@click.option("--max-memory", "max_memory_spec", default=None, metavar="SIZE", help="refuse (exit 2) a step whose data would need more than SIZE, e.g. 8G or 512M (default: what the device has free)")
@handles_bad_input
def replay(
    trace: str,
    backend_spec: str,
    json_path: str | None,
    save_path: str | None,
    layer: int | None,
    num_kv_splits: int | None,
    backend_option_specs: tuple[str, ...],
    plan_source: str,
    repeat: int,
    cuda_graph: bool,
    capture_bs: int | None,
    fill_value: int | None,
    max_memory_spec: str | None,
) -> None:
    """Replay a step (or every step of a folder) through real kernels and compare each backend
    with a float64 reference.

    Exit 0 when every backend compared passed, 1 when any failed, 2 on bad input, 3 when a
    backend named with --backend could not run here (nothing of it was compared).

    \b
    Examples:
      attndbg replay traces/decode_gqa.pt --backend triton,reference --json out.json
      attndbg replay rec --backend all --json - | jq .verdict
      attndbg replay traces/verify_tree.pt --backend fa3 --backend-option fa3.verify_path=two-call
    """
    names = _backend_names(backend_spec)
    backend_options = _backend_options(backend_option_specs, num_kv_splits)
    max_memory = _max_memory(max_memory_spec)
    _check_outputs(json=json_path, save=save_path)
    if not cuda_graph:
        for flag, value in (("--capture-bs", capture_bs), ("--fill-value", fill_value)):
            if value is not None:
                raise BadInput(f"{flag} shapes the CUDA-graph replay: add --cuda-graph, or drop {flag}")
    from attndbg import machine
    from attndbg.trace import io

    paths = io.trace_paths(trace)
    if save_path and len(paths) != 1:
        raise BadInput("--save takes a single step file, not a recording directory")
    if cuda_graph and not machine.cuda_available():
        raise BadInput("--cuda-graph needs a CUDA GPU, and this machine has none")

    from rich.text import Text

    from attndbg.replay import activity
    from attndbg.replay.runner import PlanSource, ReplayOptions, replay as run_replay
    from attndbg.report.progress import StepProgress
    from attndbg.report.replay import StepReport, overall, render_replay, replay_to_json, step_to_json, verdict_line

    options = ReplayOptions(
        backend_options=backend_options,
        plan=PlanSource(plan_source),
        repeat=repeat,
        cuda_graph=cuda_graph,
        capture_bs=capture_bs,
        fill_value=fill_value,
        max_memory=max_memory,
    )
    named = () if backend_spec.strip() == "all" else tuple(names)
    console = _console(stderr=json_path == "-")
    steps = []  # each step's JSON only: a folder's tensors are not held until the end
    with StepProgress(len(paths), "replaying") as progress:
        for number, path in enumerate(paths, start=1):
            loaded = io.load(path)
            step_layer, notes = _data_layer(loaded, layer, str(path), single=len(paths) == 1)
            notes += _ignored_options(loaded, names, backend_options, num_kv_splits_flag=num_kv_splits is not None)
            progress.show(f"{number}/{len(paths)} {path}: {', '.join(names)}")
            try:
                result = run_replay(loaded, str(path), names, replace(options, layer=step_layer))
            except activity.CudaContextLost as e:  # nothing runs on the GPU again in this process
                progress.print(console, Text(f"{path}: {e}; replay stopped here (this process's CUDA context cannot be recovered)", style="red"))
                sys.exit(EXIT_FAILED)
            step = StepReport(result=result, layer=step_layer, repeat=repeat, named=named, notes=tuple(notes))
            progress.print(console, render_replay(step))
            steps.append(step_to_json(step))
    console.print(verdict_line(steps), soft_wrap=True)  # one line whatever the width: logs grep it
    if json_path:
        _write_json(json_path, replay_to_json(steps))
    if save_path:  # a single step (checked above): `result` is its
        _save_replay(save_path, str(paths[0]), result)
    sys.exit(_EXIT_BY_VERDICT[overall(steps).value])


# Verdict (report.replay.Verdict, by value) -> exit code.
_EXIT_BY_VERDICT = {"passed": EXIT_OK, "failed": EXIT_FAILED, "incomplete": EXIT_NOT_RUN}


def _data_layer(trace: Any, layer: int | None, path: str, *, single: bool) -> tuple[int | None, list[str]]:
    """Which recorded layer's tensors to replay: --layer, else the first recorded one, else none
    (seeded data). A step without the layer asked for is bad input alone, a note in a folder."""
    recorded = sorted(trace.tensors)
    if layer is None:
        return (recorded[0] if recorded else None), []
    if layer in recorded:
        return layer, []
    has = f"has {recorded}" if recorded else "has no recorded tensors"
    if single:
        raise BadInput(f"--layer {layer}: {path} has no tensors for that layer ({has})")
    return None, [f"--layer {layer}: this step {has}; replayed with seeded data"]


def _ignored_options(trace: Any, names: list[str], backend_options: Any, *, num_kv_splits_flag: bool) -> list[str]:
    """Options given that cannot change this step's result, said rather than silently ignored."""
    from attndbg.trace.schema import ForwardMode

    notes = []
    for name, _ in backend_options.chosen:
        if name in names:
            continue
        if name == "triton" and num_kv_splits_flag:
            notes.append("--num-kv-splits sets the triton backend's split count; triton is not among the backends run")
        else:
            notes.append(f"--backend-option {name}.*: sets the {name} backend's options; {name} is not among the backends run")
    triton = backend_options.of("triton")
    if triton is not None and triton.num_kv_splits is not None and "triton" in names and trace.batch.forward_mode is not ForwardMode.DECODE:
        notes.append(f"--num-kv-splits: only decode steps split the KV; this {trace.batch.forward_mode.value} step has no splits")
    return notes


def _save_replay(path: str, trace_file: str, result: Any) -> None:
    import hashlib

    from attndbg.compare.saved import REFERENCE, save_replay
    from attndbg.replay.variants import Eager

    outputs = {REFERENCE: (result.reference.output, result.reference.lse)}
    for r in result.runs:
        if r.result is not None:
            key = r.name if isinstance(r.variant, Eager) else f"{r.name}[{r.variant.label}]"
            outputs[key] = (r.result.output, r.result.lse)
    digest = hashlib.sha256(Path(trace_file).read_bytes()).hexdigest()
    save_replay(path, trace_file=trace_file, qo_indptr=result.trace.batch.qo_indptr, results=outputs, trace_digest=digest)


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), help="also write the differences as JSON (attndbg.diff/1; - for stdout)")
@click.option("--pair", "pairs", multiple=True, help="saved replays only: compare backend X of A with Y of B (X:Y)")
@handles_bad_input
def diff(a: str, b: str, json_path: str | None, pairs: tuple[str, ...]) -> None:
    """Show what differs between two traces, two recordings (folders, step by step), or two saved
    replays (--save files).

    Exit 0 when nothing differs, 1 when something does, 2 on bad input.

    \b
    Examples:
      attndbg diff engine_step.pt synth_step.pt
      attndbg diff rec_a rec_b
      attndbg diff run_a.replay run_b.replay --pair triton:triton
    """
    from attndbg.compare.saved import is_saved_replay

    _check_outputs(json=json_path)
    console = _console(stderr=json_path == "-")
    a_dir, b_dir = Path(a).is_dir(), Path(b).is_dir()
    a_saved, b_saved = (not a_dir and is_saved_replay(a)), (not b_dir and is_saved_replay(b))
    kinds = {a: "a folder" if a_dir else "a saved replay" if a_saved else "a trace", b: "a folder" if b_dir else "a saved replay" if b_saved else "a trace"}
    if (a_dir, a_saved) != (b_dir, b_saved):
        raise BadInput(f"diff: {a} is {kinds[a]} and {b} is {kinds[b]}: give two traces, two recordings or two saved replays")
    if pairs and not a_saved:
        raise BadInput(f"--pair compares backends of two saved replays (`attndbg replay --save FILE`); {a} and {b} are {kinds[a].split(' ', 1)[1]}s")
    if a_saved:
        data, differs = _diff_saved(console, a, b, pairs)
    elif a_dir:
        from attndbg.compare.recording_diff import diff_recordings
        from attndbg.report.diff import recording_diff_to_json, render_recording_diff

        result = diff_recordings(a, b)
        console.print(render_recording_diff(result))
        data, differs = recording_diff_to_json(result), result.differs
    else:
        from attndbg.compare.trace_diff import diff_traces
        from attndbg.report.diff import render_trace_diff, trace_diff_to_json
        from attndbg.trace import io

        result = diff_traces(io.load(a), io.load(b))
        console.print(render_trace_diff(result))
        data, differs = trace_diff_to_json(result), result.differs
    if json_path:
        _write_json(json_path, data)
    sys.exit(EXIT_FAILED if differs else EXIT_OK)


def _diff_saved(console: Console, a: str, b: str, pairs: tuple[str, ...]) -> tuple[dict[str, Any], bool]:
    """Two saved replays: refuse pairs naming absent backends and replays of different traces."""
    from attndbg.compare.replay_diff import diff_replays, different_traces
    from attndbg.compare.saved import load_replay
    from attndbg.report.diff import render_replay_diff, replay_diff_to_json

    ra, rb = load_replay(a), load_replay(b)
    pair_list = [tuple(p.split(":", 1)) for p in pairs] or None
    for pair in pair_list or ():
        if len(pair) != 2 or not all(pair):
            raise BadInput(f"--pair: expected BACKEND_A:BACKEND_B (e.g. triton:reference), got {':'.join(pair)!r}")
        for name, side, path in ((pair[0], ra, a), (pair[1], rb, b)):
            if name not in side.results:
                raise BadInput(f"--pair {pair[0]}:{pair[1]}: {path} has no {name!r} (it has {', '.join(side.results)})")
    why = different_traces(ra, rb)
    if why:
        raise BadInput(f"diff: {a} and {b} are replays of different traces ({why}); diff replays of one trace")
    result = diff_replays(ra, rb, pairs=pair_list)
    console.print(render_replay_diff(result))
    return replay_diff_to_json(result), result.differs


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
@click.option("--only", default=None, metavar="KIND[,KIND...]", help="detectors to run, by kind (listed below; default: all but the opt-in ones, which run only when named here)")
@click.option("--backend", "backend_spec", default=None, help="kernel backends the detectors may use (default: all that run here)")
@click.option("--cuda-graph", is_flag=True, help="detectors also replay under CUDA graphs (GPU)")
@click.option("--steps", "steps_spec", default=None, help="only steps A <= step < B of a recording (A:B, A:, :B)")
@click.option("--sample", type=click.IntRange(min=1), default=None, help="only N steps, evenly spread over the (selected) recording")
@click.option("--jobs", "-j", "jobs_spec", default="auto", show_default=True, help="worker processes checking steps in parallel, or auto: one per 50 steps, per 2 cores, at most 8 per GPU (each worker loads every kernel module itself)")
@click.option("--devices", "devices_spec", default=None, help="GPUs for the workers, e.g. 0,1 (default: every visible GPU)")
@click.option("--in-process", is_flag=True, help="check in this process, even on a GPU (where worker processes are the default: a crashing kernel then costs only its step); here a CUDA fault is the step's backend-crash finding and the steps after it are not checked, the context being unrecoverable")
@click.option("--max-memory", "max_memory_spec", default=None, metavar="SIZE", help="do not check a step (one file: exit 2) whose data would need more than SIZE, e.g. 8G or 512M (default: what the device has free)")
@click.option("--backend-option", "backend_option_specs", multiple=True, metavar="NAME.FIELD=VALUE", help=BACKEND_OPTION_HELP)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), help="also write the findings as JSON (attndbg.check/1; - for stdout)")
@click.option("--strict", is_flag=True, help="hazards fail the check too (exit 1): findings correct on this step, wrong under the condition each states")
@click.option("--compile-first", is_flag=True, help="on a GPU, first compile the FlashInfer modules of every kernel shape in the recording, all at once (as `attndbg compile`; shapes whose modules are built are skipped)")
@handles_bad_input
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
    compile_first: bool,
) -> None:
    """Run the detectors on a step or a recording directory and explain what they find.

    Exit 0 when clean or with hazards only (findings right on this step, wrong under the condition
    each states; --strict: 1), 1 with defects, 2 on bad input, 3 when a backend named with --backend
    could not run here (or a step could not be checked) and nothing failed.

    \b
    Examples:
      attndbg check traces/verify_tree.pt
      attndbg synth verify --inject tree-mask:bit-order -o bad.pt && attndbg check bad.pt --only tree-mask
      attndbg check rec --jobs 8 --steps 100:200 --backend triton,flashinfer
    """
    from attndbg import machine
    from attndbg.checks.run import check_steps, detectors_of, parse_only, select_paths
    from attndbg.detector_api.context import CheckOptions
    from attndbg.detectors.registry import LoadError
    from attndbg.report.checks import check_verdict, checks_to_json, render_step, render_summary
    from attndbg.report.progress import CheckProgress
    from rich.text import Text
    from attndbg.trace import io

    try:
        classes = parse_only(only)
        detectors_of(classes)  # one that cannot be loaded is bad input, before any step runs
    except ValueError as e:
        raise BadInput(f"--only: {e}") from None
    except LoadError as e:
        raise BadInput(str(e)) from None
    names = tuple(_backend_names(backend_spec)) if backend_spec else None
    backend_options = _backend_options(backend_option_specs)
    if cuda_graph and not machine.cuda_available():
        raise BadInput("--cuda-graph needs a CUDA GPU, and this machine has none")
    selection = _step_selection(steps_spec, sample)
    max_memory = _max_memory(max_memory_spec)
    devices = _devices(devices_spec)
    jobs = _jobs(jobs_spec)
    if in_process and jobs not in (None, 1):
        raise BadInput(f"--in-process checks in one process: it cannot take --jobs {jobs}")
    _check_outputs(json=json_path)
    options = CheckOptions(backends=names, cuda_graph=cuda_graph, max_memory=max_memory, backend_options=backend_options)
    console = _console(stderr=json_path == "-")
    if not Path(target).is_dir():
        io.load(target)  # one file: unreadable is bad input (exit 2); in a recording it is one step's error
    paths = select_paths(target, selection)
    if not paths:
        raise BadInput(f"{target}: no steps to check" + (" in the selection (--steps/--sample)" if steps_spec or sample else ""))
    reports = []
    with CheckProgress(paths) as progress:  # on stderr, only on a terminal
        for report in check_steps(target, classes, options, progress.done, selection=selection, jobs=1 if in_process else jobs, devices=devices, isolate=False if in_process else None, now=progress.now, compile_first=compile_first):
            reports.append(report)
            single_error = len(paths) == 1 and report.bad_input  # raised as bad input below
            if (report.findings or report.error or len(paths) == 1) and not single_error:
                progress.print(console, render_step(report))
    if len(paths) == 1 and not Path(target).is_dir() and reports and reports[0].bad_input:
        raise BadInput(f"{target}: {reports[0].error}")  # one file that cannot be checked here is bad input
    if len(paths) > 1:
        console.print(render_summary(reports))
    verdict = check_verdict(reports, classes, names, backend_options, selection=_selection_note(target, paths, steps_spec, sample))
    console.print(Text(verdict.line), soft_wrap=True)  # one line whatever the width (logs grep it), never markup
    if json_path:
        _write_json(json_path, checks_to_json(reports, verdict))
    if verdict.defects or (strict and verdict.hazards):
        sys.exit(EXIT_FAILED)
    sys.exit(EXIT_NOT_RUN if verdict.incomplete else EXIT_OK)


def _selection_note(target: str, paths: list[Path], steps_spec: str | None, sample: int | None) -> Any:
    """For the verdict under --steps/--sample: which steps (by the numbers the selection counts:
    the manifest's, else file order) of how many."""
    from attndbg.report.checks import Selection
    from attndbg.trace import io

    flags = " ".join(flag for flag in (f"--steps {steps_spec}" if steps_spec else "", f"--sample {sample}" if sample else "") if flag)
    if not flags:
        return None
    if Path(target).is_dir() and (Path(target) / io.MANIFEST).exists():
        numbers = {Path(target) / e.file: e.step for e in io.read_manifest(target)}
    else:
        numbers = {path: i for i, path in enumerate(io.trace_paths(target))}
    return Selection(recording_steps=len(numbers), steps=tuple(numbers[p] for p in paths if p in numbers), options=flags)


@main.command("compile")
@click.argument("target", type=click.Path())
@click.option("--only", default=None, metavar="KIND[,KIND...]", help="the detectors check will run (their kernels are compiled too)")
@click.option("--backend", "backend_spec", default=None, help="kernel backends check will use (default: all that run here)")
@click.option("--steps", "steps_spec", default=None, help="only steps A <= step < B of a recording (A:B, A:, :B)")
@handles_bad_input
def compile_kernels(target: str, only: str | None, backend_spec: str | None, steps_spec: str | None) -> None:
    """Compile the kernels a recording's steps need (one step of each kernel shape), all at once.

    What `check --compile-first` does before its first step; on its own it warms a fresh machine. Exit 0
    when done, 3 when nothing could be compiled here (no CUDA GPU, no FlashInfer) or the phase ended
    early.
    """
    from attndbg import machine
    from attndbg.checks.precompile import precompile
    from attndbg.checks.run import detectors_of, parse_only, select_paths
    from attndbg.detector_api.context import CheckOptions

    try:
        classes = parse_only(only)
        detectors_of(classes)
    except ValueError as e:
        raise BadInput(f"--only: {e}") from None
    paths = select_paths(target, _step_selection(steps_spec, None))
    if not paths:
        raise BadInput(f"{target}: no steps")
    if not machine.cuda_available():
        click.echo("attndbg compile: nothing compiled: no CUDA GPU here (Triton runs interpreted; FlashInfer needs a GPU)")
        sys.exit(EXIT_NOT_RUN)
    names = tuple(_backend_names(backend_spec)) if backend_spec else None
    done = precompile(paths, classes, CheckOptions(backends=names))
    if done is None:
        click.echo("attndbg compile: nothing to compile: no FlashInfer here, or every kernel shape's modules are already built")
        sys.exit(EXIT_OK)
    click.echo(f"attndbg compile: {done.modules} module{'s' * (done.modules != 1)} compiled for {done.shapes} kernel shape{'s' * (done.shapes != 1)} in {done.seconds:.0f} s")
    sys.exit(EXIT_NOT_RUN if done.problem else EXIT_OK)


def _step_selection(steps_spec: str | None, sample: int | None) -> Any:
    from attndbg.checks.run import StepSelection
    from attndbg.record.options import OptionError, parse_steps

    start = stop = None
    if steps_spec:
        try:
            start, stop = parse_steps(steps_spec)
        except OptionError as e:
            raise BadInput(str(e)) from None
    return StepSelection(start=start, stop=stop, sample=sample)


def _max_memory(spec: str | None) -> int | None:
    """--max-memory 8G -> bytes; None: bounded by what the device has free."""
    from attndbg.record.options import OptionError, parse_size

    if spec is None:
        return None
    try:
        return parse_size(spec, "--max-memory")
    except OptionError as e:
        raise BadInput(str(e)) from None


def _jobs(spec: str) -> int | None:
    """--jobs N (N >= 1) or auto (None)."""
    if spec.strip().lower() == "auto":
        return None
    try:
        jobs = int(spec)
    except ValueError:
        raise BadInput(f"--jobs: expected a number of worker processes or auto, got {spec!r}") from None
    if jobs < 1:
        raise BadInput(f"--jobs: expected at least 1, got {jobs}")
    return jobs


def _devices(spec: str | None) -> tuple[int, ...] | None:
    """--devices 0,1 -> (0, 1); default: every visible GPU (None without one)."""
    from attndbg import machine

    if spec is None:
        if not machine.cuda_available():
            return None
        import torch

        return tuple(range(torch.cuda.device_count()))
    try:
        devices = tuple(int(d) for d in spec.split(",") if d.strip())
    except ValueError:
        raise BadInput(f"--devices: expected comma-separated GPU numbers such as 0,1, got {spec!r}") from None
    if not devices or min(devices) < 0:
        raise BadInput(f"--devices: expected comma-separated GPU numbers such as 0,1, got {spec!r}")
    return devices


@main.command()
@click.argument("trace", type=click.Path())
@click.option("--backend", "backend_spec", default="triton", show_default=True, help="the one backend whose failure to keep")
@click.option("--finding", "finding_spec", default=None, metavar="CLASS[/check]", help="the failure to keep: a detector's class (and check), backend-crash, or replay (the replay fails the float64 reference); default: the step's first crash, else its first defect, hazard, replay failure")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="the smallest step, as a trace file")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=2, show_default=True, help="candidates checked at once, each in a fresh worker process")
@click.option("--only", default=None, metavar="KIND[,KIND...]", help="detectors the step's first check runs (as check --only; default: the --finding class's, else every default detector and the replay)")
@click.option("--backend-option", "backend_option_specs", multiple=True, metavar="NAME.FIELD=VALUE", help=BACKEND_OPTION_HELP)
@handles_bad_input
def minimize(trace: str, backend_spec: str, finding_spec: str | None, output: str, jobs: int, only: str | None, backend_option_specs: tuple[str, ...]) -> None:
    """Shrink a failing step (requests, padded rows, heads, cached columns) while it shows the same
    failure, of the same kind: a crash stays the same crash, a finding the same class and check.
    Each candidate is checked in a fresh worker process; a recorded plan keeps its mistakes.

    \b
    Example:
      attndbg synth decode-gqa --inject invariants:wrong-req-row -o bad.pt
      attndbg minimize bad.pt --backend triton --finding invariants/kv-index -o small.pt
    """
    from attndbg.detector_api.context import CheckOptions
    from attndbg.detector_api.findings import FindingClass
    from attndbg.detectors import registry as detectors
    from attndbg.minimize.search import MinimizeOptions, NothingToKeep, minimize as run_minimize
    from attndbg.minimize.target import REPLAY, parse_wanted
    from attndbg.report.minimize import render_outcome
    from attndbg.trace import io

    names = _backend_names(backend_spec)
    if len(names) != 1 or names[0] == "reference":
        raise BadInput(f"--backend {backend_spec}: minimize keeps one kernel backend's failure; name one (e.g. triton)")
    wanted = parse_wanted(finding_spec)
    classes = [*detectors.names(), FindingClass.BACKEND_CRASH.value, REPLAY.value]
    if wanted[0] is not None and wanted[0] not in classes:
        raise BadInput(f"--finding: unknown class {wanted[0]!r}{did_you_mean(wanted[0], classes)}; classes: {', '.join(classes)}")
    detector_names = tuple(n.strip() for n in (only or "").split(",") if n.strip())
    unknown = [n for n in detector_names if n not in classes]
    if unknown:
        raise BadInput(f"--only: unknown detector {unknown[0]!r}{did_you_mean(unknown[0], classes)}; detectors: {', '.join(detectors.names())}, replay")
    _check_outputs(output=output)
    io.load(trace)  # unreadable: bad input, before any worker starts
    options = MinimizeOptions(
        backend=names[0], wanted=wanted, jobs=jobs, only=detector_names, check=CheckOptions(backends=(names[0],), backend_options=_backend_options(backend_option_specs))
    )
    try:
        outcome = run_minimize(trace, options, say=lambda line: click.echo(f"minimize: {line}", err=True))
    except NothingToKeep as e:
        raise BadInput(str(e)) from None
    io.save(outcome.trace, output)
    click.echo(render_outcome(outcome, names[0], output))


@main.command()
@click.argument("trace", type=click.Path(), metavar="TRACE|DIR")
@click.option("--backend", "backend_spec", default="triton", show_default=True, help="the backend whose calls the script makes (triton or flashinfer)")
@click.option("--step", "step_number", type=int, default=None, help="a recording's step, by its number (default: a file's only step; a DIR needs it)")
@click.option("--plan", "plan_source", type=click.Choice(["recorded", "derived"]), default=None, help="the plan the script runs (default: the recorded one when the trace holds one of this backend, else derived)")
@click.option("--layer", type=int, default=None, help="use this recorded layer's tensors (default: the first recorded layer, else seeded data)")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="the script to write (its tensors go beside it as .pt when too large to embed)")
@handles_bad_input
def repro(trace: str, backend_spec: str, step_number: int | None, plan_source: str | None, layer: int | None, output: str) -> None:
    """Write a standalone script (torch and the kernel library only, no attndbg) that makes the
    library calls the adapter makes for one step and checks them against an inline float64
    reference: exit 1 when it reproduces, 0 when not.

    \b
    Example:
      attndbg synth decode-mha --inject invariants:wrong-req-row -o bad.pt
      attndbg repro bad.pt --backend triton -o repro.py && python repro.py
    """
    from attndbg.repro.script import build, write
    from attndbg.trace import io

    names = _backend_names(backend_spec)
    if len(names) != 1:
        raise BadInput(f"--backend {backend_spec}: a script calls one library; name one (triton or flashinfer)")
    _check_outputs(output=output)
    path = _repro_step(trace, step_number)
    loaded = io.load(path)
    chosen_layer, _ = _data_layer(loaded, layer, str(path), single=True)
    try:
        script = build(loaded, names[0], plan_source=plan_source, layer=chosen_layer, source_name=str(path))
    except (ValueError, NotImplementedError) as e:
        raise BadInput(f"{path}: {e}") from None
    written = write(script, output)
    where = "embedded" if script.embedded else f"in {written[-1]}"
    click.echo(f"wrote {output} ({script.plan_source} plan, tensors {where}): python {output} exits 1 when it reproduces, 0 when not")


def _repro_step(target: str, step_number: int | None) -> Path:
    """The step file `repro` writes a script for: TRACE itself, or step N of a recording DIR."""
    from attndbg.checks.run import select_paths
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


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-o", "--output", "out_dir", default="recording", show_default=True, type=click.Path(file_okay=False), help="recording directory (manifest.jsonl + one .pt per step)")
@click.option("--append", is_flag=True, help="add this run's steps to an existing recording (files named run<N>_step_*.pt)")
@click.option("--overwrite", is_flag=True, help="replace an existing recording in the directory")
@click.option("--every", type=click.IntRange(min=1), default=1, show_default=True, help="record every N-th step")
@click.option("--steps", default=None, help="record only steps A <= step < B (A:B, A:, :B)")
@click.option("--layers", default=None, help="also record real tensors (q, new k/v, KV rows read, output) of these layers, e.g. 0,5")
@click.option("--max-size", default="2G", show_default=True, help="stop recording (not the engine) when the directory holds this much")
@click.option("--engine", "engines", default="transformers,sglang,vllm", show_default=True, help="engines to hook")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@handles_bad_input
def record(
    out_dir: str,
    append: bool,
    overwrite: bool,
    every: int,
    steps: str | None,
    layers: str | None,
    max_size: str,
    engines: str,
    command: tuple[str, ...],
) -> None:
    """Run an engine command with recording hooks and write each step as a trace.

    Hooks are armed in every Python process the command starts (schedulers, workers); a hook that
    fails logs one line and stops recording, the engine goes on. A directory that already holds
    files is refused unless --append or --overwrite. Exit code: the command's, or 4 when it exited 0
    but no step was recorded because a hook failed (the hook and its error are named).

    \b
    Examples:
      attndbg record -o rec -- python -m sglang.launch_server --model-path ...
      attndbg record -o rec --layers 0 --steps 0:20 -- python my_generate.py
      attndbg check rec && attndbg replay rec/step_000003.pt --backend all
    """
    from attndbg.record.launch import missing_layers, prepare_directory, run_recorded
    from attndbg.record.options import OptionError, RecordOptions, parse_layers, parse_size, parse_steps

    known = ("transformers", "sglang", "vllm")
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = [e for e in chosen if e not in known]
    if unknown or not chosen:
        hint = did_you_mean(unknown[0], known) if unknown else ""
        raise BadInput(f"--engine: unknown engine {unknown[0] if unknown else engines!r}{hint}; known: {', '.join(known)}")
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise BadInput("record: no command given (attndbg record [OPTIONS] -- COMMAND ...)")
    try:
        first, last = parse_steps(steps)
        chosen_layers, max_bytes = parse_layers(layers), parse_size(max_size)
        # Last: --overwrite deletes the earlier recording, only once every option is known good.
        prefix = prepare_directory(out_dir, append=append, overwrite=overwrite)
        options = RecordOptions(
            out_dir=out_dir, every=every, first_step=first, last_step=last, layers=chosen_layers, max_bytes=max_bytes, engines=chosen, file_prefix=prefix
        )
    except OptionError as e:
        raise BadInput(str(e)) from None
    try:
        result = run_recorded(list(command), options)
    except FileNotFoundError:
        raise BadInput(f"record: command not found: {command[0]}") from None
    modes = sorted({e.mode for e in result.entries})
    click.echo(f"attndbg record: {len(result.entries)} step(s) in {result.out_dir} ({', '.join(modes) or 'no steps'}); command exited {result.exit_code}", err=True)
    never = missing_layers(options, result.entries)
    if never:
        click.echo(f"attndbg record: note: --layers {','.join(map(str, never))}: no step recorded tensors of these layers (does the model have that many layers?)", err=True)
    if result.problems:
        more = f" (and {len(result.problems) - 1} more process(es) stopped)" if len(result.problems) > 1 else ""
        what = "no step recorded" if not result.entries else "recording stopped early"
        click.echo(f"attndbg record: {what}: {result.problems[0]}{more}", err=True)
    sys.exit(EXIT_NOT_RECORDED if result.hook_failed_before_any_step else result.exit_code)


@main.command()
@click.argument("trace", type=click.Path())
@click.option("--backend", "backend_spec", default="triton", show_default=True, help="NAME[,NAME...] or all")
@click.option("--samples", type=click.IntRange(min=3), default=30, show_default=True, help="timed samples (median reported)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), help="also write the timings as JSON (attndbg.bench/1; - for stdout)")
@handles_bad_input
def bench(trace: str, backend_spec: str, samples: int, json_path: str | None) -> None:
    """Time each backend on a trace over CUDA-graph replays; bandwidth against the device's copy peak.

    Exit 0 when every backend was timed, 2 on bad input (or no GPU), 3 when a backend named with
    --backend could not be timed here.

    \b
    Example:
      attndbg bench traces/decode_gqa.pt --backend triton,flashinfer
    """
    names = _backend_names(backend_spec)  # a typo is reported before the GPU is looked for
    _check_outputs(json=json_path)
    from attndbg import machine
    from attndbg.trace import io

    loaded = io.load(trace)
    if not machine.cuda_available():
        raise BadInput("bench times CUDA-graph replays and needs a CUDA GPU, and this machine has none (attndbg replay runs on a CPU)")
    from attndbg.backends import registry
    from attndbg.replay.data import build_inputs, to_device
    from attndbg.replay.timing import copy_bandwidth_gbps, time_backend
    from attndbg.report.bench import BenchResult, Timed, bench_to_json, render_bench

    inputs = build_inputs(loaded)
    peak = copy_bandwidth_gbps()
    timed, skipped = [], []
    for name in names:
        backend = registry.create(name)
        reason = backend.unavailable_reason() or backend.unsupported_reason(loaded) or backend.graph_unsupported_reason(loaded)
        if reason:
            skipped.append((name, reason))
            continue
        timing = time_backend(backend, loaded, to_device(inputs, backend.device()), samples=samples)
        timed.append(Timed(timing=timing, description=backend.describe()))
    result = BenchResult(
        trace_path=trace,
        mode=loaded.batch.forward_mode.value,
        batch_size=loaded.batch.batch_size,
        copy_gbps=peak,
        timed=tuple(timed),
        skipped=tuple(skipped),
        named=() if backend_spec.strip() == "all" else tuple(names),
    )
    _console(stderr=json_path == "-").print(render_bench(result))
    if json_path:
        _write_json(json_path, bench_to_json(result))
    sys.exit(EXIT_NOT_RUN if result.incomplete else EXIT_OK)


@main.command()
@click.option("--capabilities", "show_capabilities", is_flag=True, help="also what each backend declares it can run")
@click.option("--json", "json_path", is_flag=False, flag_value="-", default=None, type=click.Path(dir_okay=False, allow_dash=True), help="write each backend's status and capabilities as JSON (attndbg.backends/1) to FILE, or to stdout when no FILE is given")
@handles_bad_input
def backends(show_capabilities: bool, json_path: str | None) -> None:
    """List the backends and whether each can run here (and exactly why not).

    \b
    Example:
      attndbg backends --capabilities
    """
    _check_outputs(json=json_path)
    from attndbg.backends import registry
    from attndbg.report.backends import backend_status, backends_to_json, render_backends

    statuses = [backend_status(name, registry.create(name)) for name in registry.backend_names()]
    if json_path != "-":
        _console().print(render_backends(statuses, capabilities=show_capabilities))
    if json_path:
        _write_json(json_path, backends_to_json(statuses))


@main.command()
@click.option("--json", "json_path", is_flag=False, flag_value="-", default=None, type=click.Path(dir_okay=False, allow_dash=True), help="write the report as JSON (attndbg.env/1) to FILE, or to stdout when no FILE is given")
@handles_bad_input
def env(json_path: str | None) -> None:
    """Report versions, GPUs and JIT caches: paste the output into a bug report.

    attndbg, Python, torch and its CUDA, triton, flashinfer, nvtx, SGLang / vLLM / transformers when
    installed (read from package metadata: no engine is imported), each GPU with its compute
    capability, the NVIDIA driver, the Triton and FlashInfer JIT caches with their sizes, and
    TRITON_INTERPRET.

    \b
    Example:
      attndbg env
      attndbg env --json env.json
    """
    _check_outputs(json=json_path)
    from attndbg import environment

    report = environment.collect()
    if json_path != "-":
        click.echo(environment.render(report))
    if json_path:
        _write_json(json_path, environment.to_json(report))


# --- import / export (attndbg/interop): other tools' evidence as recordings, and back -----------


@main.group("import")
def import_group() -> None:
    """Turn another tool's evidence into an attndbg recording, to check and replay as a native one.

    Fields the source format does not carry (causal, sm_scale, window, the engine's padding and
    positions) are filled in and marked inferred (`attndbg show` lists them); a recorded plan that
    lacks a value is named "not read" by check, never a finding. Bad input: one line, exit 2.
    """


def _import_options(func: F) -> F:
    """-o and --overwrite, and bad input as one line (exit 2): what every import takes."""
    func = handles_bad_input(func)
    func = click.option("--overwrite", is_flag=True, help="replace an existing recording in the directory")(func)
    return click.option("-o", "out_dir", required=True, type=click.Path(file_okay=False), help="recording directory to write")(func)  # type: ignore[return-value]


def _import(what: str, reader: Callable[[Path], Any], source: str, out_dir: str, overwrite: bool) -> None:
    from attndbg.interop.recording import write_recording

    result = write_recording(reader(Path(source)), out_dir, overwrite=overwrite)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(result.summary(what), err=True)
    sys.exit(EXIT_OK if result.steps else EXIT_NOT_RUN)


@import_group.command("flashinfer")
@click.argument("dump_dir", type=click.Path())
@_import_options
def import_flashinfer(dump_dir: str, out_dir: str, overwrite: bool) -> None:
    """A FlashInfer level-10 dump (FLASHINFER_LOGLEVEL=10): each run with its wrapper's plan as a
    step, the recorded q, KV and output kept (the output is the engine's, which check judges).

    \b
    Example:
      attndbg import flashinfer flashinfer_dumps -o rec && attndbg check rec
    """
    from attndbg.interop.flashinfer_steps import import_dump

    _import("flashinfer", import_dump, dump_dir, out_dir, overwrite)


@import_group.command("fib")
@click.argument("workloads", type=click.Path())
@_import_options
def import_fib(workloads: str, out_dir: str, overwrite: bool) -> None:
    """flashinfer-bench workloads (TRACE_SET/workloads/OP/DEF.jsonl with its definition and
    safetensors blobs): structure-only steps that replay seeded data.

    \b
    Example:
      attndbg import fib trace_set/workloads/gqa_paged/gqa_paged_decode_h32_kv8_d128_ps1.jsonl -o rec
    """
    from attndbg.interop.fib import import_workloads

    _import("fib", import_workloads, workloads, out_dir, overwrite)


@import_group.command("trtllm")
@click.argument("cases", type=click.Path())
@_import_options
def import_trtllm(cases: str, out_dir: str, overwrite: bool) -> None:
    """TensorRT-LLM attention captures (TRTLLM_ATTN_CAPTURE_DIR/cases_rank0.jsonl): one step per
    batch (its layers' lines collapsed), structure only.

    \b
    Example:
      attndbg import trtllm captures/cases_rank0.jsonl -o rec
    """
    from attndbg.interop.trtllm import import_cases

    _import("trtllm", import_cases, cases, out_dir, overwrite)


@main.group("export")
def export_group() -> None:
    """Write a recording's steps in another tool's format."""


@export_group.command("fib")
@click.argument("target", type=click.Path())
@click.option("-o", "out_dir", required=True, type=click.Path(file_okay=False), help="new trace-set directory to write")
@handles_bad_input
def export_fib(target: str, out_dir: str) -> None:
    """A trace or recording as flashinfer-bench definitions and workloads (safetensors blobs; q and
    KV values too when a step recorded them). Verify, sliding-window and soft-capped steps have no
    definition there and are named as left out; exit 3 when no step fits.

    \b
    Example:
      attndbg export fib rec -o trace_set
    """
    from attndbg.interop.fib_export import export_recording

    result = export_recording(target, out_dir)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"attndbg export fib: {result.workloads} workload(s) of {len(result.definitions)} definition(s) in {result.out_dir}", err=True)
    sys.exit(EXIT_OK if result.workloads else EXIT_NOT_RUN)
