#!/usr/bin/env bash
# Issue 23 in one command: on a bare machine with one H100/H200 (torch 2.11 and Triton 3.6 preinstalled), run the
# test suite on CUDA where a test can and every GPU benchmark, each step under its own time limit, and write JSON
# to OUTDIR (one file per step, plus suite.json: every step's exit status, seconds and file).
#
#   benchmarks/gpu_suite.sh OUTDIR              # on the GPU machine, from the repository root (~10 min budget)
#   benchmarks/gpu_suite.sh OUTDIR --dry-run    # anywhere (this CPU machine): tiny configs, checks the wiring and
#                                               # the JSON only; its figures mean nothing
#   SHARDTENSOR_DRY_RUN=1 benchmarks/gpu_suite.sh OUTDIR
#
# Wheels the machine lacks may be brought in .whl/ (they are installed into /tmp/site first).  PYTHON overrides
# the interpreter (Default: python3).  A failing step does not stop the others; the exit status is 1 if any failed.
set -u
OUT=${1:?usage: benchmarks/gpu_suite.sh OUTDIR [--dry-run]}
[ "${2:-}" = "--dry-run" ] && export SHARDTENSOR_DRY_RUN=1
DRY=${SHARDTENSOR_DRY_RUN:-0}
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.." || exit 2
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 MALLOC_MMAP_THRESHOLD_=65536

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# shardtensor itself: its subpackages map to top-level folders (ops, optim, offload), so it must be installed.
if ! "$PY" -c "import shardtensor.optim" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
    || { echo "could not install shardtensor (see $OUT/install.log)"; exit 2; }
fi

STEPS=()   # one JSON object per step, for suite.json
FAILED=0
# The whole suite, seconds: each step's limit is cut to what is left.  A dry run on a shared CPU machine is slower
# than the GPU (bf16 and process start-up on few loaded cores): its limits are 5x and its budget 50 min.
BUDGET=${SHARDTENSOR_SUITE_BUDGET_S:-$([ "$DRY" = 1 ] && echo 3000 || echo 570)}
SCALE=$([ "$DRY" = 1 ] && echo 5 || echo 1)
step() {   # step NAME LIMIT_S JSON_FILE COMMAND...
  local name=$1 limit=$(($2 * SCALE)) file=$3; shift 3
  local t0 rc left=$((BUDGET - SECONDS))
  if [ "$left" -lt 15 ]; then
    echo "== $name SKIPPED: the suite's ${BUDGET}s budget is spent"
    STEPS+=("{\"step\": \"$name\", \"rc\": null, \"skipped\": \"suite budget of ${BUDGET}s spent\"}")
    FAILED=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  tail -n 3 "$OUT/$name.log"
  [ "$rc" -ne 0 ] && FAILED=1
  STEPS+=("{\"step\": \"$name\", \"rc\": $rc, \"timed_out\": $([ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && echo true || echo false), \"seconds\": $((SECONDS - t0)), \"json\": \"$file\", \"log\": \"$name.log\"}")
}

if [ "$DRY" = "1" ]; then
  # The wiring of the test step, not the suite (the CPU suite runs in CI): one small file.
  TESTS=(tests/test_int4_ops.py); T_LIMIT=60; INT4=(--device cpu --numel 65536 --repeats 2)
else
  TESTS=(tests); T_LIMIT=200; INT4=(--device cuda)
fi
DRYFLAG=(); [ "$DRY" = "1" ] && DRYFLAG=(--dry-run)

"$PY" - >"$OUT/env.json" <<'EOF'
import json, os, platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:  # noqa: BLE001
    tv = f"missing: {e}"
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, "triton": tv,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "cpu_count": os.cpu_count(), "python": platform.python_version(),
                  "dry_run": os.environ.get("SHARDTENSOR_DRY_RUN") == "1"}, indent=1))
EOF

# 1. Tests: on the GPU machine every test that picks CUDA when present runs there (the int4 kernels compiled by
#    Triton, CPUOffload); the rank-pool tests run their gloo ranks as on the CPU.  JUnit XML -> JSON.
step tests "$T_LIMIT" tests.json "$PY" -m pytest "${TESTS[@]}" -q -x -p no:cacheprovider --junitxml="$OUT/tests.xml"
"$PY" benchmarks/junit_to_json.py "$OUT/tests.xml" "$OUT/tests.json" || FAILED=1

# 2. Parity: 2 gloo ranks with CUDA tensors against the CPU (same seed, same batches).
step parity 90 parity.json "$PY" benchmarks/gpu_bench.py parity "${DRYFLAG[@]}" --out "$OUT/parity.json"
# 3. World-1 step against the plain model (942M GPT, bf16 compute) and FSDP2; NCCL world of one.
step world1 120 world1.json "$PY" benchmarks/gpu_bench.py world1 "${DRYFLAG[@]}" --out "$OUT/world1.json"
# 4. World-8 memory as rank 3 of the fake process group, with and without per-block activation checkpointing.
for cfg in plain fsdp2 st-sequential st-overlapped; do
  for ck in "" --ckpt; do
    name="fake8_${cfg}${ck:+_ckpt}"
    step "$name" 45 "$name.json" "$PY" benchmarks/gpu_bench.py fake8 --config "$cfg" $ck "${DRYFLAG[@]}" \
      --out "$OUT/$name.json"
  done
done
# 5. int4 kernels against copy_ on the same device.
step int4 45 int4.json "$PY" benchmarks/bench_int4_kernels.py "${INT4[@]}" --out "$OUT/int4.json"
# 6. CPUAdam speculative against the ZeRO-Offload order (>= 2B parameters on the GPU, state on the host).
step cpuadam 150 cpuadam.json "$PY" benchmarks/gpu_bench.py cpuadam "${DRYFLAG[@]}" --warmup 1 --steps 3 --out "$OUT/cpuadam.json"
# 7. CPUOffload: GPU memory saved and step time.
step offload 60 offload.json "$PY" benchmarks/gpu_bench.py offload "${DRYFLAG[@]}" --out "$OUT/offload.json"

{
  echo "{\"dry_run\": $([ "$DRY" = "1" ] && echo true || echo false), \"failed\": $([ "$FAILED" = 1 ] && echo true || echo false), \"steps\": ["
  sep=""
  for s in "${STEPS[@]}"; do echo "$sep$s"; sep=","; done
  echo "]}"
} >"$OUT/suite.json"
"$PY" -c "import json,sys; json.load(open(sys.argv[1]))" "$OUT/suite.json" || FAILED=1
echo "wrote $OUT/suite.json (failed: $FAILED)"
exit "$FAILED"
