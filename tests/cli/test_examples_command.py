"""`attndbg examples DIR`: the shipped example traces, byte for byte, into DIR; a second call writes
nothing; a file of an example's name with other content, or anything but a regular file there, is
refused in one line (exit 2) before anything is written."""

from __future__ import annotations

import os
import time
from pathlib import Path

from attndbg.examples import CHECKOUT_TRACES
from tests.cli.helpers import invoke, one_line_error

SHIPPED = sorted(CHECKOUT_TRACES.glob("*.pt"))


def test_every_example_trace_is_written_byte_for_byte_and_a_second_call_writes_nothing(tmp_path: Path) -> None:
    assert len(SHIPPED) >= 6  # the walk sees traces/
    first = invoke("examples", str(tmp_path / "traces"))
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [p.name for p in SHIPPED]
    for source in SHIPPED:
        assert (tmp_path / "traces" / source.name).read_bytes() == source.read_bytes()
    assert f"wrote {len(SHIPPED)}" in first.output
    again = invoke("examples", str(tmp_path / "traces"))
    assert again.exit_code == 0 and f"wrote 0, {len(SHIPPED)} there already" in again.output, again.output


def test_a_file_with_other_content_is_refused_unless_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "traces"
    target.mkdir()
    (target / "verify_tree.pt").write_bytes(b"mine")
    one_line_error(invoke("examples", str(target)), f"{target / 'verify_tree.pt'}: there already, with other content (--overwrite replaces it)")
    assert [p.name for p in target.iterdir()] == ["verify_tree.pt"]  # nothing written before the refusal
    assert invoke("examples", str(target), "--overwrite").exit_code == 0
    assert (target / "verify_tree.pt").read_bytes() == (CHECKOUT_TRACES / "verify_tree.pt").read_bytes()


def test_a_fifo_where_an_example_goes_is_refused_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "mixed.pt")
    start = time.monotonic()
    one_line_error(invoke("examples", str(tmp_path), "--overwrite"), "mixed.pt: there already, and not a regular file")
    assert time.monotonic() - start < 5  # never opened: reading a FIFO would wait for a writer


def test_a_missing_parent_or_a_file_as_dir_is_refused_and_no_folder_is_made(tmp_path: Path) -> None:
    one_line_error(invoke("examples", str(tmp_path / "no" / "such")), "the folder", "does not exist")
    assert not (tmp_path / "no").exists()
    (tmp_path / "f").write_text("x")
    one_line_error(invoke("examples", str(tmp_path / "f")), "not a folder")
