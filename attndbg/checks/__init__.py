"""The check engine: which detectors and steps (selection.py), one step checked (step.py), a
recording checked in this process or in worker processes (run.py, workers.py), the kernels compiled
first (precompile.py), and a crash as a finding (crashes.py). Modules import downward in that
order: nothing here imports run.py but the command line.
"""
