"""Import other tools' evidence as attndbg recordings, and export recordings to their formats.

One module per format: `flashinfer_dump` reads FlashInfer's level-10 API dumps (`FLASHINFER_LOGLEVEL=10`)
and `flashinfer_steps` turns its plan/run pairs into steps; `fib` reads and `fib_export` writes
flashinfer-bench definitions and workloads (`fib_schema` checks them as their loader would);
`trtllm` reads TensorRT-LLM's attention capture lines. `files` reads every untrusted file they
open (JSON, torch archives, safetensors) with bounded memory and no code execution; `steps` lays
imported lengths and tensors out as traces. What a format does not carry is filled in and named
in `source.inferred`. Formats and their citations: ../shared/reference/interop.md.
"""
