"""A corpus of real historical attention-metadata bugs (SGLang, vLLM, FlashInfer, TensorRT-LLM), each
recorded the way attndbg's recorders and importers record the engine's step, with the correct twin
the fixed code records. `catalog.BUGS` lists them; bench/real_bugs.py checks them; docs/real-bugs.md
has the table."""
