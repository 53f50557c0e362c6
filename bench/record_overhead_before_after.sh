#!/usr/bin/env bash
# The recording cost before and after a change to the recorder, in one device call: the before
# tree's bench/record_overhead.py and this tree's, alternating, each against recording off in its
# own interleaved rounds (so each pair shares the machine's state); the last pair also profiles the
# hook (--profile-hook). A figure for docs/benchmarks.md: the hook's microseconds per step
# (`hook_us_per_step` of each ring round, and `hook_us_median_full_ring`: its median step once the
# ring is full, without the first steps' pinned allocations) is steadier than the wall time, whose
# rounds vary by 10 % and more on a one-GPU machine.
#
# Here, once: the before tree as an ignored folder that travels with .gpu, its adapters linked in:
#     rm -rf .gpu/before && mkdir -p .gpu/before && git archive BEFORE_COMMIT attndbg backends bench pyproject.toml | tar x -C .gpu/before
#     git rev-parse --short BEFORE_COMMIT > .gpu/before_commit; git rev-parse --short HEAD > .gpu/after_commit
# On the device (transformers carried in .gpu/whl: pack.sh with EXTRA_WHEELS="transformers==5.20.2"):
#     run(command="bash .gpu/env.sh bash bench/record_overhead_before_after.sh $OUT", carry=[".gpu"], timeout_s=400)
# Environment: PAIRS (2), ROUNDS (5), NEW_TOKENS (256), CONFIGS (off,ring,ring_probe), RUN_TIMEOUT
# (seconds per run, 120: one run of 5 rounds took about 70 s on an H100).
set -u
out=${1:?usage: record_overhead_before_after.sh OUT}
mkdir -p "$out"
ln -sfn ../backends .gpu/before/attndbg/backends
pairs=${PAIRS:-2}
{
  echo "bench/record_overhead.py --configs ${CONFIGS:-off,ring,ring_probe} --rounds ${ROUNDS:-5} --new-tokens ${NEW_TOKENS:-256}; before = $(cat .gpu/before_commit 2>/dev/null || echo .gpu/before), after = $(cat .gpu/after_commit 2>/dev/null || echo this tree)"
  for pair in $(seq 1 "$pairs"); do
    for tree in before after; do
      dir=.; [ "$tree" = before ] && dir=.gpu/before
      profile=; [ "$pair" = "$pairs" ] && profile=--profile-hook
      # The script puts its own tree first on sys.path: say which recorder it imported.
      python3 -c "import sys; sys.path.insert(0, '$dir'); import attndbg.record.session as m; print('$tree: recorder from', m.__file__)"
      timeout "${RUN_TIMEOUT:-120}" python3 "$dir/bench/record_overhead.py" --configs "${CONFIGS:-off,ring,ring_probe}" --rounds "${ROUNDS:-5}" \
        --new-tokens "${NEW_TOKENS:-256}" $profile --json "$out/${tree}_$pair.json" > "$out/${tree}_$pair.log" 2>&1
      echo "$tree, pair $pair: exit $?"
    done
  done
} 2>&1 | tee "$out/summary.txt"
python3 - "$out" "$pairs" <<'PY' | tee -a "$out/summary.txt"
import json, sys
from pathlib import Path
out, pairs = Path(sys.argv[1]), int(sys.argv[2])
for pair in range(1, pairs + 1):
    for tree in ("before", "after"):
        path = out / f"{tree}_{pair}.json"
        if not path.exists():
            print(f"{tree} {pair}: no result (see {tree}_{pair}.log)")
            continue
        result = json.loads(path.read_text())
        hooks: dict[str, list[int]] = {}
        medians: dict[str, list[int]] = {}  # once the ring is full (trees whose script reports it)
        for name, run in result["written_steps_dropped"].items():
            hooks.setdefault(name.rstrip("0123456789"), []).append(round(run["hook_us_per_step"]))
            if "hook_us_median_full_ring" in run:
                medians.setdefault(name.rstrip("0123456789"), []).append(round(run["hook_us_median_full_ring"]))
        wall = {k: f"{v:+.1f} %" for k, v in result["overhead_percent"].items()}
        paired = result.get("overhead_percent_paired_median")  # trees whose script pairs rounds
        by_round = f"; by round against that round's off, median {({k: f'{v:+.1f} %' for k, v in paired.items()})}" if paired else ""
        steady = f"; median µs/step once the ring is full {medians}" if medians else ""
        print(f"{tree} {pair}: wall over off {wall}{by_round}; hook µs/step by round {hooks}{steady}")
PY
