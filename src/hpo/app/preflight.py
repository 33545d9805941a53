"""Everything a command checks before it spends compute: the study file, the fault variables,
the data, the models, the device's precisions, then the storage; and the storage and study of
an existing search, for the commands that only read one.

What needs no torch is checked before torch is loaded, so those mistakes are reported at
once: the heavy modules are imported inside the functions, after the light checks.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpo import study_files
from hpo.config import StudyConfig
from hpo.errors import ConfigError

if TYPE_CHECKING:  # the real imports load torch
    import optuna

    from hpo.data.splits import Splits
    from hpo.hardware import Device
    from hpo.search.resilience import ResilientRDBStorage


@dataclass(frozen=True)
class StudyRef:
    """The study and storage a command names: `--study` or `--config`, `--storage`, `--set`."""

    study: str | None = None
    config: Path | None = None
    storage: str | None = None
    overrides: tuple[str, ...] = ()

    def path(self) -> Path | None:
        """The study file, if one can be found."""
        return self.config or (study_files.find_study(self.study) if self.study else None)


def load_config(ref: StudyRef) -> StudyConfig:
    path = ref.config
    if path is None:
        assert ref.study is not None, "a command that reads a study file names one"
        path = study_files.study_path(ref.study)
    overrides = study_files.environment_overrides() + list(ref.overrides)
    return study_files.load(path, overrides, name=ref.study)


@dataclass(frozen=True)
class Prepared:
    """A validated study: config, data splits, device, and the storage it lives in."""

    config: StudyConfig
    splits: Splits
    device: Device
    url: str
    storage: ResilientRDBStorage
    notes: tuple[str, ...] = ()  # what the file's `auto` settings decided on this storage


def prepare(ref: StudyRef, *, runs_trials: bool = True, existing: bool = False) -> Prepared:
    """The study file, data, models and device checked, then the storage opened. On a host
    that runs trials every precision the study searches must be native to the device; a
    command that reads an `existing` search refuses a SQLite file that is not there."""
    from hpo import faults
    from hpo.data.redsm5 import read_redsm5
    from hpo.data.splits import split_posts, validate_folds
    from hpo.search import storage

    config = load_config(ref)
    faults.validate_environment()
    url = storage.storage_url(ref.storage, config.study.storage)
    if existing:
        refuse_missing(url)  # before seconds of reading data and loading models
    data = config.data
    posts = read_redsm5(data.dir, special_case=data.special_case)
    splits = split_posts(posts, validation=data.validation_fraction, test=data.test_fraction,
                         seed=data.split_seed)
    validate_folds(splits, data.cv_folds)

    import optuna

    from hpo import hardware, space
    from hpo.training import models

    models.quiet_transformers()
    models.validate_loadable(config.search_space.model_name, data.max_length)
    device = hardware.detect(config.training.device)
    if runs_trials:
        space.validate_device(config, device)  # refuses emulated precisions before I/O
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opened = storage.open_storage(
        url, heartbeat_interval=config.study.heartbeat_interval,
        grace_period=config.study.grace_period, max_retry=config.study.max_retry,
    )
    from hpo.search.artifacts import with_pause_decided

    config, paused = with_pause_decided(config, url)
    return Prepared(config, splits, device, url, opened, (paused,) if paused else ())


def _file_setting(ref: StudyRef, read: Any) -> Any:
    """A setting of the study file, if the command names one that exists."""
    path = ref.path()
    if path is None or not path.is_file():
        return None
    return read(study_files.load(path, name=ref.study).study)


def open_for_reading(ref: StudyRef, **options: Any) -> tuple[ResilientRDBStorage, str]:
    """The storage of an existing search: --storage, HPO_STORAGE, the study file, hpo.db;
    a SQLite file that does not exist is refused rather than created empty."""
    import optuna

    from hpo.search import storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage.storage_url(ref.storage, _file_setting(ref, lambda s: s.storage))
    refuse_missing(url)
    return storage.open_storage(url, **options), url


def refuse_missing(url: str) -> None:
    """Opening a SQLite file that is not there would create it empty."""
    from hpo.search import storage

    missing = storage.missing_sqlite_file(url)
    if missing is not None:
        raise ConfigError(f"no storage at {missing}: nothing has run there yet (`hpo run` "
                          f"creates it; --storage or HPO_STORAGE names another)")


def load_study(ref: StudyRef, opened: ResilientRDBStorage | None = None,
               url: str | None = None) -> optuna.Study:
    import optuna

    from hpo.search.storage import redact

    if opened is None:
        opened, url = open_for_reading(ref)
    # The name `hpo run` gave it: the file's study.name (with --set and the environment),
    # where a file is found; a study that has no file here is named by --study alone.
    name = ref.study if ref.study and ref.path() is None else load_config(ref).study.name
    assert name is not None  # study_files.load names every study
    try:
        return optuna.load_study(study_name=name, storage=opened)
    except KeyError:
        raise ConfigError(no_study(ref, name, optuna.get_all_study_names(opened),
                                   redact(url or ""))) from None


def no_study(ref: StudyRef, name: str, names: list[str], url: str) -> str:
    """The error for a study that is not in the storage at `url` (redacted), which holds
    `names`: the likely typo's fix, and where to look."""
    path = ref.path()
    if path is not None:
        why = f" (the name {path} gives it; `hpo run` or `hpo create` creates it)"
    elif ref.study:
        # No file either: the name alone was looked up, so either may be the typo.
        why = (f", nor a study file {ref.study}.yaml in {study_files.STUDIES_DIR} or hpo's "
               f"own (--study knows {', '.join(study_files.known_studies()) or 'none'})")
    else:
        why = ""
    close = difflib.get_close_matches(name, names, n=1)
    guess = f"did you mean '{close[0]}'? " if close else ""
    listed = "`hpo studies" + (f" --storage {url}`" if ref.storage else "`")
    return f"no study '{name}' in {url}{why}; {guess}{listed} lists the studies there"



def artifact_location(ref: StudyRef, url: str) -> str | None:
    """The artifact store of the study's kept models: HPO_ARTIFACTS, the study file's
    study.artifacts, else beside a SQLite storage file."""
    from hpo.search import artifacts

    configured = os.environ.get("HPO_ARTIFACTS") or _file_setting(ref, lambda s: s.artifacts)
    return artifacts.location(configured, url)
