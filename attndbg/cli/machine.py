"""Commands about this machine: backends (which run here and why not), env (versions, GPUs, JIT
caches for a bug report) and bench (each backend timed over CUDA-graph replays).
"""

from __future__ import annotations

import sys

import click

from attndbg.cli import options
from attndbg.cli.common import EXIT_NOT_RUN, EXIT_OK, NotRunHere, check_outputs, handles_bad_input, make_console, write_json
from attndbg.cli.group import main
from attndbg.cli.options import is_every_backend, parse_backends


@main.command()
@click.argument("trace", type=click.Path())
@options.backend("NAME[,NAME...] or all", default="triton")
@click.option("--samples", type=click.IntRange(min=3), default=30, show_default=True, help="timed samples (median reported)")
@options.json_output("timings", "attndbg.bench/1")
@handles_bad_input
@options.terminal()
def bench(trace: str, backend_spec: str, samples: int, json_path: str | None) -> None:
    """Time each backend on a trace over CUDA-graph replays; bandwidth against the device's copy peak.

    Exit 0 when every backend was timed, 2 on bad input, 3 when it cannot run here (no CUDA GPU) or a
    backend named with --backend could not be timed here.

    \b
    Example:
      attndbg examples traces
      attndbg bench traces/decode_gqa.pt --backend triton,flashinfer   # GPU
    """
    names = parse_backends(backend_spec)  # a typo is reported before the GPU is looked for
    check_outputs(json=json_path)
    from attndbg import machine
    from attndbg.trace import io

    loaded = io.load(trace)
    if not machine.cuda_available():
        raise NotRunHere("bench times CUDA-graph replays and needs a CUDA GPU, and this machine has none (attndbg replay runs on a CPU)")
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
        named=() if is_every_backend(backend_spec) else tuple(names),
    )
    make_console(stderr=json_path == "-").print(render_bench(result))
    if json_path:
        write_json(json_path, bench_to_json(result))
    sys.exit(EXIT_NOT_RUN if result.incomplete else EXIT_OK)


@main.command()
@click.option("--capabilities", "show_capabilities", is_flag=True, help="also what each backend declares it can run")
@options.json_report("each backend's status and capabilities", "attndbg.backends/1")
@handles_bad_input
@options.terminal()
def backends(show_capabilities: bool, json_path: str | None) -> None:
    """List the backends and whether each can run here (and exactly why not).

    \b
    Example:
      attndbg backends --capabilities
    """
    check_outputs(json=json_path)
    from attndbg.backends import registry
    from attndbg.report.backends import backend_status, backends_to_json, install_commands, render_backends

    statuses = [backend_status(name, registry.create(name)) for name in registry.backend_names()]
    if json_path != "-":
        console = make_console()
        console.print(render_backends(statuses, capabilities=show_capabilities))
        commands = install_commands(statuses)
        if commands:
            console.print("to install (each line a command to paste):")
            for command in commands:
                console.print(command, soft_wrap=True)
    if json_path:
        write_json(json_path, backends_to_json(statuses))


@main.command()
@options.json_report("the report", "attndbg.env/1")
@handles_bad_input
def env(json_path: str | None) -> None:
    """Report versions, GPUs and JIT caches: paste the output into a bug report.

    attndbg, Python, torch and its CUDA, triton, flashinfer, nvtx, cupti-python, SGLang / vLLM / transformers when
    installed (read from package metadata: no engine is imported), each GPU with its compute
    capability, the NVIDIA driver, the Triton and FlashInfer JIT caches with their sizes, and
    TRITON_INTERPRET.

    \b
    Example:
      attndbg env
      attndbg env --json env.json
    """
    check_outputs(json=json_path)
    from attndbg import environment

    report = environment.collect()
    if json_path != "-":
        click.echo(environment.render(report))
    if json_path:
        write_json(json_path, environment.to_json(report))
