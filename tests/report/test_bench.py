"""The bench report without a GPU: timings whole at 80 columns, skipped backends named, verdict
and exit-relevant `incomplete`, the JSON schema."""

from __future__ import annotations

from rich.console import Console

from attndbg.replay.timing import Timing
from attndbg.report.bench import BenchResult, Timed, bench_to_json, render_bench


def _result(named: tuple[str, ...]) -> BenchResult:
    timing = Timing(backend="triton", median_us=11.1472, min_us=11.0608, max_us=1234.5678, bytes_moved=5566464, achieved_gbps=499.36)
    return BenchResult(
        trace_path="traces/decode_gqa.pt",
        mode="DECODE",
        batch_size=4,
        copy_gbps=2972.97,
        timed=(Timed(timing=timing, description="our Triton kernels"),),
        skipped=(("mla", "not an MLA model (attention=mha): use the fa3, flashinfer or triton backend"),),
        named=named,
    )


def _render(result: BenchResult, width: int) -> list[str]:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(render_bench(result))
    return console.export_text().splitlines()


def test_numbers_whole_at_80_columns() -> None:
    lines = _render(_result(("triton", "mla")), 80)
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if line.startswith("triton "))
    assert row.split()[1:] == ["11.1", "us", "11.1..1234.6", "5.6", "MB", "499", "17%"]
    assert " ".join(line.strip() for line in lines).endswith("INCOMPLETE: 1 backend timed (triton); mla skipped: not an MLA model (attention=mha)")


def test_all_may_skip_what_cannot_run() -> None:
    result = _result(())
    assert not result.incomplete and _render(result, 200)[-1].startswith("TIMED: 1 backend timed (triton)")
    data = bench_to_json(result)
    assert data["schema"] == "attndbg.bench/1" and data["verdict"] == "timed"
    assert data["timed"][0]["median_us"] == 11.1472 and data["skipped"][0]["backend"] == "mla"
