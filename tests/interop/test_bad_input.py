"""Any file an import reads is untrusted: a malformed one is one line naming the file, the field and
the first bad element, exit 2; never a traceback, never code run (pickles are vetted)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from tests.interop import fi_dumps


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch /tmp/attndbg-pwned",))


def _dump(tmp_path: Path) -> Path:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w)
    return tmp_path / "dump"


def _plan_dir(dump: Path) -> Path:
    return sorted(dump.glob("*plan_call0001"))[0]


def _break_plan_tensor(dump: Path, key: str, value: torch.Tensor) -> None:
    inputs = torch.load(_plan_dir(dump) / "inputs.pt")
    inputs[key] = value
    torch.save(inputs, _plan_dir(dump) / "inputs.pt")


CASES = {
    "decreasing indptr": (lambda d: _break_plan_tensor(d, "arg_1", torch.tensor([0, 2, 1, 3], dtype=torch.int32)), "indptr[2]"),
    "page outside the pool": (lambda d: _break_plan_tensor(d, "arg_2", torch.full((6,), 99, dtype=torch.int32)), "indices[0]"),
    "float indptr": (lambda d: _break_plan_tensor(d, "arg_1", torch.zeros(4)), "indptr"),
    "code in a pickle": (lambda d: (_plan_dir(d) / "inputs.pt").write_bytes(pickle.dumps({"arg_1": _Payload()})), "inputs.pt"),
    "random bytes": (lambda d: (_plan_dir(d) / "inputs.pt").write_bytes(b"PK\x03\x04garbage"), "inputs.pt"),
    "session line not JSON": (lambda d: (d / "session.jsonl").write_text("{oops\n" + (d / "session.jsonl").read_text()), "session.jsonl: line 1"),
    "session record not an object": (lambda d: (d / "session.jsonl").write_text("[1, 2]\n"), "line 1"),
    "path escaping the dump": (lambda d: (d / "session.jsonl").write_text(json.dumps({"function_name": "x", "process_id": 1, "dump_dir": "/remote/dumps/.."}) + "\n"), "dump_dir"),
    "no session": (lambda d: (d / "session.jsonl").unlink(), "session.jsonl"),
    "head count not an int": (lambda d: (d / "session.jsonl").write_text((d / "session.jsonl").read_text().replace('"arg_4": 4', '"arg_4": "four"')), "num_qo_heads"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_dump_is_one_line_exit_2(tmp_path: Path, case: str) -> None:
    dump = _dump(tmp_path)
    breaker, named = CASES[case]
    breaker(dump)
    result = CliRunner().invoke(main, ["import", "flashinfer", str(dump), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], result.output
    assert not Path("/tmp/attndbg-pwned").exists()
    assert not (tmp_path / "rec" / "manifest.jsonl").exists()  # all or nothing


def test_a_wrong_engine_value_is_evidence_not_bad_input(tmp_path: Path) -> None:
    """A last page longer than a page is the engine's mistake: imported as it was (check judges it)."""
    dump = _dump(tmp_path)
    _break_plan_tensor(dump, "arg_3", torch.tensor([9, 1, 1], dtype=torch.int32))
    result = CliRunner().invoke(main, ["import", "flashinfer", str(dump), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rec" / "manifest.jsonl").exists()


@pytest.mark.parametrize(
    "line,named",
    [
        ({"num_heads": 8, "num_kv_heads": 3, "head_dim": 64, "seq_lens": [1], "num_cached_tokens": [4], "num_contexts": 0, "dtype": "bfloat16", "page_size": 16}, "num_heads"),
        ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "seq_lens": [1, -2], "num_cached_tokens": [4, 4], "num_contexts": 0, "dtype": "bfloat16", "page_size": 16}, "seq_lens[1]"),
        ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "seq_lens": [1], "num_cached_tokens": [4, 4], "num_contexts": 0, "dtype": "bfloat16", "page_size": 16}, "num_cached_tokens"),
        ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "seq_lens": [1], "num_cached_tokens": [4], "num_contexts": 0, "dtype": "int8", "page_size": 16}, "dtype"),
        ([1, 2, 3], "line 1"),
    ],
)
def test_bad_trtllm_line_is_one_line_exit_2(tmp_path: Path, line: object, named: str) -> None:
    path = tmp_path / "cases_rank0.jsonl"
    path.write_text(json.dumps(line) + "\n")
    result = CliRunner().invoke(main, ["import", "trtllm", str(path), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "cases_rank0.jsonl" in lines[0], result.output
