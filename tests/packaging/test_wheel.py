"""The wheel ships every package of the source tree: each folder holding an __init__.py under
attndbg/ and backends/ (installed as attndbg.backends), every module in it, the files read at run
time, and the example traces (traces/, installed as attndbg/examples/traces). The wheel is built
once for tests/packaging (conftest.py)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.packaging.conftest import DATA_FOLDERS, INSTALLED_AS, ROOT

# Read from the installed package at run time rather than imported (record's PYTHONPATH entry).
RUNTIME_FILES = ("attndbg/record/startup/sitecustomize.py",)


def _source_modules() -> set[str]:
    """Every .py file of every folder holding an __init__.py, by its path inside the wheel."""
    modules = set()
    for folder, target in INSTALLED_AS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            package = init.parent
            # A folder is a package only when every folder above it (up to attndbg/, backends/) is one.
            if not all((ROOT / above / "__init__.py").is_file() for above in package.relative_to(ROOT).parents[:-1]):
                continue
            relative = package.relative_to(ROOT / folder).as_posix()
            where = target if relative == "." else f"{target}/{relative}"
            modules.update(f"{where}/{module.name}" for module in package.glob("*.py"))
    return modules


@pytest.fixture(scope="module")
def wheel(built_wheel: Path) -> zipfile.ZipFile:
    return zipfile.ZipFile(built_wheel)


@pytest.fixture(scope="module")
def wheel_files(wheel: zipfile.ZipFile) -> set[str]:
    return set(wheel.namelist())


def test_the_wheel_ships_every_package_and_module(wheel_files: set[str]) -> None:
    expected = _source_modules()
    assert "attndbg/backends/triton_kernels/__init__.py" in expected  # the walk sees the layout
    missing = sorted(expected - wheel_files)
    assert not missing, f"not in the wheel: {missing}"


def test_the_wheel_ships_no_package_that_is_not_in_the_source(wheel_files: set[str]) -> None:
    shipped = {name for name in wheel_files if name.endswith(".py") and not name.startswith("attndbg-")}
    extra = sorted(shipped - _source_modules() - set(RUNTIME_FILES))
    assert not extra, f"in the wheel, not a package module of the source: {extra}"


def test_the_wheel_ships_the_files_read_at_run_time_and_the_entry_points(wheel: zipfile.ZipFile, wheel_files: set[str]) -> None:
    assert set(RUNTIME_FILES) <= wheel_files
    (entry_points,) = [name for name in wheel_files if name.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
    for line in ("attndbg = attndbg.cli:main", "attndbg_record = attndbg.record.vllm:register", "attndbg_record = attndbg.record.sglang:register"):
        assert line in text


def test_the_wheel_ships_the_example_traces(wheel_files: set[str]) -> None:
    expected = {f"{target}/{path.name}" for folder, target in DATA_FOLDERS.items() for path in (ROOT / folder).glob("*.pt")}
    assert "attndbg/examples/traces/verify_tree.pt" in expected  # the folder is seen
    missing = sorted(expected - wheel_files)
    assert not missing, f"not in the wheel: {missing}"
