"""Hostile torch archives an independent fuzzer found: each is one `error:` line and exit 2
in every command, refused before torch.load builds anything (trace/archive.py), and a file name
with a newline is printed escaped."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attndbg.cli import main
from attndbg.compare.saved import load_replay
from attndbg.trace import archive
from attndbg.trace.errors import TraceError
from attndbg.detectors import registry as detectors
from attndbg.trace import io as trace_io
from tests.factories import make_trace, stored

REFERENCE = str(Path(__file__).resolve().parents[2] / "traces" / "decode_gqa.pt")
COMMANDS = {
    "show": lambda path: ["show", path],
    "check": lambda path: ["check", path, "--only", "invariants"],
    "replay": lambda path: ["replay", path, "--backend", "reference"],
    "diff": lambda path: ["diff", path, REFERENCE],
}


def _saved(data: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def _rezip(archive_bytes: bytes, *, pickle_bytes: bytes | None = None, deflate: bool = False) -> bytes:
    """The archive with its pickle replaced and/or every member deflated."""
    src = zipfile.ZipFile(io.BytesIO(archive_bytes))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = pickle_bytes if pickle_bytes is not None and info.filename.endswith("data.pkl") else src.read(info.filename)
            dst.writestr(info.filename, data, compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def _deep_key() -> bytes:
    # {((((...)))): 1}: EMPTY_DICT, MARK, EMPTY_TUPLE, TUPLE1 x 50,000, BININT1 1, SETITEMS, STOP
    return _rezip(_saved({"x": 1}), pickle_bytes=b"\x80\x02}q\x00(" + b")" + b"\x85" * 50_000 + b"K\x01u.")


def _deep_tuple_segfault() -> bytes:
    # 3,000,000 deep: hashing it as a key overflows the C stack (a segfault, not an exception)
    return _rezip(_saved({"x": 1}), pickle_bytes=b"\x80\x02}q\x00(" + b")" + b"\x85" * 3_000_000 + b"K\x01u.")


def _huge_int_layer_key() -> bytes:
    data = stored("decode-gqa")
    data["tensors"] = {10**4999: {}}
    return _saved(data)


def _huge_digit_string_layer_key() -> bytes:
    data = stored("decode-gqa")
    data["tensors"] = {"9" * 5000: {}}
    return _saved(data)


def _damaged_deflate() -> bytes:
    raw = bytearray(_rezip(_saved(stored("decode-gqa")), deflate=True))
    info = next(i for i in zipfile.ZipFile(io.BytesIO(bytes(raw))).infolist() if i.filename.endswith("data.pkl"))
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    for i in range(start + 20, start + 60):
        raw[i] ^= 0x5A
    return bytes(raw)


def _bytearray_bomb() -> bytes:
    # bytearray(2**34) through a global torch's weights_only unpickler allows: 16 GiB from 800 bytes
    return _rezip(_saved({"x": 1}), pickle_bytes=b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\x00\x04\x85R.")


def _storage_claiming_more() -> bytes:
    raw = _saved({"version": 1, "x": torch.zeros(4)})
    pickled = zipfile.ZipFile(io.BytesIO(raw)).read("archive/data.pkl")
    assert b"K\x04t" in pickled  # BININT1 4 closing the persistent id ('storage', FloatStorage, '0', 'cpu', 4)
    return _rezip(raw, pickle_bytes=pickled.replace(b"K\x04t", b"\x8a\x05\x00\x00\x00\x00\x02t", 1))


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "deep tuple key": (_deep_key, "nests deeper than 32 levels"),
    "3M-deep tuple key": (_deep_tuple_segfault, "nests deeper than 32 levels"),
    "5000-digit int layer key": (_huge_int_layer_key, "an integer of 16607 bits"),
    "5000-digit string layer key": (_huge_digit_string_layer_key, "layer keys must be layer numbers"),
    "damaged deflate stream": (_damaged_deflate, "is compressed (deflate)"),
    "bytearray(2**34)": (_bytearray_bomb, "calls builtins.bytearray"),
    "storage claiming 2**33 floats": (_storage_claiming_more, "claims 8589934592 elements"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_archives_are_one_line_in_every_command(tmp_path: Path, case: str) -> None:
    make, expected = HOSTILE[case]
    path = tmp_path / "hostile.pt"
    path.write_bytes(make())
    for command, args in COMMANDS.items():
        result = CliRunner().invoke(main, args(str(path)))
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and result.exception is None or isinstance(result.exception, SystemExit), (command, result.output)
        assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], (command, result.output)


@pytest.mark.parametrize("case", ["deep tuple key", "3M-deep tuple key", "damaged deflate stream", "bytearray(2**34)", "storage claiming 2**33 floats"])
def test_refused_before_torch_load_builds_anything(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    def load(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.load was reached")

    monkeypatch.setattr(archive.torch, "load", load)
    with pytest.raises(TraceError, match="refused|compressed|nests|claims"):
        archive.read_archive(HOSTILE[case][0]())


def test_saved_replays_are_read_through_the_same_guard(tmp_path: Path) -> None:
    path = tmp_path / "bad.replay"
    path.write_bytes(_bytearray_bomb())
    with pytest.raises(TraceError, match="calls builtins.bytearray") as e:
        load_replay(path)
    assert e.value.field == "file"


def test_a_damaged_deflate_stream_given_to_diff_is_one_line(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    a.write_bytes(_damaged_deflate())
    b.write_bytes(_damaged_deflate())
    result = CliRunner().invoke(main, ["diff", str(a), str(b)])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "is compressed (deflate)" in result.output


def test_a_list_that_contains_itself_is_refused(tmp_path: Path) -> None:
    # source.engine = l where l = [l]: EMPTY_LIST, LONG_BINPUT, LONG_BINGET, APPEND in place of the string
    data = stored("decode-gqa")
    data["source"]["engine"] = "cycle-here"
    raw = _saved(data)
    pickled = zipfile.ZipFile(io.BytesIO(raw)).read("archive/data.pkl")
    text = b"cycle-here"
    op = b"X" + len(text).to_bytes(4, "little") + text
    assert op in pickled
    memo = (999_999).to_bytes(4, "little")
    path = tmp_path / "cycle.pt"
    path.write_bytes(_rezip(raw, pickle_bytes=pickled.replace(op, b"]r" + memo + b"j" + memo + b"a", 1)))
    result = CliRunner().invoke(main, ["show", str(path)])
    assert result.exit_code == 2 and "contains itself (a cycle)" in result.output and result.output.count("\n") == 1


def test_every_shipped_trace_passes_the_guard() -> None:
    for path in sorted((Path(REFERENCE).parent).glob("*.pt")):
        assert isinstance(archive.read_archive(path.read_bytes()), dict), path


def test_a_file_name_with_a_newline_is_printed_escaped(tmp_path: Path) -> None:
    good = tmp_path / "step\nerror: forged.pt"
    good.write_bytes(Path(REFERENCE).read_bytes())
    bad = tmp_path / "bad\nerror: forged.pt"
    bad.write_bytes(b"not a trace")
    for args in (["show", str(good)], ["check", str(good), "--only", "invariants"], ["replay", str(good), "--backend", "reference"], ["show", str(bad)], ["diff", str(bad), REFERENCE]):
        result = CliRunner().invoke(main, args)
        assert not any(line.startswith("error: forged") for line in result.output.splitlines()), (args, result.output)
        assert "\\nerror: forged" in result.output, (args, result.output)


def test_a_file_name_with_rich_markup_is_printed_as_is(tmp_path: Path) -> None:
    (tmp_path / "[").mkdir()
    path = tmp_path / "[" / "]x.pt"  # '[/]x.pt': a closing tag rich would refuse to render
    # a step with a finding, so that check prints its table (200 columns) or stacked findings (80)
    trace = detectors.inject(make_trace("decode-mha", "kv_lens=3,20,7", "heads=2:1", "head_dim=32", plan=True), "invariants:decreasing-indptr")
    trace_io.save(trace, path)
    for args in (["show", str(path)], ["check", str(path), "--only", "invariants"], ["replay", str(path), "--backend", "reference"]):
        for columns in ("80", "200"):
            result = CliRunner().invoke(main, args, env={"COLUMNS": columns})
            assert result.exit_code in (0, 1) and (result.exception is None or isinstance(result.exception, SystemExit)), (args, result.output)
            assert "[/]x.pt" in result.output, (args, result.output)
