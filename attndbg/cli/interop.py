"""`attndbg import` and `attndbg export` (attndbg/interop): other tools' evidence as recordings, and
back.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from attndbg.cli import options
from attndbg.cli.common import EXIT_NOT_RUN, EXIT_OK, F, handles_bad_input
from attndbg.cli.group import main
from attndbg.plural import counted


@main.group("import")
def import_group() -> None:
    """Turn another tool's evidence into an attndbg recording, to check and replay as a native one.

    Fields the source format does not carry (causal, sm_scale, window, the engine's padding and
    positions) are filled in as the library fills them and marked inferred (`attndbg show` lists
    them). A value the engine got wrong is imported as it was: check judges it. Only unreadable or
    hostile files are refused (one line, exit 2), and a refused import writes nothing.
    """


def _import_options(func: F) -> F:
    """-o/--output and --overwrite, and bad input as one line (exit 2): what every import takes."""
    func = handles_bad_input(func)
    return options.output_dir("recording directory to write")(options.overwrite()(func))


def _import(what: str, reader: Callable[[Path], Any], source: str, out_dir: str, overwrite: bool) -> None:
    from attndbg.atomic import output_directory
    from attndbg.interop.recording import write_recording

    with output_directory(out_dir):  # bad input halfway, or no step: no folder left behind
        result = write_recording(reader(Path(source)), out_dir, overwrite=overwrite)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(result.summary(what), err=True)
    sys.exit(EXIT_OK if result.steps else EXIT_NOT_RUN)


@import_group.command("flashinfer")
@click.argument("dump_dir", type=click.Path())
@click.option("--log", "log", type=click.Path(), default=None, help="FlashInfer's log (the FLASHINFER_LOGDEST file): where the error of a call that did not return is")
@_import_options
def import_flashinfer(dump_dir: str, log: str | None, out_dir: str, overwrite: bool) -> None:
    """A FlashInfer level-10 dump (FLASHINFER_LOGLEVEL=10): each run with its wrapper's plan as a
    step, the recorded q, KV and output kept (the output is the engine's, which check judges).
    A wrong plan is imported as it was and judged by check; a call that did not return is a step
    marked crashed (with its error from --log), which check and replay run again in an isolated
    worker; arguments left out get FlashInfer's defaults, marked inferred.

    \b
    Example:
      attndbg import flashinfer flashinfer_dumps --log flashinfer.log -o rec && attndbg check rec   # needs FlashInfer's dumps (FLASHINFER_LOGLEVEL=10, GPU)
    """
    from functools import partial

    from attndbg.interop.flashinfer_steps import import_dump

    _import("flashinfer", partial(import_dump, log=Path(log) if log else None), dump_dir, out_dir, overwrite)


@import_group.command("fib")
@click.argument("workloads", type=click.Path())
@_import_options
def import_fib(workloads: str, out_dir: str, overwrite: bool) -> None:
    """flashinfer-bench workloads (TRACE_SET/workloads/OP/DEF.jsonl with its definition and
    safetensors blobs): structure-only steps that replay seeded data.

    \b
    Example:
      attndbg examples traces
      attndbg export fib traces -o trace_set
      attndbg import fib trace_set/workloads/gqa_paged/attndbg_gqa_paged_decode_h32_kv8_d128_ps1.jsonl -o rec
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
      attndbg import trtllm captures/cases_rank0.jsonl -o rec   # needs TensorRT-LLM's captures (TRTLLM_ATTN_CAPTURE_DIR)
    """
    from attndbg.interop.trtllm import import_cases

    _import("trtllm", import_cases, cases, out_dir, overwrite)


@main.group("export")
def export_group() -> None:
    """Write a recording's steps in another tool's format."""


@export_group.command("fib")
@click.argument("target", type=click.Path())
@options.output_dir("new trace-set directory to write")
@handles_bad_input
def export_fib(target: str, out_dir: str) -> None:
    """A trace or recording as flashinfer-bench definitions and workloads (safetensors blobs; q and
    KV values too when a step recorded them). Verify, sliding-window and soft-capped steps have no
    definition there and are named as left out; exit 3 when no step fits.

    \b
    Example:
      attndbg examples traces
      attndbg export fib traces -o trace_set
    """
    from attndbg.atomic import output_directory
    from attndbg.interop.fib_export import export_recording

    with output_directory(out_dir):  # bad input halfway, or no step that fits: no folder left behind
        result = export_recording(target, out_dir)
    for note in result.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"attndbg export fib: {counted(result.workloads, 'workload')} of {counted(len(result.definitions), 'definition')} in {result.out_dir}", err=True)
    sys.exit(EXIT_OK if result.workloads else EXIT_NOT_RUN)
