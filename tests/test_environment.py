"""`attndbg env`, `--version` and `backends --json`: what a bug report needs, read without
importing an engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attndbg import environment
from attndbg.backends import registry
from tests.cli.helpers import invoke


def test_env_names_the_versions_gpus_caches_and_triton_mode() -> None:
    result = invoke("env")
    assert result.exit_code == 0, result.output
    keys = [line.split(":", 1)[0] for line in result.output.splitlines()]
    for key in ("attndbg", "python", "torch", "triton", "flashinfer", "nvtx", "cupti-python", "sglang", "vllm", "transformers", "CUDA available", "NVIDIA driver", "triton cache", "flashinfer cache", "TRITON_INTERPRET"):
        assert key in keys, (key, result.output)
    torch_line = next(line for line in result.output.splitlines() if line.startswith("torch: "))
    assert torch.__version__ in torch_line and (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU build") in torch_line
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        assert f"GPU 0: {name}, compute capability {major}.{minor}" in result.output


def test_env_json_reports_each_cache_where_its_variable_puts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    triton_cache = tmp_path / "triton"
    (triton_cache / "abc").mkdir(parents=True)
    (triton_cache / "abc" / "kernel.cubin").write_bytes(b"x" * 3000)
    (triton_cache / "kernel.json").write_bytes(b"y" * 100)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_cache))
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path / "fi"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = invoke("env", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "attndbg.env/1" and data["torch_cuda"] == torch.version.cuda
    assert {"torch", "triton", "flashinfer", "nvtx", "cupti-python", "sglang", "vllm", "transformers"} <= set(data["packages"])
    assert data["packages"]["torch"] == torch.__version__
    caches = {c["name"]: c for c in data["caches"]}
    assert caches["triton"] == {"name": "triton", "path": str(triton_cache), "exists": True, "bytes": 3100, "files": 2, "complete": True, "source": "TRITON_CACHE_DIR"}
    assert caches["flashinfer"]["path"] == str(tmp_path / "fi" / ".cache" / "flashinfer") and not caches["flashinfer"]["exists"]
    assert data["variables"]["TRITON_INTERPRET"] == "1"
    assert len(data["gpus"]) == torch.cuda.device_count() if torch.cuda.is_available() else data["gpus"] == []
    text = invoke("env").output
    assert f"triton cache: {triton_cache} (set by TRITON_CACHE_DIR), 3.0 KiB in 2 files" in text and "TRITON_INTERPRET: 1" in text


def test_env_and_version_import_no_engine_and_version_no_torch() -> None:
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from attndbg.cli import main\n"
        "version = CliRunner().invoke(main, ['--version'])\n"
        "print(version.output.strip())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:1])\n"
        "assert CliRunner().invoke(main, ['env']).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'vllm', 'transformers', 'flashinfer')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    version, torch_modules, engines = done.stdout.strip().splitlines()
    assert version.startswith(f"attndbg {environment.package_version('attndbg')} (Python ")
    assert f"torch {torch.__version__}" in version and "triton " in version and "flashinfer " in version
    assert torch_modules == "[]" and engines == "[]"


def test_torch_cuda_build_is_read_without_importing_torch() -> None:
    assert environment.torch_cuda_build() == torch.version.cuda


def test_backends_json_is_the_table_as_data(tmp_path: Path) -> None:
    result = invoke("backends", "--json", str(tmp_path / "b.json"))
    assert result.exit_code == 0, result.output
    assert "attndbg backends" in result.output  # the table too, when the JSON goes to a file
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["schema"] == "attndbg.backends/1"
    assert [b["name"] for b in data["backends"]] == registry.backend_names()
    reference = data["backends"][0]
    assert reference["available"] and reference["unavailable"] is None and "DECODE" in reference["capabilities"]["modes"]["mha"]
    for backend in data["backends"]:
        assert backend["available"] == (backend["unavailable"] is None)
    stdout = invoke("backends", "--json")
    assert json.loads(stdout.stdout) == data  # `--json` alone: stdout, nothing else on it


def test_a_package_unpacked_without_metadata_is_named_with_its_own_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our GPU image unpacks FlashInfer onto PYTHONPATH with no dist-info: importable, so never
    'not installed'. Its version comes from its own _build_meta.py, read without importing it."""
    package = tmp_path / "fakeinfer"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "_build_meta.py").write_text('"""Build metadata."""\n__version__ = "9.8.7.post1"\n')
    bare = tmp_path / "bareinfer"
    bare.mkdir()
    (bare / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert environment.package_version("fakeinfer") == "9.8.7.post1 (no package metadata)"
    assert environment.package_version("bareinfer") == "present (no package metadata, version unknown)"
    assert environment.package_version("no-such-package-anywhere") is None
