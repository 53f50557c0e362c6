"""A user's evidence of a bug, kept from FlashInfer's own dumps to a standalone script (GPU only).

A user's FlashInfer code, written here with FlashInfer's public API only (never attndbg's synth),
runs in a subprocess under FlashInfer's level-10 dump logging (FLASHINFER_LOGLEVEL=10, its log in a
file): a correct paged decode, a correct causal paged prefill, the same decode with
`last_page_len = seq_len % page_size` (0 for the request whose last page is full), the decode again
captured in a CUDA graph and replayed (FlashInfer's replay hook flushes each replay's tensors) with
two correct plans and then the wrong one, and last a decode that crashes: head_dim 80 on tensor
cores, GQA 4 (FlashInfer 0.7.2.post1 on an H100: an illegal memory access,
bench/results/flashinfer_head_dims_h100.txt; FlashInfer #4299: its FA2 prefill kernels, which
tensor-core decode runs, fault at head dims that are a multiple of 16 but not of 64). Then:

    test_import_and_check    import (exit 0) -> check --backend flashinfer: the wrong plans (eager
                             and graph replay) are defects naming last_page_len; the crash is a
                             backend-crash finding, reproduced; every correct step has no finding
                             and its plan was read (plans_unread empty)
    test_minimize_and_repro  minimize the wrong-plan step and the crash -> repro each: every script
                             runs where attndbg cannot be imported; exit 1 for both failures (the
                             symptom kept: rows over tolerance, a crash), 0 for a correct step

Each test runs the user's code itself (a module fixture): run them as two commands, each under
about 9 minutes (FlashInfer's JIT cache makes the second one's user run quick).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from attndbg.backends.flashinfer import INSTALL_HINT
from attndbg.cli import main
from attndbg.machine import module_available
from attndbg.trace import io
from tests.repro.test_repro import _run_on_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not module_available("flashinfer"), reason=INSTALL_HINT)]

USER_CODE = r'''
import sys

import torch

import flashinfer  # after the FLASHINFER_* variables: FlashInfer reads them once, at import

DEV = "cuda"
PAGE, HQ, HKV, D = 16, 8, 2, 128
F16, BF16 = torch.float16, torch.bfloat16


def workspace():
    return torch.zeros(128 << 20, dtype=torch.uint8, device=DEV)


def paged(kv_lens, *, mod=False, page=PAGE, dim=D, dtype=F16, spare=4):
    """Page table over shuffled pages of a pool. mod: last_page_len = seq_len % page (the bug)."""
    counts = [-(-n // page) for n in kv_lens]
    total = sum(counts) + spare
    indices = torch.randperm(total)[: sum(counts)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([n % page if mod else (n - 1) % page + 1 for n in kv_lens], dtype=torch.int32)
    k = torch.randn(total, page, HKV, dim, dtype=dtype, device=DEV)
    return indptr.to(DEV), indices.to(DEV), last.to(DEV), (k, torch.randn_like(k))


def decode(kv_lens, mod=False):
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=False)
    indptr, indices, last, kv = paged(kv_lens, mod=mod)
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=F16, kv_data_type=F16)
    wrapper.run(torch.randn(len(kv_lens), HQ, D, dtype=F16, device=DEV), kv, return_lse=True)
    torch.cuda.synchronize()


torch.manual_seed(0)
decode([37, 48, 20])
print("correct decode", flush=True)

prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend="fa2")
indptr, indices, last, kv = paged([40, 70])
prefill.plan(torch.tensor([0, 8, 20], dtype=torch.int32, device=DEV), indptr, indices, last, HQ, HKV, D, PAGE, causal=True, q_data_type=F16, kv_data_type=F16)
prefill.run(torch.randn(20, HQ, D, dtype=F16, device=DEV), kv, return_lse=True)
torch.cuda.synchronize()
print("correct causal prefill", flush=True)

decode([37, 48, 20], mod=True)
print("decode with last_page_len = seq_len % page_size", flush=True)

# The decode in a CUDA graph: static plan buffers, one KV pool, a plan before each replay.
bs, pool_pages = 3, 24
buffers = dict(
    paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=DEV),
    paged_kv_indices_buffer=torch.zeros(pool_pages, dtype=torch.int32, device=DEV),
    paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=DEV),
)
graphed = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_cuda_graph=True, use_tensor_cores=False, **buffers)
k_pool = torch.randn(pool_pages, PAGE, HKV, D, dtype=F16, device=DEV)
pool = (k_pool, torch.randn_like(k_pool))


def plan_graphed(kv_lens, mod=False):
    counts = [-(-n // PAGE) for n in kv_lens]
    indices = torch.randperm(pool_pages)[: sum(counts)].to(torch.int32).to(DEV)
    indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    last = torch.tensor([n % PAGE if mod else (n - 1) % PAGE + 1 for n in kv_lens], dtype=torch.int32, device=DEV)
    graphed.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=F16, kv_data_type=F16)


plan_graphed([37, 48, 20])
q_static = torch.randn(bs, HQ, D, dtype=F16, device=DEV)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    graphed.run(q_static, pool, return_lse=True)  # warm-up, outside the graph
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    graphed.run(q_static, pool, return_lse=True)
for kv_lens, mod in (([30, 48, 17], False), ([41, 32, 9], False), ([41, 32, 9], True)):
    plan_graphed(kv_lens, mod)
    q_static.copy_(torch.randn(bs, HQ, D, dtype=F16, device=DEV))
    graph.replay()  # FlashInfer's hook flushes this replay's tensors
torch.cuda.synchronize()
print("graph decode: 3 replays", flush=True)

crashing = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD", use_tensor_cores=True)
indptr, indices, last, kv = paged([37, 91], page=1, dim=80, dtype=BF16)
crashing.plan(indptr, indices, last, HQ, HKV, 80, 1, q_data_type=BF16, kv_data_type=BF16)
print("the crashing decode", flush=True)
crashing.run(torch.randn(2, HQ, 80, dtype=BF16, device=DEV), kv)
torch.cuda.synchronize()
print("NO CRASH", flush=True)
'''

STEP_TEXTS = ("correct decode", "correct causal prefill", "decode with last_page_len = seq_len % page_size", "graph decode: 3 replays", "the crashing decode")


@pytest.fixture(scope="module")
def evidence(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user's code run under FlashInfer's dumps, imported: the recording."""
    root = tmp_path_factory.mktemp("user")
    code = root / "user_code.py"
    code.write_text(USER_CODE)
    env = {
        **os.environ,
        "FLASHINFER_LOGLEVEL": "10",
        "FLASHINFER_LOGDEST": str(root / "flashinfer.log"),
        "FLASHINFER_DUMP_DIR": str(root / "dumps"),
        "FLASHINFER_DUMP_INCLUDE": "*Wrapper.__init__,*Wrapper.plan,*Wrapper.run",
        "FLASHINFER_DUMP_MAX_COUNT": "200",
        "FLASHINFER_DUMP_MAX_SIZE_GB": "8",
    }
    ran = subprocess.run([sys.executable, str(code)], capture_output=True, text=True, env=env, cwd=root, timeout=420)
    said = [line for line in ran.stdout.splitlines() if line in STEP_TEXTS or line == "NO CRASH"]  # FlashInfer prints a banner too
    assert said == list(STEP_TEXTS), f"the user's code stopped early or did not crash (exit {ran.returncode}):\n{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
    assert ran.returncode != 0 and "illegal memory access" in ran.stderr, f"the last decode did not crash as measured: {ran.stderr[-2000:]}"
    log = root / "flashinfer.log"
    result = CliRunner().invoke(main, ["import", "flashinfer", str(root / "dumps"), "--log", str(log), "-o", str(root / "rec")])
    assert result.exit_code == 0, result.output
    assert "imported as a crashed step" in result.output, result.output
    # FlashInfer logs the fault when it surfaces at its dump of the outputs (an asynchronous one
    # does); the crashed step carries that error. A fault raised inside the call is not logged.
    logged = [line for line in log.read_text(errors="replace").splitlines() if "Failed to dump outputs" in line]
    assert not logged or "illegal memory access" in result.output, f"{result.output}\nthe log's lines on it: {logged}"
    return root / "rec"


