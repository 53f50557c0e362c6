"""`attndbg` command line: each command parses, calls one core function, renders, exits 0/1/2.

Exit codes: 0 all good, 1 a backend failed (or findings), 2 bad input (one line on stderr).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console

from attndbg.trace.validate import TraceError

F = TypeVar("F", bound=Callable[..., Any])
EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class BadInput(Exception):
    """Any user-input problem that is not a TraceError (unknown backend, bad option combination)."""


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 160)


def handles_bad_input(func: F) -> F:
    """Turn bad input into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from attndbg.trace.synth import SpecError

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
        return registry.resolve(spec)
    except KeyError as e:
        raise BadInput(f"--backend: unknown backend {e.args[0]!r}; known: {', '.join(registry.backend_names())}") from None


def _write_json(path: str, data: Any) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attndbg")
def main() -> None:
    """Record, replay, diff and explain LLM attention backends.

    \b
    Example:
      attndbg synth verify -o verify.pt && attndbg replay verify.pt --backend triton
    """


@main.command()
@click.argument("spec", nargs=-1)
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), help="trace file to write")
@click.option("--list", "list_presets", is_flag=True, help="list presets, spec keys and injectable mistakes")
@click.option("--inject", "inject_kind", default=None, help="carry a realistic mistake of one class (see --list)")
@handles_bad_input
def synth(spec: tuple[str, ...], output: str | None, list_presets: bool, inject_kind: str | None) -> None:
    """Build a trace from a spec: a preset, then key=value overrides.

    \b
    Example:
      attndbg synth decode-gqa kv_lens=1,33,20000 page_size=16 -o decode.pt
    """
    from attndbg.replay.plans import with_engine_plan
    from attndbg.trace import io, mutate, synth as synth_mod

    if list_presets:
        click.echo(synth_mod.__doc__)
        for name, values in synth_mod.PRESETS.items():
            click.echo(f"  {name:16s} " + " ".join(f"{k}={v}" for k, v in values.items()))
        click.echo("\nInjectable mistakes (--inject KIND):")
        for kind, func in sorted(mutate.injections().items()):
            click.echo(f"  {kind:32s} {(func.__doc__ or '').strip().splitlines()[0] if func.__doc__ else ''}")
        return
    if not output:
        raise BadInput("synth: give -o FILE (or --list to see presets)")
    trace = with_engine_plan(synth_mod.build(synth_mod.parse_spec(spec)))
    if inject_kind:
        try:
            trace = mutate.inject(trace, inject_kind)
        except KeyError:
            raise BadInput(f"--inject: unknown mistake {inject_kind!r}; see attndbg synth --list") from None
        except ValueError as e:
            raise BadInput(f"--inject {inject_kind}: {e}") from None
    io.save(trace, output)
    b = trace.batch
    click.echo(f"wrote {output}: {b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} kv_lens={b.kv_lens.tolist()[:8]}")


@main.command()
@click.argument("trace", type=click.Path())
@handles_bad_input
def show(trace: str) -> None:
    """Summarise a trace: mode, batch, lengths, slots, plan, tree masks.

    \b
    Example:
      attndbg show traces/verify_tree.pt
    """
    from attndbg.report.show import render_trace
    from attndbg.trace import io

    _console().print(render_trace(io.load(trace), trace))


