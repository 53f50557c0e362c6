"""--version, --help and synth --list answer without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from attndbg.detectors import registry as detectors


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["synth", "--list"], ["replay", "--help"]])
def test_no_torch_import(args: list[str]) -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from attndbg.cli import main\n"
        f"result = CliRunner().invoke(main, {args!r})\n"
        "assert result.exit_code == 0, result.output\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))[:3])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"{args} imported {proc.stdout.strip()}"


def test_listed_mistakes_are_the_injections() -> None:
    """synth --list reads the catalog from source; it must name exactly what --inject runs."""
    runnable = {kind: (func.__doc__ or "").strip().splitlines()[0] for kind, func in detectors.injections().items()}
    assert detectors.injection_catalog() == runnable


def test_spec_dtype_names_match_the_schema() -> None:
    from attndbg.trace.schema import DTYPES, Q_DTYPES
    from attndbg.trace.synth_spec import KV_DTYPE_NAMES, Q_DTYPE_NAMES

    assert Q_DTYPE_NAMES == Q_DTYPES and set(KV_DTYPE_NAMES) == set(DTYPES)


def test_usage_errors_are_one_line() -> None:
    from tests.cli.helpers import invoke, one_line_error

    one_line_error(invoke("replay", "x.pt", "--repeat", "0"), "Invalid value for '--repeat'", "--help")
    one_line_error(invoke("diff", "a.pt", "b.pt", "--bogus"), "No such option '--bogus'")
    one_line_error(invoke("nosuchcommand"), "No such command 'nosuchcommand'")
    assert invoke("--version").exit_code == 0 and invoke("replay", "--help").exit_code == 0