def _steps(rec: Path) -> dict[str, list[int]]:
    """Step numbers by what they are: correct, wrong (last_page_len 0), graph replays, crashed."""
    kinds: dict[str, list[int]] = {"correct": [], "wrong": [], "graph": [], "crashed": []}
    for number, path in enumerate(io.trace_paths(rec)):
        trace = io.load(path)
        if trace.source.crash is not None:
            kinds["crashed"].append(number)
            continue
        wrong = 0 in trace.plan.tensors["kv_last_page_len"].tolist()
        kinds["wrong" if wrong else "correct"].append(number)
        if trace.graph is not None and trace.graph.is_graph_replay:
            kinds["graph"].append(number)
    return kinds


def test_import_and_check(evidence: Path) -> None:
    kinds = _steps(evidence)
    # decode, prefill, graph warm-up (eager), 2 correct replays; the eager and the replayed wrong plan; the crash
    assert (len(kinds["correct"]), len(kinds["wrong"]), len(kinds["graph"]), len(kinds["crashed"])) == (5, 2, 3, 1), kinds
    report = evidence.parent / "check.json"
    result = CliRunner().invoke(main, ["check", str(evidence), "--backend", "flashinfer", "--json", str(report)])
    data = json.loads(report.read_text())
    steps = data["steps"]
    assert result.exit_code == 1, result.output
    for number in kinds["wrong"]:
        named = [f for f in steps[number]["findings"] if f["severity"] == "defect" and "last_page_len" in f["evidence"]]
        assert named and named[0]["check"] == "kv-last-page-len", steps[number]["findings"]
    assert set(kinds["wrong"]) & set(kinds["graph"]), "the wrong plan under the graph was not caught there"
    # The recorded call run again in a worker of its own (the kernels detector may crash its worker
    # on the same step too: FlashInfer's known head_dim-80 defect, a backend-crashed finding of its own).
    crashes = [f for f in steps[kinds["crashed"][0]]["findings"] if f["class"] == "backend-crash" and f["check"].startswith("recorded-crash")]
    assert len(crashes) == 1 and crashes[0]["check"] == "recorded-crash" and crashes[0]["data"]["reproduced"] is True, steps[kinds["crashed"][0]]["findings"]
    for number in kinds["correct"]:
        assert steps[number]["findings"] == [], (number, steps[number]["findings"])
    assert data["verdict"]["plans_unread"] == {} and data["verdict"]["crashes_not_run"] == {}, data["verdict"]


