"""SGLang's real classes on a CPU-only machine, and builders of real SGLang objects for the tests.

SGLang's import chain reaches torchvision (configs -> multimodal utils), whose PyPI builds do not
load against the CPU torch ("operator torchvision::nms does not exist"). Importing transformers
first makes it decide torchvision is unavailable; then empty stand-in modules satisfy SGLang's
`import torchvision...` lines, which only the multimodal paths would use
(docs/recording-research.md, section 2). The stand-in is installed only here, only when the real
torchvision cannot be imported, and only right before SGLang is.
"""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
import warnings
from types import SimpleNamespace
from unittest import mock

import torch

from tests.record.engines import import_engine

TORCHVISION_MODULES = (
    "torchvision",
    "torchvision.transforms",
    "torchvision.transforms.functional",
    "torchvision.transforms.v2",
    "torchvision.io",
    "torchvision.ops",
)


def _torchvision_loads() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError, OSError):
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def _stub_torchvision() -> None:
    for name in TORCHVISION_MODULES:
        if name in sys.modules:
            continue
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so submodule imports resolve to the stubs
        module.__getattr__ = lambda attr, _name=name: mock.MagicMock(name=f"{_name}.{attr}")  # type: ignore[method-assign]
        sys.modules[name] = module


def load_sglang() -> SimpleNamespace:
    """The SGLang modules the tests use, or a module-level skip (a failure under
    ATTNDBG_REQUIRE_ENGINES=1) when SGLang or its import closure is missing."""
    if importlib.util.find_spec("sglang") is None:
        import_engine("sglang")  # skips (or fails) naming SGLang itself, not a dependency
    import_engine("transformers")
    if "sglang" not in sys.modules and not _torchvision_loads():
        _stub_torchvision()
    with warnings.catch_warnings():
        # "Only CUDA, HIP and XPU support AWQ" and friends: true, and irrelevant on CPU.
        warnings.simplefilter("ignore")
        return SimpleNamespace(
            forward_batch_info=import_engine("sglang.srt.model_executor.forward_batch_info"),
            eagle_info=import_engine("sglang.srt.speculative.eagle_info"),
            spec_info=import_engine("sglang.srt.speculative.spec_info"),
            memory_pool=import_engine("sglang.srt.mem_cache.memory_pool"),
            radix_attention=import_engine("sglang.srt.layers.radix_attention"),
            triton_backend=import_engine("sglang.srt.layers.attention.triton_backend"),
            flashinfer_backend=import_engine("sglang.srt.layers.attention.flashinfer_backend"),
            base_attn_backend=import_engine("sglang.srt.layers.attention.base_attn_backend"),
            spec_tree=import_engine("sglang.kernels.ops.speculative.spec_tree"),
        )


sgl = load_sglang()
ForwardBatch = sgl.forward_batch_info.ForwardBatch
ForwardMode = sgl.forward_batch_info.ForwardMode
# SGL-classic's ForwardMode.DRAFT_EXTEND (6 in SGLang 0.5.3, engines.md A1), the spec-v1 draft extend:
# the installed SGLang names only DRAFT_EXTEND_V2. The recorder reads a mode by its name, so this
# member stands for the classic one on a real ForwardBatch.
ClassicForwardMode = enum.Enum("ClassicForwardMode", {"DRAFT_EXTEND": 6})
EagleDraftExtendInput = sgl.eagle_info.EagleDraftExtendInput
CaptureHiddenMode = sgl.forward_batch_info.CaptureHiddenMode
EagleVerifyInput = sgl.eagle_info.EagleVerifyInput
ReqToTokenPool = sgl.memory_pool.ReqToTokenPool
MHATokenToKVPool = sgl.memory_pool.MHATokenToKVPool
RadixAttention = sgl.radix_attention.RadixAttention
TritonAttnBackend = sgl.triton_backend.TritonAttnBackend
TritonForwardMetadata = sgl.triton_backend.ForwardMetadata
TreeMaskMode = sgl.spec_tree.TreeMaskMode

I64, I32 = torch.int64, torch.int32


def req_pool(rows: dict[int, list[int]], *, size: int = 8, width: int = 64) -> ReqToTokenPool:
    """A real ReqToTokenPool on the CPU whose row r maps columns to the given slot ids."""
    pool = ReqToTokenPool(size=size, max_context_len=width, device="cpu", enable_memory_saver=False)
    for row, slots in rows.items():
        pool.req_to_token[row, : len(slots)] = torch.tensor(slots, dtype=I32)
    return pool


def layer(*, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layer_id: int = 0, scaling: float | None = None) -> RadixAttention:
    """A real RadixAttention module (an nn.Module holding the layer's attention parameters)."""
    return RadixAttention(heads, head_dim, scaling if scaling is not None else head_dim**-0.5, kv_heads, layer_id)


# ModelRunner's import closure reaches the HTTP server's packages (sglang.srt.distributed.bootstrap
# -> uvicorn, fastapi), which a scheduler process never uses; like torchvision above, they are
# stood in for only here and only when missing.
SERVER_MODULES = ("uvicorn", "fastapi", "fastapi.responses")


def load_model_runner() -> types.ModuleType:
    """sglang.srt.model_executor.model_runner (the real ModelRunner class)."""
    missing = {top for top in {n.split(".")[0] for n in SERVER_MODULES} if top not in sys.modules and importlib.util.find_spec(top) is None}
    for name in SERVER_MODULES:
        if name.split(".")[0] in missing and name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = []
            module.__getattr__ = lambda attr, _name=name: mock.MagicMock(name=f"{_name}.{attr}")  # type: ignore[method-assign]
            sys.modules[name] = module
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_engine("sglang.srt.model_executor.model_runner")
