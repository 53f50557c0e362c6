"""The note that a library may be compiling on a kernel shape's first use is said only when the
first runs are slow: with warm disk caches they take milliseconds, and the note said up front was
noise repeated for every shape in every worker (~270 times per process on a server recording)."""

from __future__ import annotations

import threading

import pytest

from attndbg.replay import runner
from attndbg.trace import synth


class _Named:
    """What the note reads of an adapter: its name and its note (no kernel runs here)."""

    name = "triton"

    def first_use_note(self) -> str:
        return "Triton compiles each kernel on first use"


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(runner, "_ANNOUNCED", set())
    monkeypatch.setattr(runner, "FIRST_USE_NOTE_AFTER_S", 0.05)
    monkeypatch.delenv(runner.PREBUILT_VARIABLE, raising=False)


def _trace(head_dim: int = 64):
    return synth.build(synth.parse_spec(["decode-gqa", "heads=4:2", f"head_dim={head_dim}", "kv_lens=5,9"]))


def test_a_slow_first_use_is_explained_once(fresh, capsys: pytest.CaptureFixture[str]) -> None:
    done = threading.Event()
    with runner._explained_if_slow(_Named(), _trace()):
        done.wait(1.0)  # the note's timer fires well inside this
    err = capsys.readouterr().err
    assert err.count("attndbg: triton: first DECODE step with head_dim 64") == 1
    assert "still running after 0 s: Triton compiles each kernel on first use" in err
    with runner._explained_if_slow(_Named(), _trace()):
        done.wait(0.3)  # the same shape again: its first use is past
    assert capsys.readouterr().err == ""


def test_a_fast_first_use_and_a_prebuilt_one_say_nothing(fresh, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    with runner._explained_if_slow(_Named(), _trace()):
        pass
    threading.Event().wait(0.2)  # past the timer's delay: it was cancelled
    monkeypatch.setenv(runner.PREBUILT_VARIABLE, "1")
    with runner._explained_if_slow(_Named(), _trace(head_dim=128)):
        threading.Event().wait(0.2)
    assert capsys.readouterr().err == ""
