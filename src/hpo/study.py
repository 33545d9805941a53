"""Storage from a URL, creating or joining a study with its pinned space, and the worker loop
with its study-wide trial budget."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import optuna
import sqlalchemy
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from hpo.config import StudyConfig
from hpo.executor import Worker, execute
from hpo.hardware import Device
from hpo.space import PinnedSpace, pin

DEFAULT_STORAGE = "sqlite:///hpo.db"
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class StorageError(ValueError):
    """A storage that cannot be opened; str(e) is one line without the password."""


def storage_url(option: str | None, config: StudyConfig | None) -> str:
    """--storage, else HPO_STORAGE, else the study file, else the embedded SQLite file."""
    for candidate in (option, os.environ.get("HPO_STORAGE"), config and config.study.storage):
        if candidate:
            return candidate
    return DEFAULT_STORAGE


def redact(url: str) -> str:
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except sqlalchemy.exc.ArgumentError:
        return "<unparseable storage URL>"


def open_storage(url: str) -> RDBStorage:
    safe = redact(url)
    try:
        parsed = sqlalchemy.engine.make_url(url)
    except sqlalchemy.exc.ArgumentError:
        raise StorageError(f"storage URL {safe} is not a database URL") from None
    engine_kwargs: dict = {}
    if parsed.get_backend_name() != "sqlite":
        engine_kwargs = {"pool_pre_ping": True, "pool_size": 2, "max_overflow": 2}
        if parsed.get_backend_name() == "postgresql":
            engine_kwargs["connect_args"] = {"connect_timeout": 10}
    try:
        return RDBStorage(url, engine_kwargs=engine_kwargs)
    except Exception as exc:  # drivers raise their own types; all mean "cannot open it"
        raise StorageError(
            f"storage {safe} cannot be opened: {_scrub(str(exc), parsed.password)}"
        ) from None


def _scrub(message: str, password: str | None) -> str:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return first.replace(password, "***") if password else first


def _sampler(config: StudyConfig) -> optuna.samplers.BaseSampler:
    sampler = config.study.sampler
    if sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=sampler.seed)
    return optuna.samplers.TPESampler(
        seed=sampler.seed, n_startup_trials=sampler.n_startup_trials, multivariate=True
    )


def _pruner(config: StudyConfig) -> optuna.pruners.BasePruner:
    pruner = config.study.pruner
    if pruner.name == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=pruner.n_startup_trials, n_warmup_steps=pruner.n_warmup_steps
        )
    if pruner.name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource="auto")
    return optuna.pruners.NopPruner()


def join(
    config: StudyConfig, storage: RDBStorage, device: Device
) -> tuple[optuna.Study, PinnedSpace]:
    """Create the study or load it, and the space this worker may search in it."""
    study = optuna.create_study(
        storage=storage,
        study_name=config.study.name,
        direction="maximize",
        sampler=_sampler(config),
        pruner=_pruner(config),
        load_if_exists=True,
    )
    return study, pin(study, config.search_space, device)


def finished_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=FINISHED))


def running_count(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.RUNNING, TrialState.WAITING)))


class WorkerStopped(RuntimeError):
    """The worker gave up: too many trials in a row failed."""


@dataclass(frozen=True)
class WorkerResult:
    ran: int
    finished_before: int
    finished_after: int


def run_worker(
    study: optuna.Study,
    worker: Worker,
    reporter,
    *,
    n_trials: int,
    timeout: float | None = None,
    max_consecutive_failures: int = 3,
) -> WorkerResult:
    """Run trials until the study holds `n_trials` finished (COMPLETE or PRUNED) trials, or
    until `timeout` seconds have passed (a running trial is not cut short). Failed trials do
    not count towards the total; `max_consecutive_failures` of them in a row stop the worker."""
    started = time.monotonic()
    before = finished_count(study)
    ran = 0
    failures = 0
    while finished_count(study) + running_count(study) < n_trials:
        if timeout is not None and time.monotonic() - started >= timeout:
            reporter.message(f"timeout of {timeout:g}s reached")
            break
        trial = study.ask()
        try:
            outcome, finished = execute(study, trial, worker, reporter)
        except KeyboardInterrupt:
            # Leave no trial RUNNING behind an interrupted worker.
            if trial.number not in {t.number for t in study.get_trials(states=FINISHED)}:
                study.tell(trial, state=TrialState.FAIL)
            raise
        ran += 1
        reporter.trial_finished(finished, outcome)
        failures = failures + 1 if outcome.state == TrialState.FAIL else 0
        if failures >= max_consecutive_failures:
            raise WorkerStopped(
                f"{failures} trials in a row failed; last error: {outcome.error}"
            )
    return WorkerResult(ran, before, finished_count(study))
