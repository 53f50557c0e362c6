"""bench/flashinfer_sweep.py (GPU): how it reads a repro script's exit and a check's findings into
its table. The sweep itself runs on the GPU; here its reading of both is pinned on made-up results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import flashinfer_sweep  # noqa: E402


@pytest.mark.parametrize(
    ("script", "reproduced"),
    [
        ("print('reproduced: 4 of 4 rows fail the float64 reference'); raise SystemExit(1)", True),
        ("print('not reproduced: all 4 rows within tolerance of the float64 reference')", False),
        ("raise RuntimeError('CUDA error: an illegal memory access was encountered')", True),
        ("raise ValueError('a bug of the script')", None),
    ],
    ids=["wrong", "right", "crash", "broken"],
)
def test_a_repro_scripts_exit_says_whether_it_reproduced(tmp_path: Path, script: str, reproduced: bool | None) -> None:
    (tmp_path / "s.py").write_text(script)
    outcome = flashinfer_sweep.run_repro("true && python s.py", tmp_path)
    assert outcome["reproduced"] is reproduced, outcome


def test_each_step_row_says_what_each_backend_did_and_the_findings_repro() -> None:
    repro = "attndbg repro d/step_001.pt --backend flashinfer --plan derived --eager -o repro_flashinfer_step1.py && python repro_flashinfer_step1.py"
    crash = {"class": "backend-crash", "check": "backend-crashed", "data": {"backend": "flashinfer", "error": "CUDA error: an illegal memory access", "repro": repro, "version": "0.7.2.post1"}}
    wrong = {"class": "kernels", "check": "kernel-fails-reference", "data": {"backend": "flashinfer", "failing_rows": 3, "total_rows": 4, "max_abs": 0.5, "nonfinite": 0, "repro": repro}}
    check = {
        "steps": [
            {"step": 0, "checked": True, "backends": ["flashinfer", "triton"], "findings": []},
            {"step": 1, "checked": True, "backends": ["triton"], "findings": [crash]},
            {"step": 2, "checked": True, "backends": ["flashinfer", "triton"], "findings": [wrong]},
            {"step": 3, "checked": True, "backends": ["triton"], "findings": []},
        ],
        "verdict": {"skipped": {}},
    }
    result = {
        "part": "decode-tc",
        "steps": [{"step": i, "head_dim": 80, "page": 1} for i in range(4)],
        "repros": {repro: {"outcome": "exit 1: RuntimeError: CUDA error: an illegal memory access", "reproduced": True}},
    }
    rows = flashinfer_sweep.rows_of(result, check)
    assert [r["flashinfer"] for r in rows] == [
        "ok",
        "CRASH (CUDA error: an illegal memory access)",
        "WRONG (3/4 rows, max abs 0.5, 0 NaN/Inf)",
        "not run (the step is unsupported by it here)",
    ]
    assert [r["triton"] for r in rows] == ["ok"] * 4
    assert rows[1]["findings"] == ["backend-crash/backend-crashed"] and rows[1]["repro_outcome"].startswith("exit 1: RuntimeError: CUDA error")
    assert rows[1]["version"] == "0.7.2.post1" and rows[0]["repro"] is None
