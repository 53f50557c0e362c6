#!/usr/bin/env bash
# The GPU tests a change must pass, on the device, within its per-call limit and resumable across calls.
#
# A fresh device machine compiles every FlashInfer module on first use, so the whole list rarely fits
# one call. Parts run in the order given, each under its own timeout; a part that finished is not run
# again while the machine stays warm (it is handed back 30 s after a call ends), so the next call
# carries on with the rest. Logs of every part come back in OUT/gpu_tests.tgz; the FlashInfer dumps
# (bench/make_flashinfer_dumps.py) in OUT/flashinfer_dumps.tar, the timeline files in OUT/timeline.tgz.
#
#     run(command="bash .gpu/env.sh bash bench/gpu_tests.sh $OUT dumps,crash,repro,plans,timeline", carry=[".gpu"])
#
# Parts: dumps (make real FlashInfer dumps, then tests/interop/test_real_flashinfer_dumps.py on them),
# crash (crash isolation: a runner's and a detector's own launches poisoning the context), repro
# (tests/repro on the GPU), plans (recorded SGLang plans, the plan guard, the compile phase: up to 480 s,
# since test_precompile builds a module in a fresh FlashInfer cache; 300 s once cut it),
# timeline (bench/timeline_check.sh test), all (every test marked gpu). LIMIT: seconds this call may
# use (default 570).
set -u
out=${1:?usage: gpu_tests.sh OUT PARTS}
parts=${2:-dumps,crash,repro,timeline,plans}
T0=$(date +%s)
LIMIT=${LIMIT:-570}
res=/tmp/gpu_tests
mkdir -p "$res"
left() { echo $(( LIMIT - ($(date +%s) - T0) )); }
pack() {
  (cd "$res" && tar czf "$out/gpu_tests.tgz" --exclude=timeline --exclude='*.tar' .)
  [ -f "$res/flashinfer_dumps.tar" ] && cp "$res/flashinfer_dumps.tar" "$out/"
  [ -d "$res/timeline" ] && (cd "$res/timeline" && tar czf "$out/timeline.tgz" .)
  ls -la "$out"
}
trap pack EXIT
[ -f "$res/env.txt" ] || attndbg env > "$res/env.txt" 2>&1

# run PART SECONDS CMD...: CMD under a timeout no longer than what is left, its log in res/PART.log.
run_part() {
  local part=$1 want=$2; shift 2
  [ -f "$res/$part.done" ] && { echo "== $part: done in an earlier call"; return 0; }
  local t=$(( $(left) - 15 )); [ "$t" -gt "$want" ] && t=$want
  [ "$t" -gt 30 ] || { echo "== $part: not started, $(left) s left"; return 0; }
  echo "== $part (up to $t s)"
  local s=$(date +%s)
  timeout "$t" "$@" > "$res/$part.log" 2>&1
  local rc=$?
  echo "== $part: exit $rc after $(( $(date +%s) - s )) s" | tee -a "$res/$part.log"
  tail -6 "$res/$part.log"
  [ $rc -eq 124 ] || touch "$res/$part.done"
}
pytest_q=(python3 -m pytest -q -p no:cacheprovider -rs)

for p in ${parts//,/ }; do
  case $p in
    dumps)
      [ -f "$res/flashinfer_dumps.tar" ] || run_part make_dumps 300 python3 bench/make_flashinfer_dumps.py --out "$res/flashinfer_dumps.tar"
      [ -f "$res/flashinfer_dumps.tar" ] && mkdir -p tests/fixtures && cp "$res/flashinfer_dumps.tar" tests/fixtures/flashinfer_dumps.tar
      run_part dumps 240 "${pytest_q[@]}" tests/interop/test_real_flashinfer_dumps.py ;;
    crash) run_part crash 240 "${pytest_q[@]}" -m gpu tests/gpu/test_detector_crash.py tests/gpu/test_crash_isolation.py ;;
    repro) run_part repro 400 "${pytest_q[@]}" -m gpu tests/repro ;;
    plans) run_part plans 480 "${pytest_q[@]}" -m gpu tests/gpu/test_recorded_sglang_plans.py tests/gpu/test_plan_guard_gpu.py tests/gpu/test_precompile.py ;;
    timeline) mkdir -p "$res/timeline"; run_part timeline 560 bash bench/timeline_check.sh "$res/timeline" test ;;
    all) run_part all 560 "${pytest_q[@]}" -m gpu tests ;;
    *) echo "unknown part $p"; exit 2 ;;
  esac
done
