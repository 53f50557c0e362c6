"""A live engine that runs anywhere: transformers' continuous batching on a tiny random Llama.

No weights are downloaded: the model is built from a config with a fixed seed. Run as a module
(`attndbg record -o rec -- python -m attndbg.examples.transformers_generate`, which needs
`pip install transformers psutil`) it prints the generated tokens as JSON on the last line. The
recorder's live tests drive the same functions.
"""

from __future__ import annotations

import argparse
import json

import torch

PROMPTS = ([1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 30)))


def tiny_llama(dtype: torch.dtype = torch.float32, device: str = "cpu", attention: str = "sdpa"):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)
    model.set_attn_implementation(attention)
    return model


def generate(model, prompts=PROMPTS, max_new_tokens: int = 5, page_size: int = 16, num_blocks: int = 32, cuda_graph: bool = False, max_batch_tokens: int = 64):  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    generation = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    batching = ContinuousBatchingConfig(page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, use_cuda_graph=cuda_graph)
    out = model.generate_batch([list(p) for p in prompts], generation_config=generation, continuous_batching_config=batching)
    return {key: list(value.generated_tokens) for key, value in sorted(out.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--attention", default="sdpa", choices=["sdpa", "paged|eager"])
    parser.add_argument("--new-tokens", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--cuda-graph", action="store_true", help="transformers' CUDA graphs (GPU)")
    args = parser.parse_args()
    model = tiny_llama(dtype=getattr(torch, args.dtype), device=args.device, attention=args.attention)
    print(json.dumps(generate(model, max_new_tokens=args.new_tokens, cuda_graph=args.cuda_graph)))


if __name__ == "__main__":
    main()
