"""The options more than one command takes, declared once (each with the parser of its value):
--backend, --backend-option, --json, --steps/--sample, --max-memory, --jobs/--devices, --only,
--layer, --cuda-graph, -o/--output, --overwrite, --timeline, --color/--no-color and -q/--quiet. What differs between commands is the
help (what the option means there) and, for --backend, -o/--output and --steps, what the command
passes; each is an argument, and each difference is said where the option is declared.

Options of one name that mean different things keep their own declarations: minimize's --jobs
(candidates at once, a number, default 2) beside check's (worker processes per step, N or auto)
and repro's --plan (the one plan a script runs, recorded|derived) beside replay's
(derived|recorded|both); each says why where it is declared.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from attndbg.cli.common import TERMINAL, F, BadInput, NotRunHere
from attndbg.report.terminal import Terminal
from attndbg.suggest import did_you_mean


def _option(*decls: str, **attrs: Any) -> Callable[[F], F]:
    return click.option(*decls, **attrs)  # type: ignore[return-value]


def backend(help: str, default: str | None = None) -> Callable[[F], F]:
    """--backend NAME[,NAME...]|all (parse_backends): the kernel backends a command runs; a default is shown.

    The defaults differ on purpose: replay, bench, minimize and repro run triton unless told (one
    backend that runs on any machine, a CPU included, under Triton's interpreter; minimize and repro
    take exactly one), check and compile pass none: every backend that runs here, which the
    detectors choose among."""
    shown = {"show_default": True} if default is not None else {}
    return _option("--backend", "backend_spec", default=default, help=help, **shown)


def backend_option() -> Callable[[F], F]:
    """--backend-option NAME.FIELD=VALUE, repeatable (parse_backend_options)."""
    return _option("--backend-option", "backend_option_specs", multiple=True, metavar="NAME.FIELD=VALUE", help=BACKEND_OPTION_HELP)


def json_output(what: str, schema: str) -> Callable[[F], F]:
    """--json FILE (- for stdout): the command's result as JSON, beside what it prints."""
    return _option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), help=f"also write the {what} as JSON ({schema}; - for stdout)")


def json_report(what: str, schema: str) -> Callable[[F], F]:
    """--json [FILE]: a report command's JSON instead of its table, to stdout without FILE."""
    return _option(
        "--json", "json_path", is_flag=False, flag_value="-", default=None, type=click.Path(dir_okay=False, allow_dash=True), help=f"write {what} as JSON ({schema}) to FILE, or to stdout when no FILE is given"
    )


def steps(help: str = "only steps A <= step < B of a recording (A:B, A:, :B)") -> Callable[[F], F]:
    """--steps A:B (parse_step_selection; record parses its own with record.options.parse_steps):
    a recording's steps for check and compile, the engine's steps to record for record."""
    return _option("--steps", "steps_spec", default=None, help=help)


def sample() -> Callable[[F], F]:
    """--sample N: N steps evenly spread over the (selected) recording."""
    return _option("--sample", type=click.IntRange(min=1), default=None, help="only N steps, evenly spread over the (selected) recording")


def max_memory(help: str) -> Callable[[F], F]:
    """--max-memory SIZE (parse_max_memory). The help is the command's: replay refuses such a step
    (exit 2), check leaves it unchecked in a recording and refuses it only as its one file."""
    return _option("--max-memory", "max_memory_spec", default=None, metavar="SIZE", help=help)


def jobs() -> Callable[[F], F]:
    """--jobs N|auto, -j (parse_jobs): worker processes checking steps."""
    return _option(
        "--jobs", "-j", "jobs_spec", default="auto", show_default=True, help="worker processes checking steps in parallel, or auto: one per 50 steps, per 2 cores, at most 8 per GPU (each worker loads every kernel module itself)"
    )


def devices() -> Callable[[F], F]:
    """--devices 0,1 (parse_devices): the GPUs of the workers."""
    return _option("--devices", "devices_spec", default=None, help="GPUs for the workers, e.g. 0,1 (default: every visible GPU)")


def only(help: str) -> Callable[[F], F]:
    """--only KIND[,KIND...]: detectors by kind (each command parses it for what it runs)."""
    return _option("--only", default=None, metavar="KIND[,KIND...]", help=help)


def layer() -> Callable[[F], F]:
    """--layer N: whose recorded tensors a step is replayed with (replay.data_layer)."""
    return _option("--layer", type=int, default=None, help="use this recorded layer's tensors (default: the first recorded layer, else seeded data)")


def cuda_graph(help: str) -> Callable[[F], F]:
    """--cuda-graph (replay, check): replays also run inside a real CUDA graph; refused without a GPU
    by require_gpu_for_cuda_graph. repro's --graph/--eager is another option: it picks how the one
    scripted step runs, and its default follows the recording."""
    return _option("--cuda-graph", is_flag=True, help=help)


def require_gpu_for_cuda_graph(cuda_graph: bool) -> None:
    """--cuda-graph on a machine without a CUDA GPU: not run here (exit 3)."""
    from attndbg import machine

    if cuda_graph and not machine.cuda_available():
        raise NotRunHere("--cuda-graph needs a CUDA GPU, and this machine has none")


def output_file(help: str, *, required: bool = True) -> Callable[[F], F]:
    """-o/--output FILE: the one file a command writes (synth, minimize, repro). synth's is not
    required: synth --list writes nothing, and synth without either says so itself."""
    return _option("-o", "--output", "output", required=required, type=click.Path(dir_okay=False), help=help)


