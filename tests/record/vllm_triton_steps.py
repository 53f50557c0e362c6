"""vLLM's real Triton attention on the CPU, recorded: the child process of test_vllm_tensors.py.

Runs vLLM's own `TritonAttentionMetadataBuilder` and `TritonAttentionImpl` (whose kernel is vLLM's
Triton `unified_attention`, run by the Triton interpreter) over a few steps of a 3-layer model,
with `attndbg record --layers 0,2 --steps 1:5` armed, and saves everything it fed the engine
(q/k/v, each layer's cache before and after the step's K/V write, the engine's output) to
OUT/expected.pt so that the test can compare the recording with it exactly.

Why a child process: vLLM decides once, when `vllm.triton_utils` is imported, whether Triton is
usable (`HAS_TRITON`); on a machine without a GPU it says yes only when CUDA_VISIBLE_DEVICES is set
and empty (its path for distributed workers that see no device yet). That has to happen before
vLLM is imported, and the pytest process imported it long before.

Test scaffolding here, not vLLM: the `layer` argument (`AttentionLayerStub`) and the K/V write
(`write_new_kv`, what `do_kv_cache_update` does; vLLM's kernel for it queries the CUDA device).

usage: python -m tests.record.vllm_triton_steps OUT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

Q_HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
NUM_LAYERS = 3
RECORDED_LAYERS = (0, 2)
FIRST_STEP, LAST_STEP = 1, 5  # --steps 1:5

# (name, make_layout arguments); step i is STEPS[i].
STEPS: list[tuple[str, dict[str, Any]]] = [
    # Outside --steps 1:5.
    ("outside-steps", {"seq_lens": [22, 35], "query_lens": [1, 1], "seed": 7}),
    ("mixed", {"seq_lens": [30, 17, 25], "query_lens": [1, 1, 6], "seed": 11}),
    ("decode-padded", {"seq_lens": [20, 33], "query_lens": [1, 1], "blocks": [[7, 3], [5, 1, 9]], "pad_reqs": 2, "pad_tokens": 2}),
    # vLLM's kernel is handed seq_lens[1] one short: it misses request 1's last key (a wrong engine).
    ("decode-missing-key", {"seq_lens": [24, 35], "query_lens": [1, 1], "seed": 5}),
    # Forwards run while `capturing()` says a CUDA graph is being captured. The last step: it is
    # held until `finish()`, as no later build releases it.
    ("capturing", {"seq_lens": [21, 34], "query_lens": [1, 1], "seed": 6}),
]
MISSING_KEY_REQUEST = 1


def main(out: Path) -> None:
    """Importing this module (the test reads STEPS) changes nothing; main() runs the engine."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before vLLM and Triton are imported (see above)
    from attndbg.machine import select_triton_mode

    select_triton_mode()  # TRITON_INTERPRET=1: no GPU is visible now

    import torch
    from vllm import config as cfg
    from vllm.v1.attention.backends import triton_attn
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from attndbg.record import session as session_module
    from attndbg.record.vllm import adapter
    from attndbg.record.vllm import tensors as vllm_tensors
    from attndbg.record.options import RecordOptions
    from attndbg.record.session import end_session, start_session
    from tests.record.vllm_env import AttentionLayerStub, layer_name, make_layout, new_kv_cache, tiny_vllm_config, write_new_kv

    capturing = session_module.capturing

    out.mkdir(parents=True, exist_ok=True)
    vllm_config = tiny_vllm_config(out / "tiny-llama", num_layers=NUM_LAYERS)
    session = start_session(RecordOptions(out_dir=str(out / "rec"), layers=RECORDED_LAYERS, first_step=FIRST_STEP, last_step=LAST_STEP, writer="thread"))
    adapter.install()
    snapshots: list[tuple[str, list[str]]] = []
    label = "setup"
    original_snapshot = session.snapshot

    def counting_snapshot(tensors: dict[str, Any]) -> Any:
        snapshots.append((label, sorted(tensors)))
        return original_snapshot(tensors)

    session.snapshot = counting_snapshot  # type: ignore[method-assign]

    names = [layer_name(i) for i in range(NUM_LAYERS)]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    builder = triton_attn.TritonAttentionMetadataBuilder(spec, names, vllm_config, torch.device("cpu"))
    with cfg.set_current_vllm_config(vllm_config):
        impls = [triton_attn.TritonAttentionImpl(Q_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None, "auto") for _ in names]
    layers = [AttentionLayerStub(name) for name in names]
    g = torch.Generator().manual_seed(0)
    caches = [new_kv_cache(g, kv_heads=KV_HEADS, head_dim=HEAD_DIM) for _ in names]
    expected: list[dict[str, Any]] = []
    held: list[int] = []
    for name, arguments in STEPS:
        label = name
        layout = make_layout(**arguments)
        metadata = builder.build(common_prefix_len=0, common_attn_metadata=layout.cm)
        if name == "decode-missing-key":
            seq_lens = metadata.seq_lens.clone()  # a new tensor: the recorded metadata stays right
            seq_lens[MISSING_KEY_REQUEST] -= 1
            metadata.seq_lens = seq_lens
        tokens = int(layout.cm.num_actual_tokens)
        step: dict[str, Any] = {"name": name, "seq_lens": layout.seq_lens, "query_lens": layout.query_lens, "slots": [layout.slots(b) for b in range(len(layout.seq_lens))], "layers": {}}
        for i in range(NUM_LAYERS):
            q = torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=g)
            k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g)
            v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g)
            before = caches[i].clone()
            write_new_kv(caches[i], layout.cm.slot_mapping, k, v)  # vLLM 0.33 Triton writes before forward
            output = torch.zeros(tokens, Q_HEADS, HEAD_DIM)
            if name == "capturing":
                session_module.capturing = lambda: True  # type: ignore[assignment]
            try:
                returned = impls[i].forward(layers[i], q, k, v, caches[i], metadata, output=output)
            finally:
                session_module.capturing = capturing
            assert returned is output
            step["layers"][i] = {"q": q, "k": k, "v": v, "output": output.clone(), "cache_before": before, "cache_after": caches[i].clone()}
        expected.append(step)
        held.append(vllm_tensors.pending_steps())
    label = "finish"
    session.flush()
    written_before_finish = session.stats.written
    vllm_tensors.finish()
    stats = end_session()
    assert stats is not None
    torch.save(expected, out / "expected.pt")
    summary = {
        "snapshots": snapshots,
        "held": held,
        "written_before_finish": written_before_finish,
        "written": stats.written,
        "skipped_in_capture": stats.skipped_in_capture,
        "stopped_reason": stats.stopped_reason,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
