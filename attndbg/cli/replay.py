"""`attndbg replay`: a step or a folder through real kernels, each backend against float64."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from attndbg.cli import options
from attndbg.cli.common import EXIT_FAILED, EXIT_NOT_RUN, EXIT_OK, BadInput, check_outputs, handles_bad_input, make_console, print_verdict, write_json
from attndbg.cli.group import main
from attndbg.cli.options import is_every_backend, parse_backend_options, parse_backends, parse_max_memory, require_gpu_for_cuda_graph


@main.command()
@click.argument("trace", type=click.Path(), metavar="TRACE|DIR")
@options.backend("NAME[,NAME...] or all (all skips, and names, what cannot run here)", default="triton")
@options.json_output("results", "attndbg.replay/1")
@click.option("--save", "save_path", type=click.Path(dir_okay=False), help="keep outputs for `attndbg diff`")
@options.layer()
@click.option("--num-kv-splits", type=click.IntRange(min=1), default=None, help="force split-KV count (triton, decode steps); the same as --backend-option triton.num_kv_splits=N")
@options.backend_option()
@click.option("--plan", "plan_source", type=click.Choice(["derived", "recorded", "both"]), default="derived", show_default=True, help="run the plan derived from the batch, the one the engine recorded, or both")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="eager runs per backend; any bit difference between them fails")
@options.cuda_graph("also replay inside a real CUDA graph, padded as engines pad")
@click.option("--capture-bs", type=click.IntRange(min=1), default=None, help="graph capture batch size (with --cuda-graph; default: next SGLang size above the batch)")
@click.option("--fill-value", type=click.IntRange(min=0), default=None, help="seq_len of padded rows (with --cuda-graph; default: each backend's own)")
@options.max_memory("refuse (exit 2) a step whose data would need more than SIZE, e.g. 8G or 512M (default: what the device has free)")
@handles_bad_input
@options.terminal(quiet=True)
@options.timeline("replay")
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
      attndbg examples traces
      attndbg replay traces/verify_tree.pt --backend triton
      attndbg replay traces/mixed.pt --backend triton,reference --json out.json
      attndbg replay traces/verify_tree.pt --backend all --cuda-graph   # GPU: every backend that runs here, in a CUDA graph
      attndbg replay traces/verify_tree.pt --backend fa3 --backend-option fa3.verify_path=two-call   # GPU
    """
    began = time.monotonic()
    names = parse_backends(backend_spec)
    backend_options = parse_backend_options(backend_option_specs, num_kv_splits)
    max_memory = parse_max_memory(max_memory_spec)
    check_outputs(json=json_path, save=save_path)
    if not cuda_graph:
        for flag, value in (("--capture-bs", capture_bs), ("--fill-value", fill_value)):
            if value is not None:
                raise BadInput(f"{flag} shapes the CUDA-graph replay: add --cuda-graph, or drop {flag}")
    from attndbg.trace import io

    paths = io.trace_paths(trace)
    if save_path and len(paths) != 1:
        raise BadInput("--save takes a single step file, not a recording directory")
    require_gpu_for_cuda_graph(cuda_graph)

    from rich.text import Text

    from attndbg.profiling import step_range
    from attndbg.replay import activity
    from attndbg.replay.crashed import rerun_crashed
    from attndbg.replay.runner import PlanSource, ReplayOptions, replay as run_replay
    from attndbg.report.progress import StepProgress
    from attndbg.report.replay import StepReport, overall, render_replay, replay_to_json, step_to_json, verdict_line
    from attndbg.report.terminal import duration

    options = ReplayOptions(
        backend_options=backend_options,
        plan=PlanSource(plan_source),
        repeat=repeat,
        cuda_graph=cuda_graph,
        capture_bs=capture_bs,
        fill_value=fill_value,
        max_memory=max_memory,
    )
    named = () if is_every_backend(backend_spec) else tuple(names)
    console = make_console(stderr=json_path == "-")
    steps = []  # each step's JSON only: a folder's tensors are not held until the end
    with StepProgress(len(paths), "replaying", console=make_console(stderr=True)) as progress:
        for number, path in enumerate(paths, start=1):
            loaded = io.load(path)
            step_layer, notes = data_layer(loaded, layer, str(path), single=len(paths) == 1)
            notes += _ignored_options(loaded, names, backend_options, num_kv_splits_flag=num_kv_splits is not None)
            progress.show(f"{number}/{len(paths)} {path}: {', '.join(names)}")
            crash = None
            step_names = names
            if loaded.source.crash is not None:
                # The call crashed where it ran: made again in a worker of its own, never here, and
                # its backend is left out of this process's runs (its crash would end them).
                crash = rerun_crashed(str(path))
                if crash.backend in names:
                    step_names = [n for n in names if n != crash.backend]
                    notes.append(f"{crash.backend} ran the crashed call in a worker of its own (above), not in this replay")
            try:
                with step_range(path, loaded):
                    result = run_replay(loaded, str(path), step_names, replace(options, layer=step_layer))
            except activity.CudaContextLost as e:  # nothing runs on the GPU again in this process
                progress.print(console, Text(f"{path}: {e}; replay stopped here (this process's CUDA context cannot be recovered)", style="red"))
                sys.exit(EXIT_FAILED)
            step = StepReport(result=result, layer=step_layer, repeat=repeat, named=tuple(n for n in named if n in step_names), notes=tuple(notes), crash=crash)
            progress.print(console, render_replay(step))
            steps.append(step_to_json(step))
    print_verdict(make_console(stderr=json_path == "-", details=False), verdict_line(steps) + f"; took {duration(time.monotonic() - began)}")
    if json_path:
        write_json(json_path, replay_to_json(steps))
    if save_path:  # a single step (checked above): `result` is its
        _save_replay(save_path, str(paths[0]), result)
    sys.exit(_EXIT_BY_VERDICT[overall(steps).value])


# Verdict (report.replay.Verdict, by value) -> exit code.
_EXIT_BY_VERDICT = {"passed": EXIT_OK, "failed": EXIT_FAILED, "incomplete": EXIT_NOT_RUN}


def data_layer(trace: Any, layer: int | None, path: str, *, single: bool) -> tuple[int | None, list[str]]:
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
    from attndbg.backends.options import SPLIT_COUNT_OPTION
    from attndbg.trace.schema import ForwardMode

    splitter, field = SPLIT_COUNT_OPTION
    notes = []
    for name, _ in backend_options.chosen:
        if name in names:
            continue
        if name == splitter and num_kv_splits_flag:
            notes.append(f"--num-kv-splits sets the {splitter} backend's split count; {splitter} is not among the backends run")
        else:
            notes.append(f"--backend-option {name}.*: sets the {name} backend's options; {name} is not among the backends run")
    chosen = backend_options.of(splitter)
    if chosen is not None and getattr(chosen, field) is not None and splitter in names and trace.batch.forward_mode is not ForwardMode.DECODE:
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
