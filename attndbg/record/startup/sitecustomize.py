"""Loaded by every Python process started under `attndbg record` (this folder is on PYTHONPATH).

It arms attndbg's engine adapters, then runs the sitecustomize this one shadows, if any.
"""

import importlib.util
import os
import sys

try:
    from attndbg.record.bootstrap import activate

    activate()
except Exception as _error:  # noqa: BLE001 - a recorder must never stop the engine from starting
    print(f"attndbg record: startup hook failed ({_error}); not recording", file=sys.stderr)

_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    if _entry and os.path.abspath(_entry) != _here and os.path.isfile(os.path.join(_entry, "sitecustomize.py")):
        _spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", os.path.join(_entry, "sitecustomize.py"))
        if _spec and _spec.loader:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
