"""`--backend-option NAME.FIELD=VALUE` on replay and check: parsed from each backend's options
dataclass, bad input named in one line, and the options reaching the backends that run."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from attndbg.backends import fa3, registry
from attndbg.backends.fa3 import VerifyPath
from attndbg.backends.flashinfer import ExtendPath
from attndbg.backends.mla import MLAImpl
from attndbg.backends.options import BackendOptions, parse
from attndbg.backends.triton import TritonOptions
from attndbg.detector_api.context import CheckContext, CheckOptions
from attndbg.replay import runner
from attndbg.replay.runner import ReplayOptions
from tests.cli.helpers import invoke, one_line_error
from tests.factories import make_trace, write_trace

TINY = ("heads=2:1", "head_dim=32")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "t.pt", "decode-mha", "kv_lens=3,20", *TINY)


def test_values_are_parsed_from_the_field_types() -> None:
    chosen = parse(
        [
            "flashinfer.extend_path=paged",
            "flashinfer.decode_tensor_cores=false",
            "fa3.verify_path=two-call",
            "mla.impl=flashmla",
            "triton.num_kv_splits=1",
            "triton.max_kv_splits=16",
        ]
    )
    assert chosen.of("flashinfer").extend_path is ExtendPath.PAGED and chosen.of("flashinfer").decode_tensor_cores is False
    assert chosen.of("fa3").verify_path is VerifyPath.TWO_CALL
    assert chosen.of("mla").impl is MLAImpl.FLASHMLA
    assert chosen.of("triton") == TritonOptions(num_kv_splits=1, max_kv_splits=16)
    assert parse(["flashinfer.decode_tensor_cores=none"]).of("flashinfer").decode_tensor_cores is None
    assert chosen.of("reference") is None


def test_specs_write_back_what_parse_reads_for_a_command_line() -> None:
    """A finding's repro command repeats the check's options: every field off its default, in
    parse's syntax, and nothing for a backend at its defaults."""
    specs = ["flashinfer.decode_tensor_cores=false", "flashinfer.extend_path=paged", "triton.num_kv_splits=2"]
    chosen = parse(specs)
    assert chosen.specs("flashinfer") == specs[:2] and chosen.specs("triton") == specs[2:]
    assert parse(chosen.specs("flashinfer") + chosen.specs("triton")) == chosen
    assert chosen.specs("fa3") == [] and parse(["fa3.verify_path=auto"]).specs("fa3") == []


def test_repro_writes_the_run_the_options_choose(tiny: Path, tmp_path: Path) -> None:
    """`repro --backend-option` scripts the plan the options derive (here: Triton's split count)."""
    import base64
    import io
    import re

    import torch

    for splits in (None, 3):
        out = tmp_path / f"repro_{splits}.py"
        extra = ["--backend-option", f"triton.num_kv_splits={splits}"] if splits else []
        result = invoke("repro", str(tiny), "--backend", "triton", "--plan", "derived", *extra, "-o", str(out))
        assert result.exit_code == 0, result.output
        embedded = re.search(r'^DATA = "([^"]+)"', out.read_text(), re.MULTILINE)
        tensors = torch.load(io.BytesIO(base64.b64decode(embedded[1])), weights_only=True)
        heuristic = TritonOptions().num_kv_splits is None  # SGLang's split heuristic unless told
        assert heuristic and (tensors["num_kv_splits"].tolist() == [3, 3]) == (splits == 3)


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("fa3", ["expected NAME.FIELD=VALUE"]),
        ("fa4.verify_path=mask", ["unknown backend 'fa4'", "known: reference, triton, flashinfer, fa3, mla"]),
        ("reference.x=1", ["reference backend takes no options", "triton, flashinfer, fa3, mla"]),
        ("fa3.extend_path=paged", ["fa3 has no option 'extend_path'", "its options: verify_path"]),
        ("fa3.verify_path=tree", ["'tree'", "expected one of auto, two-call, mask"]),
        ("flashinfer.extend_path=fast", ["'fast'", "auto, paged, ragged, cascade"]),
        ("mla.impl=cutlass", ["'cutlass'", "auto, flashinfer, flashmla, triton"]),
        ("flashinfer.decode_tensor_cores=maybe", ["'maybe'", "expected true or false, or none"]),
        ("triton.num_kv_splits=two", ["'two'", "expected an integer"]),
        ("triton.num_kv_splits=0", ["num_kv_splits=0", "at least 1"]),
    ],
)
@pytest.mark.parametrize("command", ["replay", "check"])
def test_bad_options_are_one_line_exit_2(tiny: Path, command: str, spec: str, needles: list[str]) -> None:
    one_line_error(invoke(command, str(tiny), "--backend-option", spec), "--backend-option", *needles)


