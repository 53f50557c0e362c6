"""What a recorded plan means, read once for every part that judges it: the per-request KV ids and
the columns they cover (kv.py), the offsets rule they are read with (offsets.py), and what a
verify plan's kernel lets each draft row see (verify_mask.py, with the tree-block helpers of
tree_blocks.py).

Below the detectors and the mistake models (attndbg/diagnose), which both read it, and above the
adapters whose plan declarations' layouts (backends/plan_declaration.py) it reads by. A plan whose structure
is broken is still reported here as the finding of the detector that owns the check (invariants
for KV structure and offsets, tree-mask for masks), as it was before these readers were shared.
"""
