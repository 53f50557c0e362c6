"""Recording from live engines: hooks that turn each engine step into an attndbg trace.

`options` is what the user asked for (sampling, size cap), `session` owns the output directory,
the writer thread and the fail-once rule, `launch` starts an engine command with the hooks
active, `bootstrap` installs each engine's adapter when that engine is imported. Adapters
(`transformers_cb`, `sglang`, `vllm`) only map engine objects onto the trace schema.
"""
