"""Standalone reproduction: FlashInfer batch decode at the head dims engines use.

Needs only torch and FlashInfer (no attndbg): attach it to a FlashInfer issue as it is.

For each head_dim and each decode path (CUDA cores, tensor cores) it runs
`BatchDecodeWithPagedKVCacheWrapper` (NHD, page 1, bf16, 4 query / 4 KV heads, two requests of 37
and 91 keys, sm_scale 1/sqrt(head_dim)) against a float64 torch reference and prints the largest
absolute output error per request. Each configuration runs in its own process: an illegal memory
access poisons the CUDA context of the process it happens in, and must not hide the next result.
A bf16 decode is right to about 1e-2; anything far above is a wrong result.

    python bench/flashinfer_head_dims.py                       # the sweep, a table on stdout
    python bench/flashinfer_head_dims.py --json out.json
    python bench/flashinfer_head_dims.py --one 80 --tensor-cores   # one configuration, in this process
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

# Head dims of real models and engine tests that are not powers of two, and 128 as the control.
HEAD_DIMS = (40, 72, 80, 96, 104, 112, 128, 160, 192, 576)
KV_LENS = (37, 91)
HEADS = 4
# bf16 output rounding is 2^-8 relative; a correct kernel stays well inside this.
WRONG_ABOVE = 5e-2
TIMEOUT_S = 300
# Configurations run side by side: each JIT-compiles its own kernel first (about 30 s).
PARALLEL = 6


def run_one(head_dim: int, tensor_cores: bool) -> dict:
    import torch
    import flashinfer

    torch.manual_seed(0)
    device = "cuda"
    total = sum(KV_LENS)
    q = torch.randn(len(KV_LENS), HEADS, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(total, 1, HEADS, head_dim, dtype=torch.bfloat16, device=device)  # [pages, page_size=1, H, D]
    v = torch.randn_like(k)
    indptr = torch.tensor([0, KV_LENS[0], total], dtype=torch.int32, device=device)
    indices = torch.arange(total, dtype=torch.int32, device=device)
    last_page_len = torch.ones(len(KV_LENS), dtype=torch.int32, device=device)
    sm_scale = 1.0 / math.sqrt(head_dim)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, indices, last_page_len, HEADS, HEADS, head_dim, 1, sm_scale=sm_scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    out = wrapper.run(q, (k, v))
    torch.cuda.synchronize()
    errors = []
    for b, (start, end) in enumerate(zip(indptr[:-1].tolist(), indptr[1:].tolist())):
        kb, vb = k[start:end, 0].double(), v[start:end, 0].double()  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[b].double(), kb) * sm_scale
        ref = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), vb)
        errors.append(float((out[b].double() - ref).abs().max()))
    return {"head_dim": head_dim, "tensor_cores": tensor_cores, "max_abs": errors, "wrong": max(errors) > WRONG_ABOVE or any(map(math.isnan, errors))}


def sweep() -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    configs = [(head_dim, tensor_cores) for head_dim in HEAD_DIMS for tensor_cores in (False, True)]
    with ThreadPoolExecutor(PARALLEL) as pool:
        rows = list(pool.map(lambda c: _in_subprocess(*c), configs))
    for row in rows:
        print(_row(row), flush=True)
    return rows


def _in_subprocess(head_dim: int, tensor_cores: bool) -> dict:
    command = [sys.executable, __file__, "--one", str(head_dim)] + (["--tensor-cores"] if tensor_cores else [])
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"head_dim": head_dim, "tensor_cores": tensor_cores, "error": f"timed out after {TIMEOUT_S} s"}
    result = next((line for line in proc.stdout.splitlines() if line.startswith("{")), None)
    if proc.returncode == 0 and result:
        return json.loads(result)
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    # The library's own message: the last line that names an error.
    message = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
    return {"head_dim": head_dim, "tensor_cores": tensor_cores, "error": f"exit {proc.returncode}: {message.strip()[:300]}"}


def _row(r: dict) -> str:
    path = "tensor cores" if r["tensor_cores"] else "CUDA cores  "
    if "error" in r:
        return f"head_dim {r['head_dim']:4d}  {path}  ERROR  {r['error']}"
    errors = ", ".join(f"{e:.3g}" for e in r["max_abs"])
    return f"head_dim {r['head_dim']:4d}  {path}  {'WRONG' if r['wrong'] else 'ok   '}  max abs per request: {errors}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", type=int, default=None, help="run one head_dim in this process")
    parser.add_argument("--tensor-cores", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.tensor_cores)))
        return 0
    import flashinfer
    import torch

    print(f"FlashInfer {flashinfer.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}; "
          f"decode NHD page 1 bf16, {HEADS}:{HEADS} heads, kv lens {KV_LENS}; wrong above max abs {WRONG_ABOVE}")  # fmt: skip
    rows = sweep()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"flashinfer": flashinfer.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
