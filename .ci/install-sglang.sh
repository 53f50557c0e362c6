#!/usr/bin/env bash
# SGLang for the recorder tests (tests/record/test_sglang_*.py), on a CPU-only CI machine.
#
# The adapter is tested against SGLang's own classes: ForwardBatch, ForwardMode, EagleVerifyInput,
# ReqToTokenPool, RadixAttention, the Triton backend's ForwardMetadata and TritonAttnBackend,
# FlashInfer's metadata classes and SGL-new's decode CUDA-graph runner. SGLang's declared
# dependencies pin torch 2.14.1, torchvision, torchaudio and CUDA kernels: everything here is
# installed with --no-deps, at versions verified to import on the CPU torch 2.13.0 CI already has.
# Never let pip resolve SGLang's requirements: that would replace torch and download gigabytes.
# torchvision is not installed: its PyPI builds do not load on the CPU torch; the tests put an
# empty stand-in in its place (tests/record/sglang_env.py).
#
# The closure, by what pulls it in (measured with a fresh venv holding only torch and attndbg):
#   sglang.srt.utils, platforms      orjson psutil pybase64 requests(+ urllib3 certifi idna
#                                    charset-normalizer) pillow starlette(+ anyio) msgspec pyzmq
#   sglang.utils, sglang.lang        ipython(+ traitlets) aiohttp(+ multidict attrs yarl propcache
#                                    aiohappyeyeballs aiosignal frozenlist)
#   srt.configs, sampling, kernels   transformers (normal install: no torch among its requirements)
#                                    dill sentencepiece apache-tvm-ffi
#   speculative.eagle_info           compressed-tensors(+ loguru) gguf
#   layers.attention.triton_backend  openai(+ sniffio) partial-json-parser einops
# Shared packages use the same versions as .ci/install-vllm.sh (same venv, either order), which
# are SGLang 0.5.23's own pins where it has one (apache-tvm-ffi, sentencepiece, compressed-tensors).
# Measured on 2 cores from the local package index: 68 s, 500 MB installed (sglang 222 MB, transformers
# 122 MB, the rest small). Importing the closure takes about 10 s (the test files share it).
set -euo pipefail

python -m pip install -q "transformers==5.20.2"
python -m pip install -q --no-deps \
  "sglang==0.5.23" \
  "orjson==3.13.0" "psutil==7.2.2" "pybase64==1.5.1" \
  "requests==2.34.2" "urllib3==2.8.0" "certifi==2026.10.18" "idna==3.20" "charset-normalizer==3.4.7" \
  "pillow==13.0.0" "starlette==1.10.0" "anyio==4.16.0" "msgspec==0.22.0" "pyzmq==27.3.0" \
  "ipython==9.18.1" "traitlets==5.16.1" \
  "aiohttp==3.14.5" "multidict==7.2.1" "attrs==26.1.0" "yarl==1.25.1" "propcache==0.5.4" \
  "aiohappyeyeballs==2.7.1" "aiosignal==1.4.0" "frozenlist==1.8.0" \
  "dill==0.4.1" "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11" \
  "compressed-tensors==0.18.0" "loguru==0.7.3" "gguf==0.19.0" \
  "openai==3.54.0" "sniffio==1.3.1" "partial-json-parser==0.2.1.1.post7" "einops==0.8.2"

# Fail here, not in the tests, when the closure is incomplete.
python - <<'PY'
import sys, types, warnings
from unittest import mock

import torch
import transformers  # noqa: F401  (decides torchvision is unavailable before the stand-in exists)

for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional", "torchvision.transforms.v2", "torchvision.io", "torchvision.ops"):
    module = types.ModuleType(name)
    module.__path__ = []
    module.__getattr__ = lambda attr, _n=name: mock.MagicMock(name=f"{_n}.{attr}")
    sys.modules[name] = module
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import sglang.srt.model_executor.forward_batch_info
    import sglang.srt.speculative.eagle_info
    import sglang.srt.layers.attention.triton_backend
    import sglang.srt.model_executor.runner.decode_cuda_graph_runner

assert torch.__version__.startswith("2.13.0"), f"the SGLang install replaced torch: {torch.__version__}"
print("sglang", sglang.__version__, "imports on torch", torch.__version__)
PY
