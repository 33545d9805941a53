"""Reading the official ReDSM5 files: `redsm5_posts.csv` and `redsm5_annotations.csv`.

Row numbers in error messages count the header as row 1, as a spreadsheet shows the file, and
count records rather than physical lines, since a quoted text may span several lines.
"""

from __future__ import annotations

import csv
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hpo.errors import DataError
from hpo.study_files import local_path

log = logging.getLogger(__name__)

SYMPTOMS: tuple[str, ...] = (
    "DEPRESSED_MOOD",
    "ANHEDONIA",
    "APPETITE_CHANGE",
    "SLEEP_ISSUES",
    "PSYCHOMOTOR",
    "FATIGUE",
    "WORTHLESSNESS",
    "COGNITIVE_ISSUES",
    "SUICIDAL_THOUGHTS",
)
SPECIAL_CASE = "SPECIAL_CASE"
POSTS_FILE = "redsm5_posts.csv"
ANNOTATIONS_FILE = "redsm5_annotations.csv"

# Only the columns the labels depend on are required; sentence_id, sentence_text and
# explanation are part of the format but unused here, so files that trimmed them still load.
_POSTS_COLUMNS = ("post_id", "text")
_ANNOTATIONS_COLUMNS = ("post_id", "DSM5_symptom", "status")
_KNOWN_SYMPTOMS = frozenset((*SYMPTOMS, SPECIAL_CASE))
_STATUSES = {"0": False, "1": True}
# Columns of the official files that hpo does not read.
_OPTIONAL_COLUMNS = frozenset({"sentence_id", "sentence_text", "explanation"})


@dataclass(frozen=True)
class Post:
    post_id: str
    text: str
    # Symptoms with at least one status-1 row (SPECIAL_CASE only when read with special_case).
    symptoms: frozenset[str]


def label_names(special_case: bool = False) -> tuple[str, ...]:
    """The label names in their fixed order: the nine criteria, then SPECIAL_CASE if enabled."""
    return (*SYMPTOMS, SPECIAL_CASE) if special_case else SYMPTOMS


GET_THE_DATA = (
    f"put {POSTS_FILE} and {ANNOTATIONS_FILE} there (ReDSM5 is gated: ask for access at "
    f"https://huggingface.co/datasets/irlab-udc/redsm5) or set data.dir to where they are"
)


def read_redsm5(directory: str | Path, *, special_case: bool = False) -> list[Post]:
    """Read the posts of a ReDSM5 directory, in file order, with their symptom sets."""
    directory = local_path(directory)
    if not directory.is_dir():
        if directory.exists():
            raise DataError(f"{directory}: not a directory")
        where = "" if directory.is_absolute() else f" (in {Path.cwd()})"
        raise DataError(f"{directory}: data directory not found{where}; {GET_THE_DATA}")
    posts_path = directory / POSTS_FILE
    annotations_path = directory / ANNOTATIONS_FILE

    texts: dict[str, str] = {}
    first_row: dict[str, int] = {}
    for row_number, row in _rows(posts_path, _POSTS_COLUMNS):
        post_id = _value(posts_path, row_number, row, "post_id")
        if post_id in texts:
            raise DataError(
                f"{posts_path}: column 'post_id', row {row_number}: duplicate post_id "
                f"{_show(post_id)} (first seen in row {first_row[post_id]})"
            )
        if not row["text"].strip():
            raise DataError(f"{posts_path}: column 'text', row {row_number}: empty text "
                            f"(post_id {_show(post_id)})")
        texts[post_id] = row["text"]
        first_row[post_id] = row_number
    if not texts:
        raise DataError(f"{posts_path}: no posts (the file has a header but no rows)")

    symptoms: dict[str, set[str]] = {post_id: set() for post_id in texts}
    for row_number, row in _rows(annotations_path, _ANNOTATIONS_COLUMNS):
        post_id = _value(annotations_path, row_number, row, "post_id")
        if post_id not in texts:
            raise DataError(
                f"{annotations_path}: column 'post_id', row {row_number}: post_id "
                f"{_show(post_id)} is not in {posts_path.name}"
            )
        symptom = row["DSM5_symptom"].strip()
        if symptom not in _KNOWN_SYMPTOMS:
            expected = ", ".join((*SYMPTOMS, SPECIAL_CASE))
            raise DataError(
                f"{annotations_path}: column 'DSM5_symptom', row {row_number}: unknown symptom "
                f"{_show(symptom)} (expected one of {expected})"
            )
        status = _STATUSES.get(row["status"].strip())
        if status is None:
            raise DataError(
                f"{annotations_path}: column 'status', row {row_number}: invalid status "
                f"{_show(row['status'])} (expected 0 or 1)"
            )
        if status and (symptom != SPECIAL_CASE or special_case):
            symptoms[post_id].add(symptom)

    return [Post(post_id, text, frozenset(symptoms[post_id])) for post_id, text in texts.items()]


