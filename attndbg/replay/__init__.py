"""The runner: rebuild a step's data and plans, run the real kernels, compare with the reference.

It sits above `attndbg.compare` (formats and result types: `Comparison`, the saved-replay file)
and below everything that judges or renders its results (checks, detectors, report, cli); see
`attndbg/compare/__init__.py` for the whole stack. Its own result types are `runner.BackendRun`
/ `ReplayResult`, with the typed run variants of `variants` (`Eager`, `Recorded`, `Graph`) and
`BackendRun.refused` (the plan guard's `Refusal`) for a recorded plan refused before launch.
Nothing in `attndbg.compare` imports this package.
"""
