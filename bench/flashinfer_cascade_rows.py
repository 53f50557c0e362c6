"""Standalone reproduction: FlashInfer's cascade extend (SGLang's default extend with a prefix) on
server shapes.

Needs only torch and FlashInfer (no attndbg): attach it to a FlashInfer issue as it is.

SGLang's FlashInfer backend runs an extend step with a cached prefix as two passes merged:

    ragged  BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")   (backend "auto")
            over this step's new tokens, causal, qo_indptr == kv_indptr
    paged   BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")    over the cached prefix pages,
            not causal (every new token sees the whole prefix)
    merge   flashinfer.cascade.merge_state(o_ragged, lse_ragged, o_paged, lse_paged)  (base-2 LSEs)

For each shape (heads 32:8, head_dim 128, bf16, random data) this script runs each pass alone and
the merge, each against a float64 torch reference of the same pass, and prints per pass the largest
output error, the first failing row, and the backend FlashInfer's "auto" chose. The ragged pass is
also run with backend "fa2" and "fa3" named explicitly, so a failure is pinned to one kernel. Each
shape runs in its own process: an illegal memory access poisons the CUDA context of its process.
A bf16 attention output is right to about 1e-2 here; anything far above is wrong.

`--churn` runs each shape the way an adapter that makes a wrapper per call does while the GPU lags
the host (a 0.3 s spin queued first; each wrapper dropped after its run), once as it is and once
with `--settle` (the stream synchronised before each plan()). plan() copies its schedule from the
wrapper's pinned buffer with a cudaMemcpyAsync torch's host allocator does not track; a dropped
wrapper's pinned block goes to the next wrapper, whose plan() overwrites it before the copy runs.

    python bench/flashinfer_cascade_rows.py                 # every shape, a table on stdout
    python bench/flashinfer_cascade_rows.py --json out.json
    python bench/flashinfer_cascade_rows.py --churn          # the pinned-buffer race, and the fix
    python bench/flashinfer_cascade_rows.py --one 2303:1266:16 --ragged-backend fa3   # one, in-process
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128
# (prefix lens, extend lens, page size): the server-sweep shapes the issue reports, and controls.
SHAPES = (
    ((2303,), (1266,), 16),
    ((78,), (1063,), 1),
    ((0, 376), (128, 1864), 16),
    ((1198, 1746), (1, 1), 1),
    ((915, 2440, 2464), (1, 1, 1), 1),
    ((40, 129), (64, 100), 1),  # control: every extend under 128 rows
    ((500,), (129,), 1),  # one row past the first 128-row tile
    ((500,), (256,), 16),
)
RAGGED_BACKENDS = ("auto", "fa2", "fa3")
WRONG_ABOVE = 5e-2
TIMEOUT_S = 400
# About 0.3 s of GPU spin (torch.cuda._sleep counts clock cycles).
CHURN_CYCLES = 500_000_000


def _reference(q, k, v, *, scale: float, causal_offset: int | None):
    """float64 attention of q [n, Hq, D] over k/v [m, Hkv, D]; LSE in base 2 (FlashInfer's).
    causal_offset: key j is visible to query i when j <= i + offset (None: every key)."""
    import torch

    group = HEADS_Q // HEADS_KV
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,mhd->hnm", qd, kd) * scale
    if causal_offset is not None:
        n, m = q.shape[0], k.shape[0]
        visible = torch.arange(m, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + causal_offset
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, n]
    out = torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vd)
    return out, (lse / math.log(2)).t()  # [n, H, D], [n, H] base 2


def _errors(out, ref) -> tuple[float, int | None]:
    import torch

    err = torch.nan_to_num((out.double() - ref).abs(), nan=float("inf")).amax(dim=(1, 2) if out.dim() == 3 else 1)
    bad = (err > WRONG_ABOVE).nonzero()
    return float(err.max()), (int(bad[0]) if bad.numel() else None)


def run_one(prefix: tuple[int, ...], extend: tuple[int, ...], page: int, ragged_backend: str, *, churn: bool = False, settle: bool = False) -> dict:
    import torch
    import flashinfer

    torch.manual_seed(0)
    dev = "cuda"
    dt = torch.bfloat16
    scale = 1.0 / math.sqrt(HEAD_DIM)
    n_new = sum(extend)
    q = torch.randn(n_new, HEADS_Q, HEAD_DIM, dtype=dt, device=dev)
    k_new = torch.randn(n_new, HEADS_KV, HEAD_DIM, dtype=dt, device=dev)
    v_new = torch.randn_like(k_new)
    pages_per = [-(-p // page) for p in prefix]
    num_pages = sum(pages_per) + 1
    k_cache = torch.randn(num_pages, page, HEADS_KV, HEAD_DIM, dtype=dt, device=dev)
    v_cache = torch.randn_like(k_cache)
    # Pages handed out in reverse so no request's pages are simply 0..n (as a pool scatters them).
    perm = torch.randperm(num_pages, device=dev).to(torch.int32)
    qo_indptr = torch.tensor([0, *torch.tensor(extend).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    kv_indptr = torch.tensor([0, *torch.tensor(pages_per).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    kv_indices = perm[: sum(pages_per)].contiguous()
    last = torch.tensor([(p - 1) % page + 1 if p else 0 for p in prefix], dtype=torch.int32, device=dev)
    # FlashInfer reads last_page_len only for requests with pages; SGLang writes 1s at page 1.
    last = torch.where(torch.tensor(pages_per, device=dev) > 0, last, torch.ones_like(last))

    result: dict = {"prefix": list(prefix), "extend": list(extend), "page": page, "ragged_backend": ragged_backend}
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=dev)

    result["churn"], result["settle"] = churn, settle

    def settled() -> None:
        # plan() ends with a cudaMemcpyAsync from the wrapper's pinned buffer that torch's host
        # allocator does not know about: wait for it before that buffer can be handed out again.
        if settle:
            torch.cuda.current_stream().synchronize()

    def ragged_pass():
        # A wrapper made, planned and run, then dropped (as an adapter that makes one per call).
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend=ragged_backend)
        ragged.plan(qo_indptr, qo_indptr, HEADS_Q, HEADS_KV, HEAD_DIM, causal=True, sm_scale=scale, q_data_type=dt, kv_data_type=dt)
        settled()
        result["ragged_chosen"] = getattr(ragged, "_backend", "?")
        return ragged.run(q, k_new, v_new, return_lse=True)

    def paged_pass():
        paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        paged.plan(qo_indptr, kv_indptr, kv_indices, last, HEADS_Q, HEADS_KV, HEAD_DIM, page, causal=False, sm_scale=scale, q_data_type=dt, kv_data_type=dt)
        settled()
        return paged.run(q, (k_cache, v_cache), return_lse=True)

    torch.cuda.synchronize()
    if churn:
        # The GPU still busy with earlier work when the host plans (as in a check worker, or an
        # engine's previous layers): plan()'s host-to-device copy waits in the stream's queue.
        torch.cuda._sleep(CHURN_CYCLES)
    o_r, s_r = ragged_pass()
    o_p, s_p = paged_pass()
    o_m, s_m = flashinfer.cascade.merge_state(o_r, s_r, o_p, s_p)
    torch.cuda.synchronize()

    worst = {"ragged": (0.0, None), "ragged_lse": (0.0, None), "paged": (0.0, None), "paged_lse": (0.0, None), "merged": (0.0, None)}

    def keep(name, err):
        if err[0] > worst[name][0] or (worst[name][1] is None and err[1] is not None):
            worst[name] = (max(err[0], worst[name][0]), worst[name][1] if worst[name][1] is not None else err[1])

    for b, (q0, q1) in enumerate(zip(qo_indptr[:-1].tolist(), qo_indptr[1:].tolist())):
        qb = q[q0:q1]
        ro, rl = _reference(qb, k_new[q0:q1], v_new[q0:q1], scale=scale, causal_offset=0)
        keep("ragged", _errors(o_r[q0:q1], ro))
        keep("ragged_lse", _errors(s_r[q0:q1], rl))
        p0, p1 = kv_indptr[b].item(), kv_indptr[b + 1].item()
        kp = k_cache[kv_indices[p0:p1].long()].flatten(0, 1)[: prefix[b]]
        vp = v_cache[kv_indices[p0:p1].long()].flatten(0, 1)[: prefix[b]]
        if prefix[b]:
            po, pl = _reference(qb, kp, vp, scale=scale, causal_offset=None)
            keep("paged", _errors(o_p[q0:q1], po))
            keep("paged_lse", _errors(s_p[q0:q1], pl))
        mo, _ = _reference(qb, torch.cat([kp, k_new[q0:q1]]), torch.cat([vp, v_new[q0:q1]]), scale=scale, causal_offset=prefix[b])
        keep("merged", _errors(o_m[q0:q1], mo))
    for name, (err, row) in worst.items():
        result[name] = err
        result[f"{name}_first_bad_row"] = row
    result["ok"] = all(result[n] <= WRONG_ABOVE for n in ("ragged", "paged", "merged"))
    return result


def _spec(shape) -> str:
    prefix, extend, page = shape
    return f"{','.join(map(str, prefix))}:{','.join(map(str, extend))}:{page}"


def _parse(spec: str):
    prefix, extend, page = spec.split(":")
    return tuple(int(x) for x in prefix.split(",")), tuple(int(x) for x in extend.split(",")), int(page)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", help="PREFIXES:EXTENDS:PAGE, e.g. 2303:1266:16 (runs in this process)")
    parser.add_argument("--ragged-backend", default="auto", choices=RAGGED_BACKENDS)
    parser.add_argument("--churn", action="store_true", help="keep the GPU busy while the host plans, wrappers dropped after use")
    parser.add_argument("--settle", action="store_true", help="wait for plan()'s host-to-device copy before going on (the fix)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(*_parse(args.one), args.ragged_backend, churn=args.churn, settle=args.settle)))
        return 0
    rows = []
    modes = [[]] if not args.churn else [["--churn"], ["--churn", "--settle"]]
    for shape in SHAPES:
        for backend, mode in [(b, m) for b in (RAGGED_BACKENDS if not args.churn else ("auto",)) for m in modes]:
            cmd = [sys.executable, __file__, "--one", _spec(shape), "--ragged-backend", backend, *mode]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
                line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
                row = json.loads(line) if line else {"error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200]}
            except subprocess.TimeoutExpired:
                row = {"error": f"timed out after {TIMEOUT_S} s"}
            row.setdefault("shape", _spec(shape))
            row.setdefault("ragged_backend", backend)
            rows.append(row)
            if "error" in row:
                print(f"{_spec(shape):28} ragged={backend:4}  ERROR {row['error']}", flush=True)
            else:
                print(
                    f"{_spec(shape):28} {' '.join(m[2:] for m in mode):13} ragged={backend:4}->{row['ragged_chosen']:4}  ragged {row['ragged']:.2e} (row {row['ragged_first_bad_row']}) "
                    f"lse {row['ragged_lse']:.2e} (row {row['ragged_lse_first_bad_row']})  paged {row['paged']:.2e}  "
                    f"merged {row['merged']:.2e} (row {row['merged_first_bad_row']})  {'ok' if row['ok'] else 'WRONG'}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
