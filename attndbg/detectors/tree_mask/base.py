"""Shared by the tree-mask detector's modules: its finding class. A request's true tree block and
the sentence that explains a wrong mask element are blocks.py's.
"""

from __future__ import annotations

from attndbg.detector_api.findings import FindingClass

KIND = FindingClass.TREE_MASK