def output_dir(help: str, *, default: str | None = None) -> Callable[[F], F]:
    """-o/--output DIR: the directory a command writes (record, import, export). Only record has a
    default (./recording, documented as `record [-o DIR]`); import and export require one. Kept as
    they were: neither is wrong, and changing either changes which command lines are accepted."""
    shown = {"default": default, "show_default": True} if default is not None else {"required": True}
    return _option("-o", "--output", "out_dir", type=click.Path(file_okay=False), help=help, **shown)


def overwrite() -> Callable[[F], F]:
    """--overwrite (record, import): replace the recording already in the output directory."""
    return _option("--overwrite", is_flag=True, help="replace an existing recording in the directory")


def parse_backends(spec: str) -> list[str]:
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


def is_every_backend(spec: str | None) -> bool:
    """--backend all: whatever runs here. A backend that cannot run is skipped and named, not a
    backend the user asked for by name (which makes the command incomplete, exit 3)."""
    return spec is not None and spec.strip() == "all"


BACKEND_OPTION_HELP = "NAME.FIELD=VALUE, repeatable: a field of that backend's options, e.g. fa3.verify_path=two-call, flashinfer.extend_path=paged, mla.impl=flashmla, triton.num_kv_splits=1"


def parse_backend_options(specs: tuple[str, ...], num_kv_splits: int | None = None) -> Any:
    """--backend-option NAME.FIELD=VALUE... (and --num-kv-splits N, the same as
    triton.num_kv_splits=N) -> BackendOptions; what each backend takes is its options dataclass."""
    from attndbg.backends import options as backend_options

    if num_kv_splits is not None:
        field = ".".join(backend_options.SPLIT_COUNT_OPTION)
        if any(spec.strip().startswith(f"{field}=") for spec in specs):
            raise BadInput(f"--num-kv-splits and --backend-option {field} set the same thing: give one")
        specs = (*specs, f"{field}={num_kv_splits}")
    try:
        return backend_options.parse(specs)
    except backend_options.OptionError as e:
        raise BadInput(str(e)) from None


def parse_step_selection(steps_spec: str | None, sample: int | None) -> Any:
    from attndbg.checks.selection import StepSelection
    from attndbg.record.options import OptionError, parse_steps

    start = stop = None
    if steps_spec:
        try:
            start, stop = parse_steps(steps_spec)
        except OptionError as e:
            raise BadInput(str(e)) from None
    return StepSelection(start=start, stop=stop, sample=sample)


def parse_max_memory(spec: str | None) -> int | None:
    """--max-memory 8G -> bytes; None: bounded by what the device has free."""
    from attndbg.record.options import OptionError, parse_size

    if spec is None:
        return None
    try:
        return parse_size(spec, "--max-memory")
    except OptionError as e:
        raise BadInput(str(e)) from None


def parse_jobs(spec: str) -> int | None:
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


def parse_devices(spec: str | None) -> tuple[int, ...] | None:
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
    if machine.cuda_available():
        import torch

        visible = torch.cuda.device_count()  # numbered as CUDA_VISIBLE_DEVICES leaves them, as the workers number them
        if max(devices) >= visible:
            raise BadInput(f"--devices {spec}: GPU {max(devices)} is not here ({visible} visible, numbered from 0)")
    return devices


def timeline(command: str, *, spawned: str | None = None, collect_here: bool = True) -> Callable[[F], F]:
    """--timeline FILE (replay, check, record): the command runs inside attndbg.timeline's recording,
    which writes the Chrome trace and its summary when the command ends, however it ends. Refused
    before any work where it cannot run (not run here: exit 3, one line): no GPU (said first: a
    CPU user is not sent to install a package first), no cupti-python, CUPTI that will not start. `spawned` names the processes the command starts that collect too; `collect_here`
    False for a command that launches no kernel itself (record: its engine's processes do). Put it
    just above `def`, under @handles_bad_input, which turns the refusal into exit 3."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, timeline_path: str | None = None, **kwargs: Any) -> Any:
            if timeline_path is None:
                return func(*args, **kwargs)
            from attndbg.cli.common import check_outputs
            from attndbg.timeline import availability, session

            check_outputs(timeline=timeline_path)
            refusal = availability.refusal()
            if refusal is not None:
                raise NotRunHere(refusal)
            try:
                recording = session.start(timeline_path, command=command, spawned_label=spawned, collect_here=collect_here)
            except availability.Unavailable as e:
                raise NotRunHere(str(e)) from None
            try:
                return func(*args, **kwargs)
            finally:
                recording.finish()

        return _option(
            "--timeline", "timeline_path", type=click.Path(dir_okay=False), default=None,
            help="(GPU) also write a Chrome trace-event timeline of attndbg's ranges and the kernels each launched, from CUPTI "
            "(open in https://ui.perfetto.dev or chrome://tracing), and print a summary per range; needs pip install 'attndbg[timeline]'",
        )(wrapper)  # type: ignore[arg-type]

    return decorate


def terminal(*, quiet: bool = False) -> Callable[[F], F]:
    """--color/--no-color (every command that prints through rich) and, with `quiet`, -q/--quiet
    (the commands with a verdict line: check, replay): the command runs with them in
    common.TERMINAL, which make_console reads. Put it just above `def`."""

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, color: bool | None = None, quiet: bool = False, **kwargs: Any) -> Any:
            token = TERMINAL.set(Terminal(color=color, quiet=quiet))
            try:
                return func(*args, **kwargs)
            finally:
                TERMINAL.reset(token)

        decorated = _option("--color/--no-color", "color", default=None, help="colour the output, or not (default: on a terminal only, and never under NO_COLOR)")(wrapper)
        if quiet:
            decorated = _option("-q", "--quiet", is_flag=True, help="print the verdict line only (no tables, no progress; errors still go to stderr)")(decorated)
        return decorated  # type: ignore[return-value]

    return decorate
