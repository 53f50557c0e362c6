#!/usr/bin/env bash
# transformers for the live-engine recorder test (tests/record/test_transformers_live.py):
# continuous batching with a paged KV cache on a tiny random Llama, on the CPU.
# transformers declares no torch requirement, so a normal install leaves torch 2.13.0 alone.
# Same pin as .ci/install-sglang.sh and .ci/install-vllm.sh (vLLM 0.33.0 needs < 5.21).
set -euo pipefail
python -m pip install -q "transformers==5.20.2" "psutil==7.2.2"
python -c "import torch, transformers.generation.continuous_batching as cb; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('transformers', __import__('transformers').__version__)"
