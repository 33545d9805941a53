"""Finding and loading study files: where `--study NAME` and the demo's files are read from,
reading a file, its `--set` and environment overrides, and its validation errors as one line.

The whole file is validated before any data is read or any model loaded; all its problems
come back together as one ConfigError line naming, for each, the key and where it was written:
the file, a `--set` option or an environment variable.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ValidationError

from hpo.config import StudyConfig
from hpo.errors import ConfigError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails

STUDIES_DIR = Path("configs/studies")
# The shipped study files, installed with the package (a link to configs/studies in the
# repository), so `--study demo` works from any directory.
PACKAGED_STUDIES = Path(__file__).parent / "studies"
# The demo's data and tiny model, installed with the package (a link to data/demo in the
# repository), so the demo runs from any directory and from a wheel.
DEMO_DIR = Path("data/demo")
PACKAGED_DEMO = Path(__file__).parent / "demo"


def local_path(path: str | Path) -> Path:
    """Where a study file's relative path under data/demo is read from: the working directory
    if it holds it, else the copy installed with hpo."""
    path = Path(path)
    if path.exists() or path.is_absolute() or not path.is_relative_to(DEMO_DIR):
        return path
    packaged = PACKAGED_DEMO / path.relative_to(DEMO_DIR)
    return packaged if packaged.exists() else path


def find_study(name: str) -> Path | None:
    """The file of `--study NAME`: ./configs/studies/NAME.yaml, else the shipped one."""
    for directory in (STUDIES_DIR, PACKAGED_STUDIES):
        if (directory / f"{name}.yaml").is_file():
            return directory / f"{name}.yaml"
    return None


def known_studies() -> list[str]:
    """The study names `--study` finds here or among hpo's own study files."""
    return sorted({p.stem for d in (STUDIES_DIR, PACKAGED_STUDIES) for p in d.glob("*.yaml")})


def study_path(name: str) -> Path:
    path = find_study(name)
    if path is None:
        known = known_studies()
        raise ConfigError(
            f"unknown study '{name}': no {name}.yaml in {STUDIES_DIR.resolve()} nor in hpo's "
            f"own studies ({', '.join(known) or 'none'}); --config FILE reads any study file")
    return path


ENVIRONMENT = {
    "HPO_HEARTBEAT_INTERVAL": "study.heartbeat_interval",
    "HPO_GRACE_PERIOD": "study.grace_period",
    "HPO_ARTIFACTS": "study.artifacts",
}


@dataclass(frozen=True)
class Override:
    """`key=value` replacing a key of the study file, from --set or an environment variable."""

    key: str
    text: str
    source: str = "--set"

    @classmethod
    def parse(cls, item: str, source: str = "--set") -> Override:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{source} {item}: expected KEY=VALUE")
        return cls(key, text, source)

    def __str__(self) -> str:
        if self.source == "--set":
            return f"--set {self.key}={self.text}"
        return f"{self.source}={self.text}"


def environment_overrides() -> list[Override]:
    """Overrides from the environment, handy in containers; --set comes after and wins."""
    return [Override(key, os.environ[var], var)
            for var, key in ENVIRONMENT.items() if os.environ.get(var)]


def load(path: Path, overrides: Sequence[str | Override] = (), *,
         name: str | None = None) -> StudyConfig:
    """Read, override and validate a study file. The study name defaults to the file's stem."""
    if not path.is_file():
        raise ConfigError(f"{path}: study file not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    applied = [item if isinstance(item, Override) else Override.parse(item) for item in overrides]
    for override in applied:
        apply_override(raw, override)
    raw.setdefault("study", {})
    if isinstance(raw["study"], dict) and not raw["study"].get("name"):
        raw["study"]["name"] = name or path.stem
    try:
        return StudyConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_all_errors(exc, path, applied)) from None


def apply_override(raw: dict[str, Any], override: Override | str) -> None:
    """Apply `key.path=value` to the raw mapping; the value is read as YAML so it is typed."""
    if isinstance(override, str):
        override = Override.parse(override)
    parts = override.key.split(".")
    _validate_key(parts, override)
    try:
        value = yaml.safe_load(override.text)
    except yaml.YAMLError:
        raise ConfigError(f"{override}: value {override.text!r} is not valid YAML") from None
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _validate_key(parts: list[str], override: Override) -> None:
    model: type[BaseModel] | None = StudyConfig
    for depth, part in enumerate(parts):
        if model is None or part not in model.model_fields:
            unknown = ".".join(parts[: depth + 1])
            raise ConfigError(f"{override.source} {override.key}: unknown key '{unknown}'"
                              f"{_did_you_mean(part, model)}")
        model = _section_type(model.model_fields[part].annotation)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _section_at(parts: list[str]) -> type[BaseModel] | None:
    model: type[BaseModel] | None = StudyConfig
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        model = _section_type(model.model_fields[part].annotation)
    return model


def _did_you_mean(key: str, section: type[BaseModel] | None) -> str:
    known = list(section.model_fields) if section is not None else []
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _all_errors(exc: ValidationError, path: Path, overrides: list[Override]) -> str:
    """Every problem in one line: those of the file first, then each override's own."""
    from_file: list[str] = []
    from_overrides: list[str] = []
    for error in exc.errors():
        # Union members show up in the location as class or type names; users never wrote those.
        loc = [str(p) for p in error["loc"] if not _is_type_label(p)]
        message = _describe(error, loc)
        culprit = next((o for o in reversed(overrides) if _within(loc, o.key.split("."))), None)
        if culprit is not None:
            message = f"{culprit}: {message}"
        shown = from_file if culprit is None else from_overrides
        if message not in shown:
            shown.append(message)
    parts = ([f"{path}: " + "; ".join(from_file)] if from_file else []) + from_overrides
    return "; ".join(parts)


def _within(loc: list[str], key: list[str]) -> bool:
    """Whether the error at `loc` concerns the value an override set at `key`."""
    return loc[: len(key)] == key or (bool(loc) and key[: len(loc)] == loc)


def _describe(error: ErrorDetails, loc: list[str]) -> str:
    where = ".".join(loc) or "top level"
    if error["type"] == "extra_forbidden":
        return f"unknown key '{where}'{_did_you_mean(loc[-1], _section_at(loc[:-1]))}"
    if error["type"] == "missing":
        return f"missing key '{where}'"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    shown = f" (got {value!r})" if not isinstance(value, dict | list) and value is not None else ""
    return f"{where}: {message}{shown}"


def _is_type_label(part: Any) -> bool:
    if not isinstance(part, str):
        return False
    return part[:1].isupper() or "[" in part or part.startswith("literal")
