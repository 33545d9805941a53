from __future__ import annotations

import csv
import importlib.util
import re
import statistics
from pathlib import Path
from types import ModuleType

import pytest

from hpo.data.redsm5 import ANNOTATIONS_FILE, POSTS_FILE, SPECIAL_CASE, label_names, read_redsm5

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "data" / "demo"
FILES = (POSTS_FILE, ANNOTATIONS_FILE, "README.md")


def load_generator() -> ModuleType:
    path = ROOT / "scripts" / "make_demo_data.py"
    spec = importlib.util.spec_from_file_location("make_demo_data", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("demo")
    load_generator().main(["--output-dir", str(output)])
    return output


@pytest.mark.parametrize("name", FILES)
def test_committed_files_match_the_generator(generated: Path, name: str) -> None:
    assert (generated / name).read_bytes() == (DEMO / name).read_bytes(), (
        f"data/demo/{name} is stale: run `python scripts/make_demo_data.py`"
    )


def test_files_are_plain_utf8_with_lf() -> None:
    for name in FILES:
        data = (DEMO / name).read_bytes()
        assert not data.startswith(b"\xef\xbb\xbf") and b"\r" not in data
        data.decode("utf-8")
    assert "synthetic" in (DEMO / "README.md").read_text(encoding="utf-8").lower()


def test_reader_loads_the_demo_and_every_label_has_positives() -> None:
    posts = read_redsm5(DEMO, special_case=True)
    assert len(posts) == 600
    assert all(re.fullmatch(r"demo_\d{4}", post.post_id) for post in posts)
    for label in label_names(special_case=True):
        assert sum(label in post.symptoms for post in posts) >= 30, label
    without = sum(not (post.symptoms - {SPECIAL_CASE}) for post in posts)
    assert 100 <= without <= 300  # some posts with none of the nine, as in the real corpus


def test_lengths_are_long_tailed() -> None:
    words = [len(post.text.split()) for post in read_redsm5(DEMO)]
    median = statistics.median(words)
    assert max(words) > 5 * median
    assert statistics.fmean(words) > median
    assert sum(w > 400 for w in words) >= 3


def test_annotations_quote_the_post_and_use_sentence_ids() -> None:
    texts = {post.post_id: post.text for post in read_redsm5(DEMO)}
    with (DEMO / ANNOTATIONS_FILE).open(encoding="utf-8", newline="") as file:
        rows = list(csv.DictReader(file))
    assert {row["status"] for row in rows} == {"0", "1"}
    for row in rows:
        assert row["sentence_text"] in texts[row["post_id"]]
        assert re.fullmatch(re.escape(row["post_id"]) + r"_\d+", row["sentence_id"])
        assert row["explanation"]
