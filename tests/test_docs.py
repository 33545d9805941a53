"""The README stays a front page, its links lead somewhere, the study-file reference in the
docs is the schema's, and the documentation site builds with no warning."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from pydantic import BaseModel

from hpo.config import StudyConfig

README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_is_a_front_page():
    assert len(README.read_bytes()) <= 10_000
    text = README.read_text()
    first_block = text.split("```")[1]
    # It starts with the two set-up commands: the main job and the tests.
    assert "hpo run --study demo" in first_block and "pytest" in first_block
    assert not re.search(r"SAMPLE_[A-Z_]+", text), "a placeholder is left in the README"


@pytest.mark.parametrize("page", [README, *sorted((REPO / "docs").glob("*.md"))],
                         ids=lambda p: p.name)
def test_local_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:|#", target):
            continue
        path, _, anchor = target.partition("#")
        assert (page.parent / path).exists(), f"{page.name}: {target} does not exist"
        if anchor and path.endswith(".md"):
            headings = [_slug(h) for h in re.findall(r"^#+ (.+)$",
                                                     (page.parent / path).read_text(), re.M)]
            assert anchor in headings, f"{page.name}: {target}: no such heading"


def _slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        nested = [a for a in getattr(field.annotation, "__args__", (field.annotation,))
                  if isinstance(a, type) and issubclass(a, BaseModel)]
        yield f"{prefix}{name}", field
        for section in nested:
            yield from _fields(section, f"{prefix}{name}.")


def test_every_study_file_key_is_described():
    missing = [key for key, field in _fields(StudyConfig) if not field.description]
    assert missing == [], f"give these fields a docstring in hpo/config.py: {missing}"


def test_the_study_file_reference_is_the_schema_s():
    result = subprocess.run([sys.executable, "scripts/study_reference.py", "--check"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    page = (REPO / "docs" / "study-files.md").read_text()
    for key, _ in _fields(StudyConfig):
        if key.count(".") == 1 or key.startswith(("study.sampler.", "study.pruner.")):
            assert f"`{key}`" in page, key


def test_the_documentation_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs")
    assert mkdocs is not None, "mkdocs is in the test extra: pip install -e '.[test]'"
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").is_file()
    assert (tmp_path / "site" / "study-files" / "index.html").is_file()
    assert not Path(REPO / "site").exists()


def test_the_layout_table_names_the_layers_the_contract_enforces():
    import tomllib

    contract = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = [{name.strip() for name in layer.split(":")}
              for layer in contract["contracts"][0]["layers"]]
    rows = re.findall(r"^\| [a-z ]+ \| (.+?) \| [^|]+ \|$",
                      (REPO / "docs" / "testing.md").read_text(), re.M)
    # Each module is named in backticks; what a parenthesis says of it is not a module.
    written = [{name.rstrip("/") for name in re.findall(r"`([a-z_/]+)`",
                                                        re.sub(r"\([^)]*\)", "", row))}
               for row in rows if "`" in row]
    assert written == layers
