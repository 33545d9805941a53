#!/usr/bin/env bash
# A smoke run on Python 3.12, the GPU machine's Python: hpo and every dependency but torch
# installed in a fresh virtual environment, every module of src/hpo compiled, and the commands
# that answer before torch is imported run for their exit codes and one-line errors.
#
#     bash scripts/smoke-py312.sh [PYTHON]      # default: pyenv's 3.12, else python3.12
#
# Why without torch: torch 2.13.0 for Python 3.12 on PyPI is a CUDA build whose
# nvidia-cudnn-cu13 pin no package index here offers (pip: "No matching distribution found
# for nvidia-cudnn-cu13==9.20.0.48"), and a CPU build only comes from PyPI for 3.11 here.
# The GPU check (benchmarks/gpu/) imports the rest on 3.12 with the machine's own torch.
set -euo pipefail
python=${1:-}
if [ -z "$python" ]; then  # pyenv's 3.12 where pyenv has one (its shim needs a version set)
  python=$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 \
           2>/dev/null | tail -n 1 || true)
  python=${python:-python3.12}
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$python" -m venv "$work/env"
. "$work/env/bin/activate"
python -V
# hpo's dependencies without torch and peft (which needs torch), then hpo itself without them.
python - "$repo/pyproject.toml" > "$work/requirements.txt" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for requirement in project["dependencies"]:
    if re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0] not in ("torch", "peft"):
        print(requirement)
EOF
# --no-compile: the smoke imports few of them, and it runs beside the tests in CI.
pip install -q --no-compile -r "$work/requirements.txt"
pip install -q --no-deps "$repo"
python -m compileall -q "$(python -c 'import hpo, pathlib; print(pathlib.Path(hpo.__file__).parent)')"

# Each command: its expected exit code, and a one-line error (no traceback) where it fails.
expect() {
  local code=$1; shift
  set +e
  (cd "$work" && "$@") > "$work/out" 2> "$work/err"
  local got=$?
  set -e
  if [ "$got" != "$code" ]; then
    echo "FAIL: $* exited $got, expected $code"; cat "$work/out" "$work/err"; exit 1
  fi
  if [ "$code" = 2 ] && { [ "$(wc -l < "$work/err")" != 1 ] || grep -q Traceback "$work/err"; }; then
    echo "FAIL: $* did not fail in one line"; cat "$work/err"; exit 1
  fi
  echo "ok: $* -> $got $(head -c 120 "$work/err")"
}
expect 0 hpo --help
expect 0 hpo --version
expect 0 hpo run --help
expect 2 hpo run --study demo
expect 2 hpo run --study no-such-study --n-trials 1
expect 2 hpo run --study demo --n-trials 1 --set training.epochs=zero
expect 2 hpo status --study demo --storage "sqlite:///$work/missing.db"
expect 2 hpo studies --storage "nosuchdb://x"
expect 2 hpo studies --storage "sqlite:///$work/missing.db"
echo "Python 3.12 smoke run passed"
