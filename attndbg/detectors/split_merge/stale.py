"""split-merge across a recording: an engine output that is an earlier step's, bit for bit, though
the step's q and new K/V differ (attndbg/diagnose/stale_output.py): a merge or attention kernel left
out of a captured graph, whose replays return the capture's output (SGLang #5404)."""

from __future__ import annotations

from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding, finding
from attndbg.detectors.split_merge.base import KIND
from attndbg.diagnose.stale_output import CAUSE, OutputDigest, StaleOutputs, output_digests


def recording_digest(ctx: CheckContext) -> tuple[tuple[OutputDigest, ...], str] | None:
    digests = output_digests(ctx.trace)
    return (digests, ctx.path) if digests else None


class RecordingState:
    """recorded-output-stale over a recording, one step at a time."""

    def __init__(self) -> None:
        self.outputs = StaleOutputs()

    def observe(self, digest: tuple[tuple[OutputDigest, ...], str]) -> list[Finding]:
        digests, path = digest
        return [
            finding(
                KIND,
                "recorded-output-stale",
                step=stale.step,
                layer=stale.layer,
                evidence=f"the engine's output of layer {stale.layer} in step {stale.step} ({stale.graph}) is bit for bit its "
                f"output in step {stale.earlier_step} ({stale.earlier_graph}), though the two steps' q and new K/V differ",
                cause=CAUSE,
                trace=path,
                earlier_step=stale.earlier_step,
                reproductions=[stale.to_json()],
            )
            for stale in self.outputs.observe(digests)
        ]
