"""`attndbg record`: an engine command run with recording hooks."""

from __future__ import annotations

import sys

import click

from attndbg.cli import options
from attndbg.cli.common import EXIT_NOT_RECORDED, BadInput, handles_bad_input
from attndbg.cli.group import main
from attndbg.plural import counted
from attndbg.record.engines import NAMES as ENGINE_NAMES
from attndbg.suggest import did_you_mean


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@options.output_dir("recording directory (manifest.jsonl + one .pt per step)", default="recording")
@click.option("--append", is_flag=True, help="add this run's steps to an existing recording (files named run<N>_step_*.pt)")
@options.overwrite()
@click.option("--every", type=click.IntRange(min=1), default=1, show_default=True, help="record every N-th step")
@options.steps("record only steps A <= step < B (A:B, A:, :B)")
@click.option("--layers", default=None, help="also record real tensors (q, new k/v, KV rows read, output) of these layers, e.g. 0,5")
@click.option("--max-size", default="2G", show_default=True, help="stop recording (not the engine) when the directory holds this much")
@click.option("--engine", "engines", default=",".join(ENGINE_NAMES), show_default=True, help="engines to hook")
@click.option(
    "--ring",
    type=click.IntRange(min=1),
    default=None,
    help="flight recorder: keep the last K steps in host memory and write them only when a trigger fires "
    "(an exception or CUDA error in the engine, a non-zero exit, SIGUSR1, --when)",
)
@click.option("--when", "when", multiple=True, help="with --ring, also fire on: nan (NaN/Inf in a recorded output or the logits), 'accept<X' (a verify step's acceptance rate)")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
@handles_bad_input
@options.timeline("record", spawned="engine process", collect_here=False)
def record(
    out_dir: str,
    append: bool,
    overwrite: bool,
    every: int,
    steps_spec: str | None,
    layers: str | None,
    max_size: str,
    engines: str,
    ring: int | None,
    when: tuple[str, ...],
    command: tuple[str, ...],
) -> None:
    """Run an engine command with recording hooks and write each step as a trace.

    Hooks are armed in every Python process the command starts (schedulers, workers); a hook that
    fails logs one line and stops recording, the engine goes on. A directory that already holds
    files is refused unless --append or --overwrite. Exit code: the command's (128 + N when signal N
    killed it), or 4 when it exited 0 but no step was recorded because a hook failed (the hook and
    its error are named).

    With --ring K nothing is written until a trigger fires: then the last K steps (and those still
    in flight on the device) are written as a recording whose manifest names the trigger. See
    docs/recording.md.

    \b
    Examples:
      attndbg record -o rec --layers 0 -- python -m attndbg.examples.transformers_generate   # with transformers and psutil installed
      attndbg check rec --only invariants,split-merge
      attndbg record -o gpu_rec --timeline rec.json -- python -m attndbg.examples.transformers_generate --device cuda   # GPU
      attndbg record -o server_rec -- python -m sglang.launch_server --model-path ...   # needs SGLang and a model
      attndbg record -o ring_rec --ring 64 --layers 0 --when nan -- python -m sglang.launch_server ...   # needs SGLang and a model
    """
    from attndbg.atomic import output_directory
    from attndbg.record.exit_status import command_exit
    from attndbg.record.launch import missing_layers, run_recorded
    from attndbg.record.options import OptionError, RecordOptions, parse_layers, parse_size, parse_steps
    from attndbg.record.triggers import parse_when
    from attndbg.trace.directory import DirectoryRefused, prepare_directory

    known = ENGINE_NAMES
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
        first, last = parse_steps(steps_spec)
        chosen_layers, max_bytes = parse_layers(layers), parse_size(max_size)
        if when and ring is None:
            raise OptionError("--when: needs --ring K (the conditions fire the flight recorder's ring)")
        parse_when(when)
        # Last: --overwrite deletes the earlier recording, only once every option is known good.
        prefix = prepare_directory(out_dir, append=append, overwrite=overwrite)
        options = RecordOptions(
            out_dir=out_dir,
            every=every,
            first_step=first,
            last_step=last,
            layers=chosen_layers,
            max_bytes=max_bytes,
            engines=chosen,
            file_prefix=prefix,
            ring=ring or 0,
            when=tuple(when),
        )
    except (OptionError, DirectoryRefused) as e:
        raise BadInput(str(e)) from None
    try:
        with output_directory(out_dir):  # no step written: no folder left behind
            result = run_recorded(list(command), options)
    except FileNotFoundError:
        raise BadInput(f"record: command not found: {command[0]}") from None
    ended = command_exit(result.exit_code)
    if result.entries:
        modes = ", ".join(sorted({e.mode for e in result.entries}))
        recorded = f"{counted(len(result.entries), 'step')} in {result.out_dir} ({modes})"
    else:
        recorded = "no step recorded" + ("" if result.out_dir.is_dir() else f" ({result.out_dir} not created)")
    click.echo(f"attndbg record: {recorded}; command {ended.text}", err=True)
    for trigger in result.triggers:
        flying = [e.step for e in result.entries if e.in_flight]
        where = f"step {trigger.step}" if trigger.step is not None else "no step"
        click.echo(f"attndbg record: ring written on {trigger.kind} at {where}: {trigger.message}{f' (in flight: {flying})' if flying else ''}", err=True)
    if ring and not result.triggers:
        click.echo(f"attndbg record: ring of {counted(ring, 'step')}: no trigger fired, nothing written", err=True)
    never = missing_layers(options, result.entries)
    if never:
        click.echo(f"attndbg record: note: --layers {','.join(map(str, never))}: no step recorded tensors of these layers (does the model have that many layers?)", err=True)
    if result.problems:
        more = f" (and {counted(len(result.problems) - 1, 'more process', 'more processes')} stopped)" if len(result.problems) > 1 else ""
        what = "no step recorded" if not result.entries else "recording stopped early"
        click.echo(f"attndbg record: {what}: {result.problems[0]}{more}", err=True)
    sys.exit(EXIT_NOT_RECORDED if result.hook_failed_before_any_step else ended.status)
