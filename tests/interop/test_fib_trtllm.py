"""flashinfer-bench workloads and TensorRT-LLM capture lines import as structure-only steps that check
clean; `export fib` writes trace sets their loader accepts (fib_schema, written from their models),
whose references reproduce the recorded outputs, and that import back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attndbg.cli import main
from attndbg.interop.fib_schema import definition_problems, evaluation_problems, trace_problems, workload_problems
from attndbg.trace import io
from tests.interop import fi_dumps

# A decode definition as flashinfer-bench's docs and FlashInfer's trace template write it
# (interop.md §2.2-2.3), smaller: no kv_last_page_len, so every last page is full.
DECODE_DEF = {
    "name": "gqa_paged_decode_h4_kv2_d64_ps16",
    "op_type": "gqa_paged",
    "tags": ["stage:decode"],
    "axes": {
        "batch_size": {"type": "var"}, "num_qo_heads": {"type": "const", "value": 4}, "num_kv_heads": {"type": "const", "value": 2},
        "head_dim": {"type": "const", "value": 64}, "num_pages": {"type": "var"}, "page_size": {"type": "const", "value": 16},
        "len_indptr": {"type": "var"}, "num_kv_indices": {"type": "var"},
    },
    "constraints": ["len_indptr == batch_size + 1", "num_kv_indices == kv_indptr[-1].item()"],
    "inputs": {
        "q": {"shape": ["batch_size", "num_qo_heads", "head_dim"], "dtype": "bfloat16"},
        "k_cache": {"shape": ["num_pages", "page_size", "num_kv_heads", "head_dim"], "dtype": "bfloat16"},
        "v_cache": {"shape": ["num_pages", "page_size", "num_kv_heads", "head_dim"], "dtype": "bfloat16"},
        "kv_indptr": {"shape": ["len_indptr"], "dtype": "int32"},
        "kv_indices": {"shape": ["num_kv_indices"], "dtype": "int32"},
        "sm_scale": {"shape": None, "dtype": "float32"},
    },
    "outputs": {"output": {"shape": ["batch_size", "num_qo_heads", "head_dim"], "dtype": "bfloat16"}, "lse": {"shape": ["batch_size", "num_qo_heads"], "dtype": "float32"}},
    "reference": "import torch\n\ndef run(q, k_cache, v_cache, kv_indptr, kv_indices, sm_scale):\n    return q, None\n",
}  # fmt: skip


def _trace_set(root: Path, scale: float = 1 / math.sqrt(128)) -> Path:
    name, op = DECODE_DEF["name"], DECODE_DEF["op_type"]
    (root / "definitions" / op).mkdir(parents=True)
    (root / "definitions" / op / f"{name}.json").write_text(json.dumps(DECODE_DEF))
    blob = Path("blob/workloads") / op / name / f"{name}_w1.safetensors"
    (root / blob).parent.mkdir(parents=True)
    save_file({"kv_indptr": torch.tensor([0, 1, 3, 6], dtype=torch.int32), "kv_indices": torch.tensor([7, 2, 3, 0, 4, 5], dtype=torch.int32)}, str(root / blob))
    ref = lambda key: {"type": "safetensors", "path": f"./{blob.as_posix()}", "tensor_key": key}  # noqa: E731
    line = {"definition": name, "solution": None, "evaluation": None, "workload": {
        "uuid": "w1", "axes": {"batch_size": 3, "num_pages": 8, "len_indptr": 4, "num_kv_indices": 6},
        "inputs": {"q": {"type": "random"}, "k_cache": {"type": "random"}, "v_cache": {"type": "random"}, "kv_indptr": ref("kv_indptr"), "kv_indices": ref("kv_indices"), "sm_scale": {"type": "scalar", "value": scale}}}}  # fmt: skip
    path = root / "workloads" / op / f"{name}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(line) + "\n")
    return path


def test_fib_workload_imports_and_checks_clean(tmp_path: Path) -> None:
    workloads = _trace_set(tmp_path / "set")
    runner = CliRunner()
    result = runner.invoke(main, ["import", "fib", str(workloads), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 0, result.output
    (trace,) = [io.load(p) for p in io.trace_paths(tmp_path / "rec")]
    assert trace.batch.kv_lens.tolist() == [16, 32, 48] and trace.model.page_size == 16 and not trace.tensors
    # flashinfer-bench's 1/sqrt(128) fallback at head_dim 64 is not the model's scale: inferred.
    assert trace.model.sm_scale == pytest.approx(1 / 8) and "model.sm_scale" in trace.source.inferred
    assert "batch.kv_lens" in trace.source.inferred  # no kv_last_page_len: last pages taken as full
    check = runner.invoke(main, ["check", str(tmp_path / "rec"), "--backend", "triton"])
    assert check.exit_code == 0, check.output
    assert "0 findings" in check.output


def test_fib_bad_blob_path_is_exit_2(tmp_path: Path) -> None:
    workloads = _trace_set(tmp_path / "set")
    workloads.write_text(workloads.read_text().replace("./blob/workloads", "../../outside"))
    result = CliRunner().invoke(main, ["import", "fib", str(workloads), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 2, result.output
    assert "leaves the trace set" in result.output and len(result.output.strip().splitlines()) == 1


def test_trtllm_capture_collapses_layers_and_checks_clean(tmp_path: Path) -> None:
    line = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "seq_lens": [5, 3], "num_cached_tokens": [0, 4], "num_contexts": 2, "dtype": "bfloat16",
            "kv_dtype": "bfloat16", "causal": True, "sliding_window": None, "q_scaling": 1.0, "page_size": 16, "cache": "paged", "sparse": "off", "is_mla": False}  # fmt: skip
    decode = dict(line, seq_lens=[1, 1], num_cached_tokens=[5, 7], num_contexts=0, sliding_window=4, q_scaling=2.0)
    path = tmp_path / "cases_rank0.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in (line, line, decode, dict(line, causal=False))))
    runner = CliRunner()
    result = runner.invoke(main, ["import", "trtllm", str(path), "-o", str(tmp_path / "rec")])
    assert result.exit_code == 0, result.output
    assert "line 4: not imported: non-causal" in result.output
    extend, dec = [io.load(p) for p in io.trace_paths(tmp_path / "rec")]
    assert extend.batch.prefix_lens.tolist() == [0, 4] and extend.batch.extend_lens.tolist() == [5, 3]
    assert dec.model.sliding_window == 3 and dec.model.sm_scale == pytest.approx(1 / (2 * 8))
    check = runner.invoke(main, ["check", str(tmp_path / "rec"), "--backend", "triton"])
    assert check.exit_code == 0, check.output


def _shape(path: Path, key: str) -> tuple[int, ...] | None:
    with safe_open(str(path), framework="pt") as f:
        return tuple(f.get_tensor(key).shape) if key in f.keys() else None


def test_export_fib_is_accepted_reproduces_and_imports_back(tmp_path: Path) -> None:
    w = fi_dumps.DumpWriter(tmp_path / "dump")
    fi_dumps.write_decode(w)
    fi_dumps.write_paged_extend(w)
    fi_dumps.write_verify(w)
    runner = CliRunner()
    assert runner.invoke(main, ["import", "flashinfer", str(tmp_path / "dump"), "-o", str(tmp_path / "rec")]).exit_code == 0
    result = runner.invoke(main, ["export", "fib", str(tmp_path / "rec"), "-o", str(tmp_path / "set")])
    assert result.exit_code == 0, result.output
    assert "step 3 not exported: a verify step's tree mask" in result.output
    root = tmp_path / "set"
    steps = [io.load(p) for p in io.trace_paths(tmp_path / "rec")]
    lines = 0
    for def_path in sorted(root.glob("definitions/*/*.json")):
        d = json.loads(def_path.read_text())
        assert definition_problems(d) == [] and def_path.parent.name == d["op_type"] and def_path.stem == d["name"]
        # Ours add kv_last_page_len and take no return_lse: not their signature, so not their name.
        assert d["name"].startswith("attndbg_gqa_paged_"), d["name"]
        namespace: dict = {}
        exec(d["reference"], namespace)  # our own reference code, written by export
        for text in (root / "workloads" / d["op_type"] / f"{d['name']}.jsonl").read_text().splitlines():
            t = json.loads(text)
            assert trace_problems(t) == [] and workload_problems(t, d, root, _shape) == []
            args = [s["value"] if s["type"] == "scalar" else load_file(str(root / s["path"]))[s["tensor_key"]] for s in (t["workload"]["inputs"][n] for n in d["inputs"])]
            out, lse = namespace["run"](*args)
            recorded = next(s for s in steps if s.tensors and s.tensors[min(s.tensors)].q.shape == args[0].shape and torch.equal(s.tensors[min(s.tensors)].q, args[0]))
            layer = recorded.tensors[min(recorded.tensors)]
            assert torch.allclose(out.float(), layer.output.float(), atol=2e-3) and torch.allclose(lse, layer.lse, atol=1e-3)
            lines += 1
            back = runner.invoke(main, ["import", "fib", str(root / "workloads" / d["op_type"] / f"{d['name']}.jsonl"), "-o", str(tmp_path / f"back{lines}")])
            assert back.exit_code == 0, back.output
            # Its values come back: the same q, and each request's keys and values in its columns.
            again = [io.load(p) for p in io.trace_paths(tmp_path / f"back{lines}")]
            imported = next(s for s in again if s.tensors and torch.equal(s.tensors[0].q, layer.q))
            assert "values" not in imported.source.inferred and imported.batch.kv_lens.tolist() == recorded.batch.kv_lens.tolist()
            for b in range(recorded.batch.batch_size):
                assert all(torch.equal(a, w) for a, w in zip(_request_kv(imported, b), _request_kv(recorded, b))), f"request {b}"
    assert lines == 3  # two decode layers and the extend


def _request_kv(trace, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys and values in column order, from the step's first recorded layer."""
    layer = trace.tensors[min(trace.tensors)]
    rows = torch.searchsorted(layer.kv_slots, trace.batch.request_slots(b))
    return layer.k_rows[rows], layer.v_rows[rows]


def test_schema_validator_rejects_what_their_models_reject() -> None:
    bad = dict(DECODE_DEF, inputs={**DECODE_DEF["inputs"], "q": {"shape": ["tokens"], "dtype": "unknown"}}, reference="def go(): pass")
    problems = definition_problems(bad)
    assert any("dtype" in p for p in problems) and any("axis 'tokens'" in p for p in problems) and any("run" in p for p in problems)
    env = {"environment": {"hardware": "H100"}, "timestamp": "2026-11-26"}
    assert evaluation_problems({**env, "status": "TIMEOUT"}) == []
    assert evaluation_problems({**env, "status": "INCORRECT_NUMERICAL", "correctness": {"max_relative_error": 1.0}}) == []
    assert evaluation_problems({**env, "status": "PASSED", "correctness": {}}) != []  # PASSED needs performance too
    assert evaluation_problems({**env, "status": "RUNTIME_ERROR", "performance": {}}) != []
    assert trace_problems({"definition": "d", "workload": {"uuid": "u", "axes": {}, "inputs": {"x": {"type": "zeros"}}}}) != []