@main.command()
@click.argument("trace", type=click.Path())
@click.option("--backend", "backend_spec", default="triton", show_default=True, help="NAME[,NAME...] or all")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the results as JSON")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), help="keep outputs for `attndbg diff`")
@click.option("--layer", type=int, default=None, help="use this recorded layer's tensors")
@click.option("--num-kv-splits", type=click.IntRange(min=1), default=None, help="force split-KV count (triton)")
@click.option("--plan", "plan_source", type=click.Choice(["derived", "recorded", "both"]), default="derived", show_default=True, help="run the plan derived from the batch, the one the engine recorded, or both")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="eager runs per backend; any bit difference between them fails")
@click.option("--cuda-graph", is_flag=True, help="also replay inside a real CUDA graph, padded as engines pad")
@click.option("--capture-bs", type=click.IntRange(min=1), default=None, help="graph capture batch size (default: next SGLang size above the batch)")
@click.option("--fill-value", type=click.IntRange(min=0), default=None, help="seq_len of padded rows (default: each backend's own)")
@handles_bad_input
def replay(
    trace: str,
    backend_spec: str,
    json_path: str | None,
    save_path: str | None,
    layer: int | None,
    num_kv_splits: int | None,
    plan_source: str,
    repeat: int,
    cuda_graph: bool,
    capture_bs: int | None,
    fill_value: int | None,
) -> None:
    """Replay a step through real kernels and compare each backend with a float64 reference.

    Exit 0 when every backend that ran passed, 1 when any failed, 2 on bad input.

    \b
    Example:
      attndbg replay traces/decode_gqa.pt --backend triton,reference --json out.json
    """
    from attndbg import machine
    from attndbg.backends.triton import TritonOptions
    from attndbg.replay.runner import PlanSource, ReplayOptions, replay as run_replay
    from attndbg.report.replay import render_replay, replay_to_json
    from attndbg.trace import io

    names = _backend_names(backend_spec)
    paths = io.trace_paths(trace)
    if save_path and len(paths) != 1:
        raise BadInput("--save takes a single step file, not a recording directory")
    if cuda_graph and not machine.cuda_available():
        raise BadInput("--cuda-graph needs a CUDA GPU, and this machine has none")
    max_splits = max(num_kv_splits or 0, TritonOptions().max_kv_splits)
    options = ReplayOptions(
        layer=layer,
        triton=TritonOptions(num_kv_splits=num_kv_splits, max_kv_splits=max_splits),
        plan=PlanSource(plan_source),
        repeat=repeat,
        cuda_graph=cuda_graph,
        capture_bs=capture_bs,
        fill_value=fill_value,
    )
    console = _console()
    results = []
    from attndbg.profiling import phase

    for path in paths:
        with phase("load", str(path)):
            loaded = io.load(path)
        if layer is not None and layer not in loaded.tensors:
            raise BadInput(f"--layer {layer}: {path} has no tensors for that layer (has {sorted(loaded.tensors) or 'none'})")
        result = run_replay(loaded, str(path), names, options)
        console.print(render_replay(result))
        results.append(result)
    if json_path:
        _write_json(json_path, [replay_to_json(r) for r in results] if len(results) > 1 else replay_to_json(results[0]))
    if save_path:
        from attndbg.replay.saved import save_replay

        only = results[0]
        outputs = {"reference": (only.reference.output, only.reference.lse)}
        for r in only.runs:
            if r.result is not None:
                key = r.name if r.variant == "eager" else f"{r.name}[{r.variant}]"
                outputs[key] = (r.result.output, r.result.lse)
        save_replay(save_path, trace_file=str(paths[0]), qo_indptr=only.trace.batch.qo_indptr, results=outputs)
    sys.exit(EXIT_FAILED if any(r.failed for r in results) else EXIT_OK)


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the differences as JSON")
@click.option("--pair", "pairs", multiple=True, help="saved replays: compare backend X of A with Y of B (X:Y)")
@handles_bad_input
def diff(a: str, b: str, json_path: str | None, pairs: tuple[str, ...]) -> None:
    """Show what differs between two traces, or between two saved replays (--save files).

    Exit 0 when nothing differs, 1 when something does.

    \b
    Examples:
      attndbg diff engine_step.pt synth_step.pt
      attndbg diff run_a.replay run_b.replay --pair triton:triton
    """
    from attndbg.compare import replay_diff, trace_diff
    from attndbg.replay.saved import is_saved_replay, load_replay
    from attndbg.report.diff import render_replay_diff, render_trace_diff, replay_diff_to_json, trace_diff_to_json
    from attndbg.trace import io

    console = _console()
    if is_saved_replay(a) or is_saved_replay(b):
        pair_list = [tuple(p.split(":", 1)) for p in pairs] if pairs else None
        if pair_list and any(len(p) != 2 for p in pair_list):
            raise BadInput("--pair: expected BACKEND_A:BACKEND_B")
        result = replay_diff.diff_replays(load_replay(a), load_replay(b), pairs=pair_list)
        console.print(render_replay_diff(result))
        data = replay_diff_to_json(result)
    else:
        result = trace_diff.diff_traces(io.load(a), io.load(b))
        console.print(render_trace_diff(result))
        data = trace_diff_to_json(result)
    if json_path:
        _write_json(json_path, data)
    sys.exit(EXIT_FAILED if result.differs else EXIT_OK)


