#!/usr/bin/env bash
# Workers sharing one GPU: no step refused for memory that a lone process would check (issue 24).
#
# Session 12 measured, on an H200, 754 of 1,000 server-shaped steps "not replayed: more than 124 MiB
# free on cuda" with the default 8 workers: without --devices the workers took no share of the
# card, and a step's room was the card's free memory, which counts the other workers' caches. (That
# run, and this script's first, had every lane's workers on GPU 0: a worker took physical GPU N for
# the parent's GPU N, whatever the parent's CUDA_VISIBLE_DEVICES; fixed since.) On a
# host of four GPUs (one command, ~6 min held with BACKENDS without fa3, whose modules take 7 of the
# compile's minutes):
#
#     run(command="bash .gpu/env.sh bash bench/worker_memory_check.sh $OUT", carry=[".gpu"], kind="nvidia-h100-x4")
#
# LIMIT (default 560) bounds the whole command: what is still running then is stopped (exit 124 in
# its line) and the results so far come back.
#
# The server recording (bench/server_sweep.py make, 1,000 steps) and the compile phase on the whole
# host, then at once, each on its GPU and a quarter of the cores (as a 16-core one-GPU machine):
#   lane 0  the default command on the 1,000 steps, then bench/worker_utilisation.py (where the
#           workers' time goes: start-up, steps, waiting, tail)
#   lane 1  --jobs 1 and the default --jobs on steps 0-149: the JSON must be identical
#   lane 2  --jobs 16 on the 1,000 steps, then bench/worker_startup.py (a worker's fixed cost, split)
#   lane 3  --cuda-graph, default --jobs, on the 1,000 steps
# Each: wall seconds, exit code, the verdict line, and how many steps were refused for memory.
set -u
out=${1:?usage: worker_memory_check.sh OUT}
BACKENDS=${BACKENDS:-triton,flashinfer,mla}
rec=/tmp/attndbg_server_sweep/server_sweep_1000_seed0
res=$out/worker_memory; mkdir -p "$res"
T0=$EPOCHREALTIME; S0=$SECONDS
LIMIT=${LIMIT:-560}  # seconds for the whole command: the lanes are stopped at it, the results kept
left() { local l=$(( LIMIT - (SECONDS - S0) )); echo $(( l > 5 ? l : 5 )); }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
# Bytecode for the wheels .gpu/env.sh installed with --no-compile, as pip's install writes it for
# users: else every process compiles FlashInfer's sources again (3.2 s of a worker's start, session 12).
python -m compileall -q -j 0 /tmp/site attndbg backends > /dev/null 2>&1 || true
[ -d "$rec" ] || python bench/server_sweep.py make -o "$rec" --steps 1000 --seed 0 > "$res/make.log" 2>&1
echo "recording: $(since "$T0") s"
s=$EPOCHREALTIME; timeout "$(left)" attndbg compile "$rec" --backend "$BACKENDS" > "$res/compile.log" 2>&1
echo "compile ($BACKENDS): exit $? after $(since "$s") s"
# timed LABEL ARGS...: attndbg check REC ARGS on this lane's GPU; one line of what it did.
timed() {
  local label=$1; shift; local s=$EPOCHREALTIME
  timeout "$(left)" attndbg check "$rec" --backend "$BACKENDS" "$@" > "$res/$label.log" 2>&1; local rc=$?
  echo "$label: $(since "$s") s, exit $rc, refused for memory: $(grep -c 'not replayed' "$res/$label.log"); $(grep '^checked ' "$res/$label.log" | cut -c1-300)"
}
lane() { # GPU CMD...: CMD on GPU and its quarter of the cores
  local gpu=$1 per=$(( $(nproc) / 4 )); shift
  ( taskset -cp "$(( gpu * per ))-$(( (gpu + 1) * per - 1 ))" $BASHPID > /dev/null; export CUDA_VISIBLE_DEVICES=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$gpu"); "$@" ) > "$res/lane$gpu.txt" 2>&1 &
  lanes+=($!)
}
identity() {
  timed jobs1_0-149 --steps 0:150 --jobs 1 --json "$res/jobs1.json"
  timed default_0-149 --steps 0:150 --json "$res/default150.json"
  python - "$res/jobs1.json" "$res/default150.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
print("JSON of steps 0-149, --jobs 1 and default:", "identical" if a == b else "DIFFERENT")
EOF
}
lanes=()
default_and_utilisation() {
  timed default
  timeout "$(left)" python bench/worker_utilisation.py "$rec" --backend "$BACKENDS" --out "$res" > "$res/worker_utilisation.log" 2>&1
  cat "$res/worker_utilisation.txt"
}
lane 0 default_and_utilisation
lane 1 identity
startup16() {
  timed jobs16 --jobs 16
  timeout "$(left)" python bench/worker_startup.py "$rec" --backend "$BACKENDS" --out "$res" > "$res/worker_startup.log" 2>&1
  head -8 "$res/worker_startup.txt"
}
lane 2 startup16
lane 3 timed graph --cuda-graph
wait "${lanes[@]}"
cat "$res"/lane*.txt | tee "$res/summary.txt"
(cd "$out" && tar czf worker_memory.tgz worker_memory && rm -rf worker_memory)
