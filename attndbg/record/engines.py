"""The engines `attndbg record` hooks, one table: each engine's name (what `--engine` takes and the
traces' `source.engine` says), the module whose import arms its adapter, and the function that
installs the adapter. The recorder's bootstrap, its options' default and the command line's
`--engine` all read it. Imports nothing: the bootstrap runs in every process of the engine.

How each engine's recorded fields are read back is attndbg/trace/engines.py's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecordedEngine:
    name: str
    trigger: str  # the engine module after whose import the adapter is installed
    install: str  # "package.module:function" that installs the adapter (idempotent)


ENGINES: tuple[RecordedEngine, ...] = (
    RecordedEngine("transformers", "transformers.generation.continuous_batching.model_runner", "attndbg.record.transformers:install"),
    RecordedEngine("sglang", "sglang.srt.model_executor.model_runner", "attndbg.record.sglang:install"),
    RecordedEngine("vllm", "vllm.v1.worker.gpu_model_runner", "attndbg.record.vllm:install"),
)
NAMES: tuple[str, ...] = tuple(engine.name for engine in ENGINES)
