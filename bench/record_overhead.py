"""Per-step cost of metadata-only recording on a CUDA-graph decode loop (GPU).

The loop is transformers' continuous batching with CUDA graphs on (decode steps replay a captured
graph), a random Llama, bf16, many requests decoding together. Three configurations, interleaved
over several rounds so clock drift hits all of them alike:
  off        the adapter not installed
  idle       installed, no session (what every engine process pays once `attndbg` is installed)
  thread     a session recording every step's metadata (no tensors), saved by the writer thread
  process    the same, saved by the writer process (the default): the engine process only packs
Reported: median wall time per step of each, the overhead of recording in microseconds and in
percent, and how many steps were written.

Run on the GPU machine (transformers wheels carried in .gpu-hf/):
  bash .gpu/env.sh bash -c 'pip install -q --no-index --no-deps --target /tmp/hf .gpu-hf/*.whl;
      PYTHONPATH=/tmp/hf:$PYTHONPATH python bench/record_overhead.py'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attndbg.record.transformers import adapter as transformers_cb  # noqa: E402
from attndbg.record.options import RecordOptions  # noqa: E402
from attndbg.record.session import end_session, start_session  # noqa: E402
from attndbg.trace import io  # noqa: E402


def build_model(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128, num_key_value_heads=max(1, args.hidden // 512),
        head_dim=128, vocab_size=32000, max_position_embeddings=4096,
    )
    model = LlamaForCausalLM(config).eval().to(device="cuda", dtype=torch.bfloat16)
    model.set_attn_implementation("sdpa")
    return model


def run(model, args: argparse.Namespace) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from transformers.generation.continuous_batching import model_runner

    steps = [0]
    inner = model_runner.ModelRunner.compute_batch

    def counted(self, m, batch_data):  # type: ignore[no-untyped-def]
        steps[0] += 1
        return inner(self, m, batch_data)

    model_runner.ModelRunner.compute_batch = counted
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 32000, (int(n),), generator=g).tolist() for n in torch.randint(args.prompt // 2, args.prompt, (args.requests,), generator=g)]
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=args.blocks, max_batch_tokens=args.max_batch_tokens, use_cuda_graph=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate_batch(prompts, generation_config=generation, continuous_batching_config=batching)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model_runner.ModelRunner.compute_batch = inner
    return seconds, steps[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model = build_model(args)
    run(model, args)  # warm-up: graph capture, allocator
    per_step: dict[str, list[float]] = {"off": [], "idle": [], "thread": [], "process": []}
    written = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for config in per_step:
                if config == "off":
                    transformers_cb.uninstall()
                else:
                    transformers_cb.install()
                recording = config in ("thread", "process")
                session = start_session(RecordOptions(out_dir=f"{tmp}/{config}{round_}", writer=config)) if recording else None
                seconds, steps = run(model, args)
                if session is not None:
                    stats = end_session()  # flushes the writer: its time after the loop is not the engine's
                    written[f"{config}{round_}"] = {"steps": steps, "written": stats.written if stats else 0, "dropped": stats.dropped_queue_full if stats else 0, "hook_us_per_step": stats.hook_seconds / steps * 1e6 if stats else 0}
                per_step[config].append(seconds / steps * 1e6)
                print(f"round {round_} {config:9s} {steps} steps {seconds:.3f} s {seconds / steps * 1e6:.1f} us/step", flush=True)
        modes = sorted({e.mode for e in io.read_manifest(f"{tmp}/process0")})
    transformers_cb.uninstall()
    median = {k: statistics.median(v) for k, v in per_step.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "config": vars(args),
        "us_per_step_median": median,
        "overhead_us_per_step": {k: median[k] - median["off"] for k in ("idle", "thread", "process")},
        "overhead_percent": {k: 100 * (median[k] / median["off"] - 1) for k in ("idle", "thread", "process")},
        "written_steps_dropped": written,
        "recorded_modes": modes,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
