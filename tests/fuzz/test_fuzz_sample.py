"""A quick sample of the fuzzer (`bench/fuzz.py`; the long run is that script): mutated traces,
hostile pickles and bad manifests through check, replay, show and diff. Contract: exit 2 with one
`error:` line for bad input, 0/1/3 otherwise; never a traceback, a hang, an out-of-memory kill, a
crashed worker or code execution."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the workers are spawned: they import the module by name

import fuzz  # noqa: E402


def test_fuzz_sample_keeps_the_bad_input_contract(tmp_path: Path) -> None:
    cases = fuzz.build_cases(80, seed=11, work=tmp_path)
    assert {"value", "bytes", "pickle", "manifest", "deep", "bignum"} <= Counter(c.kind for c in cases).keys()
    outcomes = fuzz.run_cases(cases, jobs=2, memory_gb=4.0, timeout=60, reference=str(ROOT / "traces" / "decode_gqa.pt"))
    assert len(outcomes) == len(cases) * len(fuzz.COMMANDS)
    broken = [f"{o.verdict} {o.command} {o.case}: {o.detail}" for o in outcomes if o.verdict not in ("ok", "bad-input")]
    assert broken == []
    assert not (tmp_path / fuzz.MARKER).exists(), "a hostile pickle ran code"
    verdicts = Counter(o.verdict for o in outcomes)
    assert verdicts["bad-input"] > 0 and verdicts["ok"] > 0  # both sides of the contract were exercised


def test_the_classifier_catches_what_it_must() -> None:
    assert fuzz._classify("show", 1, "Traceback (most recent call last):\n ...", None, False)[0] == "traceback"
    assert fuzz._classify("show", 2, "error: a\nerror: b", None, False)[0] == "multi-line"
    assert fuzz._classify("show", 2, "error: x: field: bad", None, False)[0] == "bad-input"
    assert fuzz._classify("check", 3, "the tree-mask detector failed on this step (ValueError: x)", None, False)[0] == "detector-error"
    assert fuzz._classify("show", 1, "", RuntimeError("boom"), False)[0] == "traceback"
    assert fuzz._classify("show", -6, "", None, False)[0] == "wrong-exit"
    # a file name with a newline printed raw forges a line; printed escaped it is one line
    assert fuzz._classify("check", 0, f"case1\nerror: {fuzz.FORGED}.pt: step 0 DECODE: no findings", None, False)[0] == "raw-name"
    assert fuzz._classify("check", 0, f"case1\\nerror: {fuzz.FORGED}.pt: step 0 DECODE: no findings", None, False)[0] == "ok"
