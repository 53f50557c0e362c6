"""Test fixture, on PYTHONPATH only for the repro crash tests: with REPRO_TEST_FAULT set, every
Triton kernel a script launches faults the way a kernel library does on a GPU, on the CPU:
`raise` raises the error a poisoned CUDA context gives, `kill` kills the process (a segfault).
Kernels are wrapped at `@triton.jit`, before the script defines them; nothing else changes."""

import os

how = os.environ.get("REPRO_TEST_FAULT")
if how:
    import signal

    import triton

    _jit = triton.jit

    class _Faulting:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if how == "kill":
                    os.kill(os.getpid(), signal.SIGSEGV)
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            return launch

    def jit(fn=None, **kwargs):
        if fn is None:
            return lambda f: _Faulting(_jit(f, **kwargs))
        return _Faulting(_jit(fn, **kwargs))

    triton.jit = jit
