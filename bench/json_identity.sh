#!/usr/bin/env bash
# `check --json` before and after a change, on the CPU (a change that must not change the JSON): the shipped traces
# (Triton interpreted), every synth preset with every injectable mistake that applies to it
# (bench/injected_traces.py), and 200 server-shaped steps (bench/server_sweep.py), the last two with
# --backend fa3 (no GPU here: every detector on metadata and recorded tensors). The before tree is a
# `git archive` of the older commit in BEFORE (default .gpu/tree, as bench/check_cost_before_after.sh
# uses it).
#
#     bash bench/json_identity.sh OUT_DIR
#
# Prints, per input, the step count, the findings and whether the two JSON files are byte-identical.
set -u
out=${1:?usage: json_identity.sh OUT_DIR}
here=$(pwd)
before=$(cd "${BEFORE:-.gpu/tree}" && pwd)
ln -sfn ../backends "$before/attndbg/backends"  # the before tree's adapters, as its install would place them
export TRITON_INTERPRET=1
[ -d "$out/injected" ] || python bench/injected_traces.py "$out/injected" >/dev/null
[ -d "$out/server200" ] || python bench/server_sweep.py make -o "$out/server200" --steps 200 --seed 0 >/dev/null
for side in after before; do
  dir=$here; [ $side = before ] && dir=$before
  (cd "$dir" && python -m attndbg check "$here/traces" --backend triton --in-process --json "$out/traces_$side.json" >/dev/null 2>&1)
  (cd "$dir" && python -m attndbg check "$out/injected" --backend fa3 --in-process --json "$out/injected_$side.json" >/dev/null 2>&1)
  (cd "$dir" && python -m attndbg check "$out/server200" --backend fa3 --in-process --json "$out/server200_$side.json" >/dev/null 2>&1)
done
for n in traces injected server200; do
  python -c "
import json, sys
a, b = (open(f'$out/${n}_{s}.json', 'rb').read() for s in ('after', 'before'))
d = json.loads(a)
print(f'$n: {len(d[\"steps\"])} steps, {d[\"total_findings\"]} findings, byte-identical: {a == b}')"
done
