"""Commands on trace files: examples (write the shipped ones), synth (build one from a spec), show
(summarise one), diff (two traces, two recordings or two saved replays).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from attndbg.cli import options
from attndbg.cli.common import EXIT_FAILED, EXIT_NOT_RUN, EXIT_OK, BadInput, check_outputs, handles_bad_input, make_console, write_json
from attndbg.cli.group import main
from attndbg.suggest import did_you_mean


@main.command()
@click.argument("directory", type=click.Path(), metavar="DIR")
@click.option("--overwrite", is_flag=True, help="replace a file of DIR that has an example's name and other content")
@handles_bad_input
def examples(directory: str, overwrite: bool) -> None:
    """Write the example traces that ship with attndbg into DIR (created if absent): the steps the
    documentation's examples replay, check and show.

    \b
    Example:
      attndbg examples traces
      attndbg replay traces/verify_tree.pt --backend triton
    """
    from attndbg.examples import ExamplesMissing, ExamplesRefused, write_examples

    try:
        result = write_examples(directory, overwrite=overwrite)
    except ExamplesRefused as e:
        raise BadInput(str(e)) from None
    except ExamplesMissing as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(EXIT_NOT_RUN)
    names = result.written + result.unchanged
    said = f"wrote {len(result.written)}" + (f", {len(result.unchanged)} there already" if result.unchanged else "")
    click.echo(f"{result.directory}: {len(names)} example traces ({said}): {', '.join(sorted(names))}")


@main.command()
@click.argument("spec", nargs=-1)
@click.option("-o", "--output", "output", type=click.Path(), help="trace file to write (with --recording: the recording's directory)")
@click.option("--list", "list_presets", is_flag=True, help="list presets, spec keys and injectable mistakes")
@click.option("--inject", "inject_kind", default=None, metavar="KIND:MISTAKE", help="carry a realistic mistake a detector finds, e.g. tree-mask:bit-order (see --list)")
@click.option("--recording", "steps", type=click.IntRange(min=1), default=None, metavar="N", help="write a recording of N steps whose batch shrinks and grows back")
@handles_bad_input
def synth(spec: tuple[str, ...], output: str | None, list_presets: bool, inject_kind: str | None, steps: int | None) -> None:
    """Build a trace from a spec: a preset, then key=value overrides.

    \b
    Examples:
      attndbg synth decode-gqa kv_lens=1,33,2000 page_size=16 -o decode.pt
      attndbg synth decode-gqa capture_bs=8 --recording 6 -o rec
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

    if steps is not None:
        if inject_kind:
            raise BadInput("synth --recording: --inject carries a mistake into one step; write the step alone")
        _write_recording(synth_spec.parse_spec(spec), steps, Path(output))
        return
    if Path(output).is_dir():
        raise BadInput(f"-o {output}: is a directory (a recording's? give --recording N, or a file name)")
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
    if trace.merge is not None:
        click.echo(f"wrote {output}: {trace.merge.words()}")
        return
    click.echo(f"wrote {output}: {b.forward_mode.value} bs={b.batch_size} tokens={b.num_tokens} kv_lens={b.kv_lens.tolist()[:8]}")


def _write_recording(spec: Any, steps: int, out: Path) -> None:
    """`synth --recording N`: N steps through the recorder's writer (manifest.jsonl + step files)."""
    from dataclasses import replace

    from attndbg.replay.plans import with_engine_plan
    from attndbg.trace import io, synth as synth_mod

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"-o {out}: exists and is not an empty directory; a recording is written into a new one")
    traces = [synth_mod.build(step_spec) for step_spec in synth_mod.recording_specs(spec, steps)]  # every step builds before one is written
    out.mkdir(parents=True, exist_ok=True)
    for number, trace in enumerate(traces):
        trace = with_engine_plan(replace(trace, source=replace(trace.source, step=number)))
        io.append_to_recording(out, trace)
    sizes = [t.batch.batch_size for t in traces]
    click.echo(f"wrote {out}: {steps} steps, {traces[0].batch.forward_mode.value}, batch sizes {sizes[:12]}{' ...' if len(sizes) > 12 else ''}")


def _mistake_hint(kind: str) -> str:
    """The suggestion for a mistake typed wrong (`--inject bit-order`: tree-mask:bit-order), or ""."""
    from attndbg.detectors import registry as detectors

    try:
        return did_you_mean(kind, detectors.injection_catalog())
    except detectors.LoadError:  # a detector that cannot load has its own error elsewhere
        return ""


@main.command()
@click.argument("trace", type=click.Path())
@options.json_output("summary", "attndbg.show/1")
@handles_bad_input
@options.terminal()
def show(trace: str, json_path: str | None) -> None:
    """Summarise a trace: mode, batch, lengths, slots, plan, tree masks.

    \b
    Example:
      attndbg examples traces
      attndbg show traces/verify_tree.pt
    """
    from attndbg.report.show import render_trace, trace_to_json
    from attndbg.trace import io

    check_outputs(json=json_path)
    loaded = io.load(trace)
    make_console(stderr=json_path == "-").print(render_trace(loaded, trace))
    if json_path:
        write_json(json_path, trace_to_json(loaded, trace))


@main.command()
@click.argument("a", type=click.Path())
@click.argument("b", type=click.Path())
@options.json_output("differences", "attndbg.diff/1")
@click.option("--pair", "pairs", multiple=True, help="saved replays only: compare backend X of A with Y of B (X:Y)")
@handles_bad_input
@options.terminal()
def diff(a: str, b: str, json_path: str | None, pairs: tuple[str, ...]) -> None:
    """Show what differs between two traces, two recordings (folders, step by step), or two saved
    replays (--save files).

    Exit 0 when nothing differs, 1 when something does, 2 on bad input.

    \b
    Examples:
      attndbg synth decode-gqa kv_lens=5,40 -o a.pt && attndbg synth decode-gqa kv_lens=5,41 -o b.pt
      attndbg diff a.pt b.pt     # exit 1: the first differing field
      attndbg diff rec_a rec_b   # needs two recordings: the first step and field that differ
    """
    from attndbg.compare.saved import is_saved_replay

    check_outputs(json=json_path)
    console = make_console(stderr=json_path == "-")
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
        write_json(json_path, data)
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
