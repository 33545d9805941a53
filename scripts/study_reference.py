"""Generate the study-file reference in docs/study-files.md from the schema in hpo.config.

Every key's description is its field's docstring, so the reference cannot drift from the
code: `--check` exits 1 when the page differs from what this script would write (CI runs it
through tests/test_docs.py), or when a key has no description.

    python scripts/study_reference.py           # rewrite the table in docs/study-files.md
    python scripts/study_reference.py --check   # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from hpo.config import FloatRange, IntRange, StudyConfig

PAGE = Path(__file__).resolve().parents[1] / "docs" / "study-files.md"
BEGIN = "<!-- begin study-file reference -->"
END = "<!-- end study-file reference -->"
RANGES = {FloatRange: "`{low, high, log: false}`", IntRange: "`{low, high, step: 1, log: false}`"}


def rows(model: type[BaseModel] = StudyConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, meaning) of every key under `model`, sections expanded."""
    found = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        members = _members(field.annotation)
        section = next((m for m in members if _is_model(m) and m not in RANGES), None)
        if section is not None:
            found.extend(rows(section, f"{key}."))
            continue
        if not field.description:
            raise SystemExit(f"{key}: no description (give the field a docstring in "
                             f"hpo/config.py)")
        found.append((key, _default(field), " ".join(field.description.split()) +
                      _shape(members)))
    return found


def _members(annotation: object) -> tuple[object, ...]:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return typing.get_args(annotation)
    return (annotation,)


def _is_model(member: object) -> bool:
    return isinstance(member, type) and issubclass(member, BaseModel)


def _shape(members: tuple[object, ...]) -> str:
    """How a range is written, where the key takes one."""
    ranges = [RANGES[m] for m in members if m in RANGES]
    if not ranges:
        return ""
    lists = any(typing.get_origin(m) is list or typing.get_origin(
        typing.get_args(m)[0] if typing.get_args(m) else None) is list for m in members)
    return f" A list of choices or a range {ranges[0]}." if lists else f" A range {ranges[0]}."


def _default(field) -> str:
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "-"
    value = field.default
    if isinstance(value, BaseModel):
        return "-"
    if isinstance(value, bool):
        value = str(value).lower()
    return f"`{value}`"


def table() -> str:
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in rows()]
    return "\n".join(lines)


def render(page: str) -> str:
    head, begin, rest = page.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise SystemExit(f"{PAGE}: the markers {BEGIN} and {END} are missing")
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args()
    page = PAGE.read_text(encoding="utf-8")
    wanted = render(page)
    if args.check:
        if wanted != page:
            print(f"{PAGE}: the study-file reference is stale; run "
                  f"python scripts/study_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