# A post of 6,990 words (ReDSM5's longest) is about 40 KiB; csv's own limit is 128 KiB.
MAX_FIELD_BYTES = 16 * 2**20


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Yield (row number, {column: value}) for each non-blank data row, columns by header name.

    Parsed strictly: a quote opened in a row and never closed properly would otherwise swallow
    every later row into one field, silently."""
    reader = csv.reader(io.StringIO(_read_text(path), newline=""), strict=True)
    records = enumerate(reader, start=1)
    previous_limit = csv.field_size_limit(MAX_FIELD_BYTES)
    first_line = 1
    row_number = 1
    try:
        _, header = next(records, (1, []))
        header = [name.strip() for name in header]
        index = _columns(path, header, required)
        for row_number, fields in records:
            if fields:
                for column, i in index.items():
                    if i >= len(fields):
                        raise DataError(
                            f"{path}: column '{column}', row {row_number}: missing value (the "
                            f"row has {len(fields)} fields, the header {len(header)})"
                        )
                yield row_number, {column: fields[i] for column, i in index.items()}
            first_line = reader.line_num + 1
    except csv.Error as exc:
        if "field larger than field limit" in str(exc):
            raise DataError(f"{path}: row {row_number + 1}: a field is over "
                            f"{MAX_FIELD_BYTES // 2**20} MiB") from None
        if reader.line_num > first_line:
            raise DataError(
                f"{path}: row {row_number + 1} (line {first_line}): a quote opened there is not "
                f"closed before line {reader.line_num} ({exc}); check that row's quotes"
            ) from None
        raise DataError(f"{path}: malformed CSV near line {reader.line_num}: {exc}") from None
    finally:
        csv.field_size_limit(previous_limit)


def _columns(path: Path, header: list[str], required: tuple[str, ...]) -> dict[str, int]:
    """Each required column's index; a column named twice is ambiguous, others are ignored."""
    for column in required:
        if column not in header:
            found = ", ".join(header) if header else "no header"
            raise DataError(f"{path}: missing required column '{column}' (found: {found})")
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise DataError(f"{path}: column {', '.join(map(repr, twice))} appears more than once "
                        f"in the header")
    extra = [name for name in header if name not in required]
    if extra and not set(extra) <= _OPTIONAL_COLUMNS:
        log.warning("%s: ignoring column(s) %s", path, ", ".join(
            repr(name) for name in extra if name not in _OPTIONAL_COLUMNS))
    return {column: header.index(column) for column in required}


def _read_text(path: Path) -> str:
    # Decoding the whole file up front turns a bad byte anywhere into one clear error instead
    # of a UnicodeDecodeError surfacing mid-parse; utf-8-sig drops a BOM if there is one.
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found; {GET_THE_DATA}") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not valid UTF-8 (byte {exc.start}); save the file as UTF-8"
        ) from None


def _value(path: Path, row_number: int, row: dict[str, str], column: str) -> str:
    value = row[column].strip()
    if not value:
        raise DataError(f"{path}: column '{column}', row {row_number}: empty {column}")
    return value


def _show(value: str) -> str:
    """A value quoted for an error message: repr escapes newlines, long values are cut."""
    return repr(value if len(value) <= 60 else value[:57] + "...")
