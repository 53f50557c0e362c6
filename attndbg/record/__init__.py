"""Recording from live engines: hooks that turn each engine step into an attndbg trace.

Engine-neutral core, at this level: `options` is what the user asked for (sampling, size cap),
`session` owns the output directory, the writer (`writer_process`) and the fail-once rule,
`launch` starts an engine command with the hooks active, `bootstrap` (run by `startup/`'s
sitecustomize in every process of the engine) installs each engine's adapter when that engine is
imported, `build` assembles engine-neutral trace parts, and `hooks` is the toolkit every adapter
places its wrappers with. One package per engine below it (`sglang`, `vllm`, `transformers`),
each mapping that engine's objects onto the trace schema and nothing else.
"""
