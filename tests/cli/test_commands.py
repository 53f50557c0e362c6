"""record, bench, show and synth at the command line: refused directories, noted layers, typos
before the GPU, show --json, and error wording."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from attndbg import machine
from attndbg.record.launch import missing_layers
from attndbg.record.options import RecordOptions
from attndbg.trace.io import ManifestEntry
from tests.cli.helpers import invoke, one_line_error, one_line_not_run
from tests.factories import write_trace

NOTHING = [sys.executable, "-c", "pass"]  # a command that records no step


def test_record_refuses_a_directory_that_holds_a_recording(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    out.mkdir()
    (out / "manifest.jsonl").write_text("")
    (out / "step_000000.pt").write_bytes(b"old")
    one_line_error(invoke("record", "-o", str(out), "--", *NOTHING), "already holds a recording", "--append", "--overwrite")
    assert (out / "step_000000.pt").read_bytes() == b"old"


def test_record_overwrite_replaces_the_recording(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    out.mkdir()
    (out / "manifest.jsonl").write_text("")
    (out / "step_000000.pt").write_bytes(b"old")
    result = invoke("record", "-o", str(out), "--overwrite", "--", *NOTHING)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == []


def test_record_overwrite_never_empties_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "thesis.tex").write_text("precious")
    one_line_error(invoke("record", "-o", str(tmp_path), "--overwrite", "--", *NOTHING), "not a recording", "thesis.tex")
    assert (tmp_path / "thesis.tex").read_text() == "precious"


def test_record_append_gives_the_new_run_its_own_file_names(tmp_path: Path) -> None:
    from attndbg.trace.directory import prepare_directory

    out = tmp_path / "rec"
    out.mkdir()
    (out / "step_000000.pt").write_bytes(b"old")
    assert prepare_directory(out, append=True, overwrite=False) == "run2_"
    (out / "run2_step_000000.pt").write_bytes(b"old")
    assert prepare_directory(out, append=True, overwrite=False) == "run3_"
    assert prepare_directory(tmp_path / "new", append=False, overwrite=False) == ""
    one_line_error(invoke("record", "-o", str(out), "--append", "--overwrite", "--", *NOTHING), "exclude each other")


def test_record_notes_layers_no_step_carried() -> None:
    entry = ManifestEntry(file="step_000000.pt", step=0, mode="DECODE", batch_size=1, graph=False, layers=[0])
    assert missing_layers(RecordOptions(out_dir="x", layers=(0, 5)), [entry]) == [5]
    assert missing_layers(RecordOptions(out_dir="x", layers=(0, 5)), []) == []


def test_bench_typo_is_reported_before_the_gpu(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.pt", "decode-mha")
    one_line_error(invoke("bench", str(trace), "--backend", "trition"), "unknown backend 'trition'")


@pytest.mark.skipif(machine.cuda_available(), reason="checks the CPU-only answer")
def test_bench_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.pt", "decode-mha")
    one_line_not_run(invoke("bench", str(trace)), "needs a CUDA GPU", "attndbg replay runs on a CPU")


def test_show_json(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.pt", "verify", "prefix_lens=4,9", "heads=2:1", "head_dim=32")
    result = invoke("show", str(trace), "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["schema"] == "attndbg.show/1" and data["batch"]["mode"] == "TARGET_VERIFY"
    assert data["batch"]["prefix_lens"] == [4, 9] and data["spec"]["mask_layout"] == "full"
    assert data["plan"]["backend"] == "triton" and data["plan"]["tensors"]["custom_mask"]["dtype"] == "bool"


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("dtype=fp16", "dtype='fp16': expected one of float16, bfloat16, float32"),
        ("kv_lens=a,b", "kv_lens='a,b': expected comma-separated integers"),
        ("page_size=x", "page_size='x': expected an integer"),
        ("mode=prefill", "mode='prefill': expected one of decode, extend"),
        ("heads=3:2", "heads='3:2': expected Q:KV with Q a multiple of KV"),
        ("head_dim=0", "head_dim='0': must be >= 1"),
        ("window=-5", "window='-5': must be >= -1 (-1 = off)"),
        ("heads=0:0", "heads='0:0': expected Q:KV head counts >= 1"),
        ("prefix_lens=3,-1", "prefix_lens='3,-1': must be >= 0"),
    ],
)
def test_synth_errors_name_the_key_typed(tmp_path: Path, word: str, message: str) -> None:
    one_line_error(invoke("synth", "extend-prefix", word, "-o", str(tmp_path / "x.pt")), message)


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"hello\n", "not a torch.save file (it starts with b'hello\\n'"), (b"", "the file is empty")],
)
def test_unreadable_file_says_what_it_is(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    one_line_error(invoke("show", str(path)), message)


def test_record_overwrite_deletes_nothing_when_another_option_is_wrong(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    out.mkdir()
    (out / "step_000000.pt").write_bytes(b"old")
    one_line_error(invoke("record", "-o", str(out), "--overwrite", "--layers", "x", "--", *NOTHING), "--layers")
    assert (out / "step_000000.pt").read_bytes() == b"old"


def test_synth_notes_keys_the_mode_does_not_use(tmp_path: Path) -> None:
    result = invoke("synth", "decode-mha", "prefix_lens=1,2", "topk=2", "kv_lens=3,5", "-o", str(tmp_path / "x.pt"))
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines() == [
        "note: prefix_lens: not used by mode=decode (used by mode=extend, mixed, verify)",
        "note: topk: not used by mode=decode (used by mode=verify)",
    ]
    assert invoke("synth", "verify", "topk=2", "-o", str(tmp_path / "y.pt")).stderr == ""
