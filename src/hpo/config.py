"""The study file: its schema, loading, `--set` overrides and validation.

The whole file is validated before any data is read or any model loaded; every problem comes
back as one ConfigError line naming the file and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from hpo.errors import ConfigError

STUDIES_DIR = Path("configs/studies")
PRECISIONS = ("fp16", "bf16", "none")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_range(low: float, high: float, log: bool) -> None:
    if low > high:
        raise ValueError(f"low ({low}) is greater than high ({high})")
    if log and low <= 0:
        raise ValueError(f"log scale needs low > 0, got {low}")


class FloatRange(_Section):
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        _check_range(self.low, self.high, self.log)
        return self


class IntRange(_Section):
    low: int
    high: int
    log: bool = False
    step: Annotated[int, Field(ge=1)] = 1

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        _check_range(self.low, self.high, self.log)
        if self.log and self.step != 1:
            raise ValueError("log scale and step cannot be combined")
        return self


def _unique(values: list[Any]) -> list[Any]:
    if len(set(values)) != len(values):
        raise ValueError(f"choices repeat: {values}")
    return values


class SearchSpace(_Section):
    model_name: Annotated[list[str], Field(min_length=1)]
    fp_precision: str | list[str] = "auto"
    target_effective_batch_size: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    learning_rate: FloatRange
    # Extra parameters: each replaces the training setting of the same name for the trial.
    weight_decay: FloatRange | None = None
    warmup_ratio: FloatRange | None = None
    max_grad_norm: FloatRange | None = None
    epochs: IntRange | None = None

    @field_validator("fp_precision")
    @classmethod
    def _precisions(cls, value: str | list[str]) -> str | list[str]:
        if value == "auto":
            return value
        if isinstance(value, str) or not value:
            raise ValueError("expected auto or a non-empty list of fp16, bf16, none")
        unknown = [p for p in value if p not in PRECISIONS]
        if unknown:
            raise ValueError(f"unknown precision {unknown[0]!r} (expected fp16, bf16 or none)")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> SearchSpace:
        _unique(self.model_name)
        _unique(self.target_effective_batch_size)
        if self.fp_precision != "auto":
            _unique(self.fp_precision)
        return self

    def extras(self) -> dict[str, FloatRange | IntRange]:
        names = ("weight_decay", "warmup_ratio", "max_grad_norm", "epochs")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


class SamplerConfig(_Section):
    name: Literal["tpe", "random"] = "tpe"
    seed: int | None = None
    n_startup_trials: Annotated[int, Field(ge=0)] = 10


class PrunerConfig(_Section):
    name: Literal["median", "hyperband", "none"] = "median"
    n_startup_trials: Annotated[int, Field(ge=0)] = 5
    n_warmup_steps: Annotated[int, Field(ge=0)] = 1


class StudySection(_Section):
    name: str | None = None
    storage: str | None = None
    objective: Literal["macro_f1", "micro_f1"] = "macro_f1"
    # A worker stops after this many FAILed trials in a row instead of burning the budget.
    max_consecutive_failures: Annotated[int, Field(ge=1)] = 3
    # A running trial beats every heartbeat_interval seconds; one silent for grace_period is
    # failed and re-queued, at most max_retry times.
    heartbeat_interval: Annotated[int, Field(ge=1)] = 30
    grace_period: Annotated[int, Field(ge=1)] = 120
    max_retry: Annotated[int, Field(ge=0)] = 2

    @model_validator(mode="after")
    def _grace(self) -> StudySection:
        if self.grace_period <= self.heartbeat_interval:
            raise ValueError(
                f"grace_period ({self.grace_period}) must exceed heartbeat_interval "
                f"({self.heartbeat_interval})"
            )
        return self
    sampler: SamplerConfig = SamplerConfig()
    pruner: PrunerConfig = PrunerConfig()


class DataConfig(_Section):
    dir: str
    task: Literal["multilabel", "nli_pairs"] = "multilabel"
    special_case: bool = False
    validation_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.15
    test_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.15
    split_seed: int = 13
    max_length: Annotated[int, Field(ge=8, le=8192)] = 512

    @model_validator(mode="after")
    def _fractions(self) -> DataConfig:
        if self.validation_fraction + self.test_fraction >= 1:
            raise ValueError("validation_fraction + test_fraction must be below 1")
        return self


class TrainingConfig(_Section):
    epochs: Annotated[int, Field(ge=1)] = 3
    weight_decay: Annotated[float, Field(ge=0)] = 0.01
    warmup_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    # balanced: each label's positives weigh negatives/positives in the loss. Rare symptoms
    # otherwise sit below the 0.5 threshold for most of a short fine-tuning run.
    pos_weight: Literal["balanced", "none"] = "balanced"
    max_physical_batch_size: Annotated[int, Field(ge=1)] = 256
    safety_margin: Annotated[float, Field(gt=0, le=1)] = 0.9
    gradient_checkpointing: bool = False
    compile: bool = False
    seed: int = 42
    device: str = "auto"
    # Each trial in a fresh child process: a library that leaks cannot poison the next trial.
    isolate_trials: bool = False


class StudyConfig(_Section):
    study: StudySection = StudySection()
    data: DataConfig
    search_space: SearchSpace
    training: TrainingConfig = TrainingConfig()

    @model_validator(mode="after")
    def _device(self) -> StudyConfig:
        device = self.training.device
        if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"training.device must be auto, cpu, cuda or cuda:N, got {device!r}")
        return self


def study_path(name: str) -> Path:
    return STUDIES_DIR / f"{name}.yaml"


ENVIRONMENT = {
    "HPO_HEARTBEAT_INTERVAL": "study.heartbeat_interval",
    "HPO_GRACE_PERIOD": "study.grace_period",
}


def environment_overrides() -> list[str]:
    """Overrides from the environment, handy in containers; --set comes after and wins."""
    return [f"{key}={os.environ[var]}" for var, key in ENVIRONMENT.items() if os.environ.get(var)]


def load(path: Path, overrides: list[str] = (), *, name: str | None = None) -> StudyConfig:
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
    for item in overrides:
        apply_override(raw, item)
    raw.setdefault("study", {})
    if isinstance(raw["study"], dict) and not raw["study"].get("name"):
        raw["study"]["name"] = name or path.stem
    try:
        return StudyConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_first_error(exc)}") from None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply `key.path=value` to the raw mapping; the value is read as YAML so it is typed."""
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item}: expected KEY=VALUE")
    parts = key.split(".")
    _check_key(parts, key)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"--set {key}: value {text!r} is not valid YAML") from None
    node = raw
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def _check_key(parts: list[str], key: str) -> None:
    model: type[BaseModel] | None = StudyConfig
    for depth, part in enumerate(parts):
        if model is None or part not in model.model_fields:
            raise ConfigError(f"--set {key}: unknown key '{'.'.join(parts[: depth + 1])}'")
        model = _section_type(model.model_fields[part].annotation)


def _section_type(annotation: Any) -> type[BaseModel] | None:
    candidates = getattr(annotation, "__args__", None) or (annotation,)
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    # Union members show up in the location as class or type names; users never wrote those.
    loc = [str(p) for p in error["loc"] if not _is_type_label(p)]
    where = ".".join(loc) or "top level"
    if error["type"] == "extra_forbidden":
        return f"unknown key '{where}'"
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