def _minimized_script(step: Path, out: Path, *args: str) -> tuple[Path, str]:
    small = out / f"{step.stem}_small.pt"
    result = CliRunner().invoke(main, ["minimize", str(step), "--backend", "flashinfer", "--jobs", "4", *args, "-o", str(small)])
    assert result.exit_code == 0, result.output
    script = out / f"{step.stem}_repro.py"
    written = CliRunner().invoke(main, ["repro", str(small), "--backend", "flashinfer", "-o", str(script)])
    assert written.exit_code == 0, written.output
    return script, result.output


def test_minimize_and_repro(evidence: Path, tmp_path: Path) -> None:
    kinds = _steps(evidence)
    paths = io.trace_paths(evidence)
    wrong = next(n for n in kinds["wrong"] if n not in kinds["graph"])
    script, said = _minimized_script(paths[wrong], tmp_path, "--finding", "invariants/kv-last-page-len")
    assert "its repro's symptom: mismatch" in said, said
    ran = _run_on_gpu(script, tmp_path)
    assert ran.returncode == 1 and ran.stdout.strip().splitlines()[-1] == "symptom: mismatch", ran.stdout + ran.stderr

    script, said = _minimized_script(paths[kinds["crashed"][0]], tmp_path, "--finding", "backend-crash", "--only", "invariants")
    assert "kept:    backend-crash/recorded-crash" in said and "its repro's symptom: crash" in said, said
    ran = _run_on_gpu(script, tmp_path)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert any(line.startswith("reproduced: the library call") for line in ran.stdout.splitlines()), ran.stdout

    correct = tmp_path / "correct_repro.py"
    assert CliRunner().invoke(main, ["repro", str(paths[kinds["correct"][0]]), "--backend", "flashinfer", "-o", str(correct)]).exit_code == 0
    ran = _run_on_gpu(correct, tmp_path)
    assert ran.returncode == 0 and ran.stdout.strip().splitlines()[-1] == "symptom: none", ran.stdout + ran.stderr
