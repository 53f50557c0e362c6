"""Make small real FlashInfer level-10 dumps (GPU, FlashInfer 0.7.2.post1) and tar them into one file.

Each scenario is a real wrapper call with FlashInfer's own dump logging on (FLASHINFER_LOGLEVEL=10,
flashinfer/api_logging.py; ../shared/reference/interop.md §1): decode (two layers), paged prefill
causal over a cached prefix, paged prefill with a custom (tree) mask, ragged prefill, SGLang's
cascade (ragged + paged prefix + merge_state), MLA decode, and one decode captured in a CUDA graph
and replayed twice (each replay flushed by FlashInfer's replay hook). Shapes are tiny: the tar is
well under 2 MB. The float workspace buffers that `__init__` dumps (FlashInfer needs 128 MB of
them) are removed from the tar: the importer reads only those calls' metadata (kv_layout,
use_tensor_cores), which stays.

    bash .gpu/env.sh python bench/make_flashinfer_dumps.py --out $OUT/dumps.tar

torch and FlashInfer only (no attndbg import): the dumps are FlashInfer's, whatever attndbg does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

HQ, HKV, DIM, PAGE = 4, 2, 64, 4
WORKSPACE_BYTES = 128 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the tar file to write")
    args = parser.parse_args()
    dump = Path(tempfile.mkdtemp(prefix="fi-dumps-")) / "flashinfer_dumps"
    # Read once when flashinfer is imported (api_logging.py): set before the import below.
    os.environ.update(
        FLASHINFER_LOGLEVEL="10",
        FLASHINFER_LOGDEST=str(dump.parent / "flashinfer.log"),
        FLASHINFER_DUMP_DIR=str(dump),
        FLASHINFER_DUMP_INCLUDE="*Wrapper.__init__,*Wrapper.plan,*Wrapper.run,merge_state",
        FLASHINFER_DUMP_MAX_COUNT="200",
        FLASHINFER_DUMP_MAX_SIZE_GB="4",
    )
    import torch

    import flashinfer

    torch.manual_seed(0)
    dev = "cuda"
    f16 = torch.float16
    scale = 1 / math.sqrt(DIM)
    ws = lambda: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)  # noqa: E731

    def paged(kv_lens: list[int], spare: int = 3):
        """CSR page arrays over shuffled pages of a small NHD pool (k, v: [pages, PAGE, HKV, DIM])."""
        counts = [-(-n // PAGE) for n in kv_lens]
        total = sum(counts) + spare
        order = torch.randperm(total)[: sum(counts)].to(torch.int32)
        indptr = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
        last = torch.tensor([(n - 1) % PAGE + 1 for n in kv_lens], dtype=torch.int32)
        k = torch.randn(total, PAGE, HKV, DIM, dtype=f16, device=dev)
        v = torch.randn(total, PAGE, HKV, DIM, dtype=f16, device=dev)
        return indptr.to(dev), order.to(dev), last.to(dev), (k, v)

    exact = dict(sm_scale=scale, window_left=-1, logits_soft_cap=0.0, q_data_type=f16, kv_data_type=f16)
    ran = []

    # 1. decode, two layers sharing one plan
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_tensor_cores=False)
    indptr, indices, last, kv = paged([5, 9, 17])
    w.plan(indptr, indices, last, HQ, HKV, DIM, PAGE, **exact)
    for _ in range(2):
        w.run(torch.randn(3, HQ, DIM, dtype=f16, device=dev), kv, return_lse=True)
    ran.append("decode x2 layers")

    # 2. paged prefill, causal over a cached prefix (SGLang's paged-only extend)
    p = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2")
    indptr, indices, last, kv = paged([7, 12])
    qo = torch.tensor([0, 3, 8], dtype=torch.int32, device=dev)
    p.plan(qo, indptr, indices, last, HQ, HKV, DIM, PAGE, causal=True, **exact)
    p.run(torch.randn(8, HQ, DIM, dtype=f16, device=dev), kv, return_lse=True)
    ran.append("paged prefill causal")

    # 3. paged prefill with a custom tree mask (an EAGLE verify: 4 drafts, prefixes 6 and 10)
    trees, prefixes, n = ([-1, 0, 0, 1], [-1, 0, 1, 1]), [6, 10], 4
    blocks = []
    for parents, prefix in zip(trees, prefixes):
        anc = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            anc[i] |= anc[parents[i]]
        blocks.append(torch.cat([torch.ones(n, prefix, dtype=torch.bool), anc], dim=1).flatten())
    indptr, indices, last, kv = paged([pre + n for pre in prefixes])
    qo = torch.tensor([0, n, 2 * n], dtype=torch.int32, device=dev)
    m = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2")
    m.plan(qo, indptr, indices, last, HQ, HKV, DIM, PAGE, custom_mask=torch.cat(blocks).to(dev), causal=False, **exact)
    m.run(torch.randn(2 * n, HQ, DIM, dtype=f16, device=dev), kv, return_lse=True)
    ran.append("paged prefill custom mask")

    # 4. ragged prefill of new prompts
    r = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws(), "NHD", backend="fa2")
    qo = torch.tensor([0, 5, 8], dtype=torch.int32, device=dev)
    r.plan(qo, qo, HQ, HKV, DIM, causal=True, **exact)
    r.run(*(torch.randn(8, h, DIM, dtype=f16, device=dev) for h in (HQ, HKV, HKV)), return_lse=True)
    ran.append("ragged prefill")

    # 5. SGLang's cascade: new tokens ragged (causal), prefix paged (non-causal), merge_state
    indptr, indices, last, kv = paged([6, 9])
    qo = torch.tensor([0, 3, 5], dtype=torch.int32, device=dev)
    cr = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws(), "NHD", backend="fa2")
    cp = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD", backend="fa2")
    cr.plan(qo, qo, HQ, HKV, DIM, causal=True, **exact)
    cp.plan(qo, indptr, indices, last, HQ, HKV, DIM, PAGE, causal=False, **exact)
    q = torch.randn(5, HQ, DIM, dtype=f16, device=dev)
    o1, s1 = cr.run(q, torch.randn(5, HKV, DIM, dtype=f16, device=dev), torch.randn(5, HKV, DIM, dtype=f16, device=dev), return_lse=True)
    o2, s2 = cp.run(q, kv, return_lse=True)
    flashinfer.merge_state(o1, s1, o2, s2)
    ran.append("cascade")

    # 6. MLA decode (DeepSeek widths, page size 1), keyword arguments as 0.7.2 asks
    heads, ckv, kpe, kv_lens = 16, 512, 64, [5, 3]
    pages = sum(kv_lens) + 2
    mla = flashinfer.BatchMLAPagedAttentionWrapper(ws(), backend="fa2")
    mla.plan(
        qo_indptr=torch.tensor([0, 1, 2], dtype=torch.int32, device=dev), kv_indptr=torch.tensor([0, 5, 8], dtype=torch.int32, device=dev),
        kv_indices=torch.randperm(pages)[:8].to(torch.int32).to(dev), kv_len_arr=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
        num_heads=heads, head_dim_ckv=ckv, head_dim_kpe=kpe, page_size=1, causal=False, sm_scale=1 / math.sqrt(128 + kpe), q_data_type=f16, kv_data_type=f16,
    )  # fmt: skip
    mla.run(
        q_nope=torch.randn(2, heads, ckv, dtype=f16, device=dev), q_pe=torch.randn(2, heads, kpe, dtype=f16, device=dev),
        ckv_cache=torch.randn(pages, 1, ckv, dtype=f16, device=dev), kpe_cache=torch.randn(pages, 1, kpe, dtype=f16, device=dev), return_lse=True,
    )  # fmt: skip
    ran.append("mla decode")

    # 7. decode captured in a CUDA graph, replayed twice with a new plan and q each time
    bs, max_pages = 2, 8
    bufs = dict(
        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=dev),
    )
    g_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD", use_cuda_graph=True, use_tensor_cores=False, **bufs)
    indptr, indices, last, kv = paged([6, 9], spare=max_pages)
    g_wrapper.plan(indptr, indices, last, HQ, HKV, DIM, PAGE, **exact)
    q_static = torch.randn(bs, HQ, DIM, dtype=f16, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g_wrapper.run(q_static, kv, return_lse=True)  # warm-up (dumped as an eager run)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_wrapper.run(q_static, kv, return_lse=True)
    for kv_lens in ([7, 10], [5, 13]):
        counts = [-(-x // PAGE) for x in kv_lens]
        pages_ids = torch.randperm(sum(counts) + 4)[: sum(counts)].to(torch.int32).to(dev)
        g_wrapper.plan(torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=dev), pages_ids,
                       torch.tensor([(x - 1) % PAGE + 1 for x in kv_lens], dtype=torch.int32, device=dev), HQ, HKV, DIM, PAGE, **exact)  # fmt: skip
        q_static.copy_(torch.randn(bs, HQ, DIM, dtype=f16, device=dev))
        graph.replay()  # FlashInfer's replay hook flushes the captured run's tensors
    torch.cuda.synchronize()
    ran.append("graph decode x2 replays")

    # The __init__ records' float workspaces (128 MB each): the importer needs their metadata only.
    for init in dump.glob("*__init__*"):
        for name in ("inputs.pt", "inputs.safetensors"):
            (init / name).unlink(missing_ok=True)
    (dump / "README.txt").write_text(
        f"FlashInfer {flashinfer.__version__} level-10 dumps made by attndbg's bench/make_flashinfer_dumps.py on "
        f"{torch.cuda.get_device_name()} (torch {torch.__version__}): {', '.join(ran)}. "
        "The __init__ calls' inputs.pt (float workspace buffers) were removed to keep this small.\n"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w") as tar:
        tar.add(dump, arcname="flashinfer_dumps")
    sizes = sum(p.stat().st_size for p in dump.rglob("*") if p.is_file())
    print(json.dumps({"tar": str(out), "bytes": out.stat().st_size, "dump_bytes": sizes, "calls": len(list(dump.glob("*_call*"))), "scenarios": ran}))
    shutil.rmtree(dump.parent, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