@main.command()
@click.argument("target", type=click.Path())
@click.option("--only", default=None, help="detectors to run: invariants,fill-value,tree-mask,split-merge (default: all)")
@click.option("--backend", "backend_spec", default=None, help="kernel backends the detectors may use (default: all that run here)")
@click.option("--cuda-graph", is_flag=True, help="detectors also replay under CUDA graphs (GPU)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the findings as JSON")
@handles_bad_input
def check(target: str, only: str | None, backend_spec: str | None, cuda_graph: bool, json_path: str | None) -> None:
    """Run the detectors on a step or a recording directory and explain what they find.

    Exit 0 when clean, 1 with findings, 2 on bad input.

    \b
    Examples:
      attndbg check traces/verify_tree.pt
      attndbg synth verify --inject tree-mask:bit-order -o bad.pt && attndbg check bad.pt --only tree-mask
    """
    from rich.progress import Progress

    from attndbg import machine
    from attndbg.checks.context import CheckOptions
    from attndbg.checks.run import check_steps, parse_only
    from attndbg.report.checks import checks_to_json, render_step, render_summary
    from attndbg.trace import io

    try:
        classes = parse_only(only)
    except ValueError as e:
        raise BadInput(f"--only: {e}") from None
    names = tuple(_backend_names(backend_spec)) if backend_spec else None
    if cuda_graph and not machine.cuda_available():
        raise BadInput("--cuda-graph needs a CUDA GPU, and this machine has none")
    options = CheckOptions(backends=names, cuda_graph=cuda_graph)
    console = _console()
    paths = io.trace_paths(target)
    reports = []
    if len(paths) > 1:
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("checking", total=len(paths))
            for report in check_steps(target, classes, options, progress=lambda _p: progress.advance(task)):
                reports.append(report)
        for report in reports:
            if report.findings:
                console.print(render_step(report))
        console.print(render_summary(reports))
    else:
        for report in check_steps(target, classes, options):
            reports.append(report)
            console.print(render_step(report))
    if json_path:
        _write_json(json_path, checks_to_json(reports))
    sys.exit(EXIT_FAILED if any(r.findings for r in reports) else EXIT_OK)


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("-o", "--output", "out_dir", default="recording", show_default=True, type=click.Path(file_okay=False), help="recording directory (manifest.jsonl + one .pt per step)")
@click.option("--every", type=click.IntRange(min=1), default=1, show_default=True, help="record every N-th step")
@click.option("--steps", default=None, help="record only steps A <= step < B (A:B, A:, :B)")
@click.option("--layers", default=None, help="also record real tensors (q, new k/v, KV rows read, output) of these layers, e.g. 0,5")
@click.option("--max-size", default="2G", show_default=True, help="stop recording (not the engine) when the directory holds this much")
@click.option("--engine", "engines", default="transformers,sglang,vllm", show_default=True, help="engines to hook")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@handles_bad_input
def record(out_dir: str, every: int, steps: str | None, layers: str | None, max_size: str, engines: str, command: tuple[str, ...]) -> None:
    """Run an engine command with recording hooks and write each step as a trace.

    Hooks are armed in every Python process the command starts (schedulers, workers); a hook that
    fails logs one line and stops recording, the engine goes on. Exit code: the command's.

    \b
    Examples:
      attndbg record -o rec -- python -m sglang.launch_server --model-path ...
      attndbg record -o rec --layers 0 --steps 0:20 -- python my_generate.py
      attndbg check rec && attndbg replay rec/step_000003.pt --backend all
    """
    from attndbg.record.launch import run_recorded
    from attndbg.record.options import OptionError, RecordOptions, parse_layers, parse_size, parse_steps

    known = ("transformers", "sglang", "vllm")
    chosen = tuple(e.strip() for e in engines.split(",") if e.strip())
    unknown = [e for e in chosen if e not in known]
    if unknown or not chosen:
        raise BadInput(f"--engine: unknown engine {unknown[0] if unknown else engines!r}; known: {', '.join(known)}")
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise BadInput("record: no command given (attndbg record [OPTIONS] -- COMMAND ...)")
    try:
        first, last = parse_steps(steps)
        options = RecordOptions(out_dir=out_dir, every=every, first_step=first, last_step=last, layers=parse_layers(layers), max_bytes=parse_size(max_size), engines=chosen)
    except OptionError as e:
        raise BadInput(str(e)) from None
    try:
        result = run_recorded(list(command), options)
    except FileNotFoundError:
        raise BadInput(f"record: command not found: {command[0]}") from None
    steps_written = len(result.entries)
    modes = sorted({e.mode for e in result.entries})
    click.echo(f"attndbg record: {steps_written} step(s) in {result.out_dir} ({', '.join(modes) or 'no steps'}); command exited {result.exit_code}", err=True)
    sys.exit(result.exit_code)


