"""split-merge, empty states: our stage 2 driven directly with crafted partials (empty splits
marked -inf or +inf, every split empty), reported where the trace reaches the case.
"""

from __future__ import annotations

import functools

import torch

from attndbg.backends import registry
from attndbg.backends.base import PartialStates
from attndbg.backends.triton import TritonBackend
from attndbg.backends.triton_kernels.split_rule import MIN_BLOCK_KV, empty_splits
from attndbg.detector_api.context import CheckContext
from attndbg.detector_api.findings import Finding
from attndbg.detectors.split_merge.base import KIND, _location
from attndbg.detectors.split_merge.counts import split_configs
from attndbg.replay import runner
from attndbg.trace.schema import ForwardMode


# Crafted stage-2 probe: 40 tokens in 4 splits are two splits (32 + 8) and two empty ones.
PROBE_LEN, PROBE_SPLITS = 40, 4


CONTROL = "control: two non-empty splits"


@functools.cache
def stage2_probe(dv: int) -> dict[str, str | None]:
    """Our stage 2 on crafted partials; for each case None (right) or what went wrong.

    Rows: (0) 40 tokens in 4 splits, the two empty splits' scratch holding NaN outputs and -inf
    LSEs; (1) the same states with +inf LSEs in the empty splits (FA2's empty marker); (2) 0 tokens
    in 2 splits (every state empty); (3) the control, 64 tokens in 2 non-empty splits. Rows 0, 1
    and 3 must equal the float64 merge of their non-empty splits, row 2 must be 0 with LSE -inf.
    A failing control means the merge is wrong with or without empty states.
    """
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1, PROBE_SPLITS, dv, generator=g)
    lse = torch.randn(4, 1, PROBE_SPLITS, generator=g) + 3.0
    used = PROBE_SPLITS - empty_splits(PROBE_LEN, PROBE_SPLITS)
    logits[1], lse[1] = logits[0], lse[0]  # the same states; only the empty splits' marker differs
    logits[:2, :, used:] = float("nan")
    lse[0, :, used:] = float("-inf")
    lse[1, :, used:] = float("inf")
    logits[2], lse[2] = float("nan"), float("-inf")
    lengths = [PROBE_LEN, PROBE_LEN, 0, 2 * MIN_BLOCK_KV]
    splits = [PROBE_SPLITS, PROBE_SPLITS, 2, 2]
    states = PartialStates(logits, lse, kv_lens=torch.tensor(lengths), num_splits=torch.tensor(splits))
    # The probe is per process (cached), not per step: its adapter comes from the registry itself.
    merged = runner.merge(registry.create(TritonBackend.name), states, what="decode_stage2 on crafted partials")
    o, out_lse = merged.output.double(), merged.lse.double()
    cases = {}
    for row, name in ((3, CONTROL), (0, "empty splits marked -inf"), (1, "empty splits marked +inf (FA2's convention)")):
        n = splits[row] - empty_splits(lengths[row], splits[row])
        w = torch.softmax(lse[row, 0, :n].double(), dim=0)
        expected = (w[:, None] * logits[row, 0, :n].double()).sum(0)
        expected_lse = torch.logsumexp(lse[row, 0, :n].double(), dim=0)
        err = float(torch.nan_to_num((o[row, 0] - expected).abs(), nan=float("inf")).max())
        lse_err = float(torch.nan_to_num((out_lse[row, 0] - expected_lse).abs(), nan=float("inf")))
        ok = err <= 1e-5 and lse_err <= 1e-5
        cases[name] = None if ok else f"output off by {err:.3e}, LSE {float(out_lse[row, 0]):.4f} (expected {float(expected_lse):.4f})"
    zero_ok = bool((o[2] == 0).all()) and bool(torch.isneginf(out_lse[2]).all())
    cases["every split empty (no KV)"] = None if zero_ok else f"output {o[2, 0, :4].tolist()}..., LSE {out_lse[2].tolist()} (expected 0 and -inf)"
    return cases


def empty_split_merge(ctx: CheckContext) -> list[Finding]:
    trace = ctx.trace
    if trace.batch.forward_mode is not ForwardMode.DECODE or TritonBackend.name not in ctx.backends():
        return []
    configs, lengths = split_configs(ctx)
    short = [(b, c) for c in configs for b, n in enumerate(lengths) if empty_splits(n, c.splits[b]) > 0]
    graph = trace.graph
    no_kv = [b for b, n in enumerate(lengths) if n == 0]
    if graph is not None and graph.is_graph_replay:
        padded = graph.padded_seq_lens[trace.batch.batch_size : graph.capture_bs]
        no_kv += [trace.batch.batch_size + i for i in torch.nonzero(padded == 0).flatten().tolist()]
    if not short and not no_kv:
        return []
    cases = stage2_probe(trace.model.v_head_dim)
    if cases[CONTROL] is not None:
        return []  # the merge is wrong without any empty state: the split-count runs report that
    findings = []
    for case, problem in cases.items():
        if problem is None:
            continue
        reached = no_kv[:1] if case.startswith("every split") else [b for b, _ in short[:1]]
        if not reached:
            continue
        b = reached[0]
        how = "a padded or empty request" if case.startswith("every split") else f"request {b} (kv {lengths[b]}) under {short[0][1].label}"
        findings.append(
            Finding(
                KIND,
                "empty-split-merge",
                _location(ctx, request=b),
                f"our stage 2 on crafted partials, case '{case}': {problem}; this step reaches the case at {how}",
                "The split merge does not skip empty states: exp(-inf - -inf) (or an FA2 +inf marker) enters the "
                "weights and the merged row becomes NaN (FlashInfer #4051).",
                data={"case": case, "problem": problem},
            )
        )
    return findings
