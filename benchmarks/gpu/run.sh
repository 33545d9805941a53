#!/usr/bin/env bash
# The GPU check (issue 42), in one command:
#
#     bash benchmarks/gpu/run.sh OUTDIR              # on the GPU machine, from the repository
#     bash benchmarks/gpu/run.sh --rehearse OUTDIR   # here: every step on this CPU, tiny models
#     bash benchmarks/gpu/run.sh OUTDIR --steps oom loop   # some steps, in the order named
#
# Prepare first, here: `bash benchmarks/gpu/prepare.sh` (the wheels the GPU image lacks, and
# hpo's own, in benchmarks/gpu/wheels/, which the device tool's call must carry). On the GPU the
# wheels are installed into a folder of their own and put on PYTHONPATH beside the image's
# packages; the steps (benchmarks/gpu/check.py) write OUTDIR/gpu.json as each ends, and
# everything printed goes to OUTDIR/run.log too. The whole run is cut at HPO_GPU_SECONDS
# (default 450: under 8 minutes with the install), keeping what the finished steps wrote; on
# the GPU check.py is told the budget too, and skips a step its estimate says would not fit
# (steps run in check.py's STEPS order, what the next GPU run must show first).
# The rehearsal first checks what travels: under 64 MiB, every import covered.
set -uo pipefail
rehearse=""
if [ "${1:-}" = "--rehearse" ]; then rehearse=--rehearse; shift; fi
out=${1:?usage: bash benchmarks/gpu/run.sh [--rehearse] OUTDIR [check.py options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)

main() {
  local python=${PYTHON:-python3}
  echo "gpu check: $(date -u +%FT%TZ) on $(hostname), $("$python" -V 2>&1)${rehearse:+, rehearsal}"
  if [ -n "$rehearse" ]; then
    "$python" "$here/travel.py" --wheels "$here/wheels" || return 1
  else
    local target
    target=$(mktemp -d)
    "$python" -m pip install -q --no-index --no-deps --target "$target" "$here"/wheels/*.whl \
      || return 1
    export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    # The carried wheels need some of the image's packages at a minimum version.
    "$python" -m pip check || true
    "$python" -m pip show torch transformers peft typing-extensions 2>/dev/null \
      | grep -E "^(Name|Version):" | paste - - || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  fi
  timeout --signal=INT --kill-after=20 "${HPO_GPU_SECONDS:-450}" \
    "$python" "$here/check.py" --out "$out" $rehearse --seconds "${HPO_GPU_SECONDS:-450}" "$@"
}

main "$@" 2>&1 | tee "$out/run.log"
exit "${PIPESTATUS[0]}"