@main.command()
@click.argument("trace", type=click.Path())
@click.option("--backend", "backend_spec", default="triton", show_default=True, help="NAME[,NAME...] or all")
@click.option("--samples", type=click.IntRange(min=3), default=30, show_default=True, help="timed samples (median reported)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the timings as JSON")
@handles_bad_input
def bench(trace: str, backend_spec: str, samples: int, json_path: str | None) -> None:
    """Time each backend on a trace over CUDA-graph replays; bandwidth against the device's copy peak.

    \b
    Example:
      attndbg bench traces/decode_gqa.pt --backend triton,flashinfer
    """
    from rich.table import Table

    from attndbg import machine
    from attndbg.backends import registry
    from attndbg.replay.data import build_inputs, to_device
    from attndbg.replay.timing import copy_bandwidth_gbps, time_backend
    from attndbg.trace import io

    if not machine.cuda_available():
        raise BadInput("bench times CUDA-graph replays and needs a CUDA GPU, and this machine has none")
    names = _backend_names(backend_spec)
    loaded = io.load(trace)
    inputs = build_inputs(loaded)
    peak = copy_bandwidth_gbps()
    table = Table(title=f"{trace}: {loaded.batch.forward_mode.value} bs={loaded.batch.batch_size}; device copy bandwidth {peak:.0f} GB/s")
    for column in ("backend", "median", "min..max", "bytes", "GB/s", "of copy peak", "note"):
        table.add_column(column)
    rows = []
    for name in names:
        backend = registry.create(name)
        reason = backend.unavailable_reason() or backend.unsupported_reason(loaded) or backend.graph_unsupported_reason(loaded)
        if reason:
            table.add_row(name, "", "", "", "", "", reason)
            rows.append({"backend": name, "skipped": reason})
            continue
        t = time_backend(backend, loaded, to_device(inputs, backend.device()), samples=samples)
        table.add_row(name, f"{t.median_us:.1f} us", f"{t.min_us:.1f}..{t.max_us:.1f}", f"{t.bytes_moved / 1e6:.1f} MB", f"{t.achieved_gbps:.0f}", f"{t.achieved_gbps / peak:.0%}", backend.describe())
        rows.append(t.__dict__ | {"copy_gbps": peak})
    _console().print(table)
    if json_path:
        _write_json(json_path, rows)


@main.command()
@handles_bad_input
def backends() -> None:
    """List the backends and whether each can run here (and exactly why not).

    \b
    Example:
      attndbg backends
    """
    from rich.table import Table

    from attndbg.backends import registry

    table = Table(title="attndbg backends")
    for column in ("backend", "available", "what runs / why not"):
        table.add_column(column)
    for name in registry.backend_names():
        backend = registry.create(name)
        reason = backend.unavailable_reason()
        table.add_row(name, "no" if reason else "yes", reason or backend.describe())
    _console().print(table)
