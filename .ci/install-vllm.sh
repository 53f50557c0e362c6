#!/usr/bin/env bash
# vLLM for the recorder tests (tests/record/test_vllm_*.py), on a CPU-only CI machine.
#
# The adapter is tested against vLLM's own classes: CommonAttentionMetadata and
# AttentionMetadataBuilder (vllm/v1/attention/backend.py), and TritonAttentionMetadataBuilder
# built with a real VllmConfig. vLLM's declared dependencies include CUDA wheels and a different
# torch (2.14): everything here is installed with --no-deps, at versions verified to import on
# the CPU torch 2.13.0 that CI already has. Never let pip resolve vLLM's requirements: that would
# replace torch and download gigabytes of CUDA libraries.
#
# The closure, by what pulls it in (measured with a fresh venv holding only torch and attndbg):
#   vllm.v1.attention.backend        psutil pyzmq + transformers and its own dependencies
#   vllm.config, triton_attn         cbor2 aiohttp(+ multidict yarl propcache aiohappyeyeballs
#                                    aiosignal frozenlist attrs) requests(+ certifi urllib3 idna)
#                                    openai-harmony openai(+ sniffio) pillow pybase64 cachetools
#                                    msgspec cloudpickle uvloop py-cpuinfo prometheus_client
#                                    xgrammar apache-tvm-ffi fastapi starlette opentelemetry-api
#                                    partial-json-parser llguidance
#   ModelConfig (inspects the Llama   einops
#   architecture in a subprocess)
# Where vLLM 0.33.0 pins a version (xgrammar, apache-tvm-ffi, llguidance, fastapi, transformers),
# its pin is used.
# Measured on 2 cores: about 60 s from the package index, about 1.1 GB installed (vLLM alone is
# 877 MB: its wheel carries CUDA .so files that are never loaded here).
set -euo pipefail

python -m pip install -q --no-deps \
  "vllm==0.33.0" \
  "psutil==7.2.2" "pyzmq==27.3.0" \
  "transformers==5.20.2" "huggingface_hub==2.4.0" "tokenizers==0.23.3" "safetensors==0.8.0" \
  "hf-xet==1.8.0" "httpx2==2.16.2" "httpcore2==2.16.2" "truststore==0.10.5" "h11==0.16.0" \
  "anyio==4.16.0" "idna==3.20" "PyYAML==6.0.3" "regex==2026.11.15" "tqdm==4.70.1" \
  "typer==0.29.2" "shellingham==1.5.4" "annotated-doc==0.0.7" \
  "pydantic==2.14.3" "pydantic_core==2.50.4" "annotated-types==0.8.0" "typing-inspection==0.4.5" \
  "cbor2==6.2.1" "aiohttp==3.14.5" "multidict==7.2.1" "yarl==1.25.1" "propcache==0.5.4" \
  "aiohappyeyeballs==2.7.1" "aiosignal==1.4.0" "frozenlist==1.8.0" "attrs==26.1.0" \
  "requests==2.34.2" "certifi==2026.10.18" "urllib3==2.8.0" \
  "openai-harmony==0.0.8" "openai==3.54.0" "sniffio==1.3.1" \
  "pillow==13.0.0" "pybase64==1.5.1" "cachetools==8.0.1" "msgspec==0.22.0" "cloudpickle==3.1.2" \
  "uvloop==0.23.0" "py-cpuinfo==9.0.0" "prometheus_client==0.26.0" \
  "xgrammar==0.2.8" "apache-tvm-ffi==0.1.11" "llguidance==1.7.6" \
  "fastapi==0.136.3" "starlette==1.10.0" "opentelemetry-api==1.45.2" \
  "partial-json-parser==0.2.1.1.post7" "einops==0.8.2"

# Fail here, not in the tests, when the closure is incomplete.
python - <<'EOF'
import torch
import vllm.v1.attention.backend
import vllm.v1.attention.backends.triton_attn
import vllm.config

assert torch.__version__.startswith("2.13.0"), f"the vLLM install replaced torch: {torch.__version__}"
print("vllm", vllm.__version__, "imports on torch", torch.__version__)
EOF
