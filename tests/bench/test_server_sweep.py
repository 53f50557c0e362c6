"""bench/server_sweep.py: the server-shaped recording is deterministic (same seed, same bytes,
whatever the number of build processes), loads step by step, and holds the mode mix its
docstring states."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # the build workers are spawned: they import the module by name

import server_sweep  # noqa: E402

from attndbg.trace import io  # noqa: E402


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_same_seed_same_bytes_and_every_step_loads(tmp_path: Path) -> None:
    one, two = tmp_path / "a", tmp_path / "b"
    server_sweep.make(one, 30, seed=3, jobs=1, progress=False)
    server_sweep.make(two, 30, seed=3, jobs=2, progress=False)
    assert _files(one) == _files(two)
    entries = io.read_manifest(one)
    assert [e.step for e in entries] == list(range(30))
    modes = Counter()
    for entry in entries:
        trace = io.load(one / entry.file)
        assert trace.source.step == entry.step and trace.batch.forward_mode.value == entry.mode
        assert trace.plan is not None, entry  # every step carries its engine backend's plan
        if trace.graph is not None:
            assert trace.graph.capture_bs >= trace.batch.batch_size
        modes[entry.mode] += 1
    assert set(modes) == {"DECODE", "TARGET_VERIFY", "EXTEND", "MIXED"}, modes
    shapes = [json.loads(line) for line in (one / server_sweep.SHAPES).read_text().splitlines()]
    assert [s["step"] for s in shapes] == list(range(30)) and not any(s["no_plan"] for s in shapes)


def test_another_seed_another_recording(tmp_path: Path) -> None:
    assert server_sweep.draw_all(20, 0) != server_sweep.draw_all(20, 1)


def test_the_mix_is_the_stated_one() -> None:
    draws = server_sweep.draw_all(2000, 0)
    modes = Counter(d.mode for d in draws)
    for mode, share in server_sweep.MODES:
        assert abs(modes[mode] / len(draws) - share) < 0.04, (mode, modes)
    assert {d.engine for d in draws} == {"sglang", "vllm"}
    assert any(d.mla for d in draws)
    graph = [d for d in draws if d.mode in ("decode", "verify")]
    assert all(d.capture_bs in d.capture_sizes for d in graph)
    trees = Counter(w for d in draws if d.mode == "verify" for w in d.words if w.startswith("topk="))
    assert {"topk=1", "topk=4"} <= set(trees)
    assert any("window=4095" in d.words for d in draws) and any("logit_cap=50.0" in d.words for d in draws)


def test_a_sliced_check_resumes_where_it_stopped(tmp_path: Path) -> None:
    """--slice-steps: each slice is its own check and JSON; a slice already checked is not run
    again (a device call's time limit loses one slice at most), and the parts merge into one JSON."""
    rec = tmp_path / "rec"
    server_sweep.make(rec, 8, seed=5, jobs=1, progress=False)
    out = tmp_path / "out" / "eager.json"
    only = ["--only=invariants"]
    first = server_sweep.run_sliced(rec, "reference", cuda_graph=False, jobs="1", json_out=out, slice_steps=5, extra=only)
    parts = sorted(p.name for p in out.parent.glob("eager.steps-*.json"))
    assert parts == ["eager.steps-000000-000005.json", "eager.steps-000005-000008.json"]
    assert first["slices"].startswith("2 of 2 slices of 5 steps checked, 2 of them by this call")
    merged = json.loads(out.read_text())
    assert [s["step"] for s in merged["steps"]] == list(range(8)) and merged["verdict"]["line"].count(" | ") == 1
    (out.parent / parts[1]).unlink()
    again = server_sweep.run_sliced(rec, "reference", cuda_graph=False, jobs="1", json_out=out, slice_steps=5, extra=only)
    assert again["slices"].startswith("2 of 2 slices of 5 steps checked, 1 of them by this call")
    assert any("--steps=5:8" in word for word in again["command"])
    assert [s["step"] for s in json.loads(out.read_text())["steps"]] == list(range(8))


def test_layer_kinds_are_opt_in_and_change_only_their_steps() -> None:
    """--layer-kinds: about 10 % of SGLang's MHA steps become gpt-oss sink layers and 10 % run a
    scaled fp8 cache, every other step drawn as without the flag; each such step builds with a plan."""
    plain, kinds = server_sweep.draw_all(400, 0), server_sweep.draw_all(400, 0, layer_kinds=True)
    changed = [(a, b) for a, b in zip(plain, kinds) if a != b]
    assert all(a.words == b.words[: len(a.words)] and a.engine == "sglang" and not a.mla for a, b in changed)
    sinks = [b for _, b in changed if "sinks=1" in b.words]
    fp8 = [b for _, b in changed if "kv_dtype=float8_e4m3fn" in b.words]
    mha = sum(1 for d in plain if d.engine == "sglang" and not d.mla)
    assert len(sinks) + len(fp8) == len(changed) and 0.05 < len(sinks) / mha < 0.15 and 0.05 < len(fp8) / mha < 0.15
    for draw in (sinks[0], fp8[0], next(d for d in sinks if d.mode == "verify")):
        trace, note = server_sweep.build_step(draw)
        assert not note and trace.plan is not None, (draw.words, note)
        assert (trace.model.sinks is not None) == (draw in sinks)
