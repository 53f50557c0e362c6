"""Per-step cost of recording on a CUDA-graph decode loop (GPU).

The loop is transformers' continuous batching with CUDA graphs on (decode steps replay a captured
graph), a random Llama, bf16, many requests decoding together. Configurations (--configs), run in
interleaved rounds so clock drift hits all of them alike, each against `off` in the same run:
  off         the adapter not installed
  idle        installed, no session (what every engine process pays once `attndbg` is installed)
  thread      a session recording every step's metadata (no tensors), saved by the writer thread
  process     the same, saved by the writer process (the default): the engine process only packs
  ring        the flight recorder (`record --ring 64`): every step's metadata kept in host memory,
              nothing written (no trigger fires)
  ring_probe  the same with `--layers 0`: layer 0's q, new k/v and output of every graph-replayed
              step copied out by in-graph probes (record/probes.py)
Reported: median wall time per step of each, the overhead of recording in microseconds and in
percent (of the medians, and the median of each round's run against that round's `off`, which the
verdicts read), what was written (nothing in ring mode: that is checked), the hook's microseconds per
step on the engine's thread (the mean and, in ring mode, the median step once the ring is full),
the ring's pinned buffers reused and allocated, and, for ring_probe, how many replayed steps carried
probe readings (the ring's steps are read back at the end of each round).
The flight recorder's budget (ring <= 2 %, ring_probe <= 5 % per step) is printed as verdicts.

Run on the GPU machine (transformers wheels carried in .gpu-hf/):
  bash .gpu/env.sh bash -c 'pip install -q --no-index --no-deps --target /tmp/hf .gpu-hf/*.whl;
      PYTHONPATH=/tmp/hf:$PYTHONPATH python bench/record_overhead.py'
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attndbg.record.transformers import adapter as transformers_cb  # noqa: E402
from bench.ring_hook_cpu import _hook_per_step, hook_profile_text, profile_hook  # noqa: E402
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
    parser.add_argument("--configs", default="off,ring,ring_probe", help=f"comma-separated, from {','.join(CONFIGS)} (off is always run)")
    parser.add_argument("--ring", type=int, default=64, help="ring depth of the ring configurations")
    parser.add_argument("--json", help="write the results as JSON")
    parser.add_argument("--profile-hook", action="store_true", help="after the rounds, one more round of each ring configuration with the hook under cProfile (its thread only, the engine's call left out): the top functions by own time")
    args = parser.parse_args()
    chosen = ["off"] + [c for c in args.configs.split(",") if c and c != "off"]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        print(f"--configs: unknown {unknown[0]!r}; known: {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    model = build_model(args)
    run(model, args)  # warm-up: graph capture, allocator
    per_step: dict[str, list[float]] = {config: [] for config in chosen}
    written = {}
    with tempfile.TemporaryDirectory() as tmp:
        configs = list(per_step)
        for round_ in range(args.rounds):
            # Each round starts one configuration later, so none always runs first (a round's first
            # run pays for whatever the previous round left behind: allocator, GC, clocks).
            for config in configs[round_ % len(configs) :] + configs[: round_ % len(configs)]:
                if config == "off":
                    transformers_cb.uninstall()
                else:
                    transformers_cb.install()
                options = session_options(config, f"{tmp}/{config}{round_}", args.ring)
                session = start_session(options) if options is not None else None
                # Each ring step's hook time, for its median once the ring is full: the mean over all
                # steps carries the first steps' pinned allocations (up to 0.8 ms each on the H100).
                # The wrapper costs a list append a step, inside the timed loop.
                hook_steps = _hook_per_step(transformers_cb) if options is not None and options.ring else None
                seconds, steps = run(model, args)
                if hook_steps is not None:
                    transformers_cb._on_step = transformers_cb._on_step.__wrapped__
                if session is not None:
                    ring = ring_contents(session) if options.ring else None
                    stats = end_session()  # flushes the writer: its time after the loop is not the engine's
                    written[f"{config}{round_}"] = {
                        "steps": steps,
                        "written": stats.written if stats else 0,
                        "dropped": stats.dropped_queue_full if stats else 0,
                        "hook_us_per_step": stats.hook_seconds / steps * 1e6 if stats else 0,
                        **({"hook_us_median_full_ring": statistics.median(hook_steps[args.ring :] or hook_steps) * 1e6} if hook_steps else {}),
                        "stopped": stats.stopped_reason if stats else None,
                        **({"ring": ring} if ring is not None else {}),
                    }
                per_step[config].append(seconds / steps * 1e6)
                print(f"round {round_} {config:10s} {steps} steps {seconds:.3f} s {seconds / steps * 1e6:.1f} us/step", flush=True)
        modes = sorted({e.mode for e in io.read_manifest(f"{tmp}/process0")}) if "process" in per_step else []
        if args.profile_hook:  # after the timed rounds: the profiler's own cost is in none of them
            for config in [c for c in per_step if c.startswith("ring")]:
                transformers_cb.install()
                start_session(session_options(config, f"{tmp}/{config}_profiled", args.ring))
                profiler = cProfile.Profile()
                profile_hook(transformers_cb, profiler)
                run(model, args)
                transformers_cb._on_step = transformers_cb._on_step.__wrapped__
                end_session()
                print(f"hook profile, {config}:\n{hook_profile_text(profiler)}", flush=True)
    transformers_cb.uninstall()
    median = {k: statistics.median(v) for k, v in per_step.items()}
    others = [k for k in per_step if k != "off"]
    percent = {k: 100 * (median[k] / median["off"] - 1) for k in others}
    # The same comparison paired by round: each round's run against that round's `off`, so drift
    # between rounds (the machine's clocks, the host's other work) cancels; the verdict reads it.
    paired = {k: [100 * (v / o - 1) for v, o in zip(per_step[k], per_step["off"])] for k in others}
    paired_median = {k: statistics.median(v) for k, v in paired.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "config": vars(args),
        "us_per_step_median": median,
        "us_per_step_rounds": per_step,
        "overhead_us_per_step": {k: median[k] - median["off"] for k in others},
        "overhead_percent": percent,
        "overhead_percent_by_round": paired,
        "overhead_percent_paired_median": paired_median,
        "verdicts": {
            k: f"{paired_median[k]:.2f} % {'<=' if paired_median[k] <= LIMITS[k] else '>'} {LIMITS[k]} % (median of {len(paired[k])} rounds, each against its own off)"
            for k in others
            if k in LIMITS
        },
        "written_steps_dropped": written,
        "recorded_modes": modes,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


CONFIGS = ("off", "idle", "thread", "process", "ring", "ring_probe")
LIMITS = {"ring": 2.0, "ring_probe": 5.0}  # percent per step, the flight recorder's budget


def session_options(config: str, out_dir: str, ring: int) -> RecordOptions | None:
    if config in ("thread", "process"):
        return RecordOptions(out_dir=out_dir, writer=config)
    if config == "ring":
        return RecordOptions(out_dir=out_dir, ring=ring)
    if config == "ring_probe":
        return RecordOptions(out_dir=out_dir, ring=ring, layers=(0,))
    return None


def ring_contents(session) -> dict:  # type: ignore[no-untyped-def]
    """What the ring holds at the end of a round (read back on the host, after the timing): its
    steps and, for probes, how many carry layer 0's four tensors."""
    entries = session.flight.ring.take()
    with_layer = 0
    for entry, _ in entries:
        host = entry.copy.wait()
        with_layer += all(host.get(f"layer0.{name}") is not None for name in ("q", "k_new", "v_new", "output"))
    pool = getattr(session.flight, "pool", None)  # the ring's pinned buffers (trees before the pool have none)
    reuse = {"buffers_reused": pool.reused, "buffers_allocated": pool.allocated} if pool is not None else {}
    return {"steps": len(entries), "with_layer0": with_layer, "written_before_exit": session.stats.written, **reuse}


if __name__ == "__main__":
    sys.exit(main())