def test_num_kv_splits_and_the_same_option_twice_is_bad_input(tiny: Path) -> None:
    result = invoke("replay", str(tiny), "--num-kv-splits", "2", "--backend-option", "triton.num_kv_splits=1")
    one_line_error(result, "--num-kv-splits", "give one")


def test_replay_runs_triton_with_the_chosen_split_count(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = []
    original = runner.replay

    def spy(*args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(runner, "replay", spy)
    for option in ([], ["--backend-option", "triton.num_kv_splits=1"]):
        result = invoke("replay", str(tiny), "--backend", "triton", *option)
        assert result.exit_code == 0, result.output
    default, forced = (r.runs[0].plan.tensors["num_kv_splits"].tolist() for r in results)
    assert default != [1, 1] and forced == [1, 1]  # the heuristic splits the 20-token request; the option does not


def test_an_option_for_a_backend_not_run_is_noted(tiny: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    result = invoke("replay", str(tiny), "--backend", "reference", "--backend-option", "fa3.verify_path=two-call", "--json", str(report), columns=200)
    assert result.exit_code == 0, result.output
    assert "note: --backend-option fa3.*: sets the fa3 backend's options; fa3 is not among the backends run" in result.stdout


def test_registry_gives_each_backend_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen = parse(["fa3.verify_path=two-call", "flashinfer.extend_path=paged", "mla.impl=flashmla"])
    chain = make_trace("verify-chain", *TINY)
    assert registry.create("fa3").derive_plan(chain).scalars["verify_path"] == "causal"
    assert registry.create("fa3", options=chosen).derive_plan(chain).scalars["verify_path"] == "two-call"
    monkeypatch.setattr(fa3, "select_impl", lambda: fa3.Impl.SGL_KERNEL)  # describe() names the path without a GPU
    assert "for every verify step" in registry.create("fa3", options=chosen).describe()
    extend = make_trace("extend-prefix", *TINY)
    assert registry.create("flashinfer").derive_plan(extend).scalars["path"] == "cascade"
    assert registry.create("flashinfer", options=chosen).derive_plan(extend).scalars["path"] == "paged"
    mla = registry.create("mla", options=chosen)
    assert mla.impl() is MLAImpl.FLASHMLA and mla.describe().startswith("FlashMLA")


def test_check_options_carry_them_to_workers_and_every_replay() -> None:
    chosen = parse(["fa3.verify_path=two-call", "triton.num_kv_splits=1"])
    options = CheckOptions(backends=("triton",), backend_options=chosen)
    assert pickle.loads(pickle.dumps(options)) == options  # check's workers get CheckOptions pickled
    forced = BackendOptions((("triton", TritonOptions(num_kv_splits=4)),))
    merged = chosen.overridden_by(forced)  # a detector forcing Triton's splits keeps them, the rest are the user's
    assert merged.of("triton").num_kv_splits == 4 and merged.of("fa3").verify_path is VerifyPath.TWO_CALL
    ctx = CheckContext(make_trace("decode-mha", "kv_lens=3,20", *TINY), "t.pt", options)
    result = ctx.replay(ReplayOptions())
    assert result.runs[0].plan.tensors["num_kv_splits"].tolist() == [1, 1]

