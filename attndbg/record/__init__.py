"""Recording from live engines: hooks that turn each engine step into an attndbg trace.

Engine-neutral core, at this level: `options` is what the user asked for (sampling, size cap),
`session` owns the output directory, the writer (`writer_process`) and the fail-once rule,
`launch` starts an engine command with the hooks active, `bootstrap` (run by `startup/`'s
sitecustomize in every process of the engine) installs each engine's adapter when that engine is
imported, and `hooks` is the toolkit every adapter places its wrappers with. The engine-neutral
trace parts the adapters assemble are attndbg/trace/build.py's (the importers build with them
too). One package per engine below it (`sglang`, `vllm`, `transformers`), each mapping that
engine's objects onto the trace schema and nothing else.
"""
