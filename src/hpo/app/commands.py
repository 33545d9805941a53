"""The `hpo` commands as plain functions: each checks its input (`preflight`), does its one
job through the modules that hold it, and prints what a user reads. The CLI turns arguments
into these calls and their errors into exit codes.

Heavy modules (torch, transformers, optuna) are imported inside the commands, after the
preflight checks, so a typo is reported without waiting for them.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from hpo.app.preflight import (
    Prepared,
    StudyRef,
    artifact_location,
    load_config,
    load_study,
    open_for_reading,
    prepare,
)
from hpo.errors import ConfigError

if TYPE_CHECKING:
    import optuna

    from hpo.search.resilience import ResilientRDBStorage
    from hpo.space import PinnedSpace


def create(ref: StudyRef, *, skip_check: bool) -> None:
    prepared = prepare(ref, runs_trials=False)

    from hpo.search import study
    from hpo.search.storage import redact

    # "Once, anywhere": this host may have no GPU, so `auto` is left to the first worker.
    optuna_study, pinned = study.join(prepared.config, prepared.storage, None,
                                     prepared.splits)
    print(f"study '{optuna_study.study_name}' ready on {redact(prepared.url)}; pinned "
          f"fp_precision {pinned.describe_precisions()}; "
          f"{study.finished_count(optuna_study)} finished trials")
    if not skip_check:
        _check(prepared, optuna_study, pinned, fresh=False)


def check(ref: StudyRef) -> None:
    prepared = prepare(ref)

    from hpo.search import study

    name = prepared.config.study.name
    assert name is not None  # study_files.load names every study
    existed = study_exists(prepared.storage, name)
    # The check keeps its verdicts in the study, so that `hpo run` does not repeat it: joining
    # creates the study, and a new one is said, with the ways to use or remove it. Like
    # create, this may run on a host other than the fleet's: `auto` stays open.
    optuna_study, pinned = study.join(prepared.config, prepared.storage, None,
                                     prepared.splits)
    if not existed:
        print(created_message(ref, name, prepared.url), flush=True)
    _check(prepared, optuna_study, pinned, fresh=True)


def study_exists(opened: optuna.storages.BaseStorage, name: str) -> bool:
    import optuna

    return name in optuna.get_all_study_names(opened)


def study_options(ref: StudyRef, url: str) -> str:
    """The options that name this study in a later command, as this one was given them
    (a storage's password hidden)."""
    from hpo.search.storage import redact

    names = f"--study {ref.study}" if ref.study else f"--config {ref.config}"
    if ref.storage:
        names += f" --storage {redact(url)}"
    return names


def created_message(ref: StudyRef, name: str, url: str) -> str:
    """What `hpo check` says of a study it created: where, and the commands that join or
    remove it, naming it as this command did."""
    from hpo.search.storage import redact

    names = study_options(ref, url)
    return (f"created study '{name}' in {redact(url)} to keep the check's verdicts (`hpo run "
            f"{names}` joins it; `hpo delete {names}` removes it)")


def _check(prepared: Prepared, optuna_study: optuna.Study, pinned: PinnedSpace, *,
           fresh: bool) -> None:
    """The study's check on this host's device, for the pinned precisions it runs natively;
    `fresh` runs it even if a worker on this kind of device already has."""
    from hpo.app.console import ConsoleDisplay
    from hpo.hardware import native_precisions
    from hpo.space import PinnedSpace
    from hpo.training import memory
    from hpo.trial import step_check as check_module
    from hpo.trial.resources import load_resources

    device = prepared.device
    native = native_precisions(device)
    precisions = tuple(p for p in (pinned.fp_precision or native) if p in native)
    if not precisions:
        print(f"no pinned precision runs natively on {device.describe()}: nothing to check "
              f"here")
        return
    here = PinnedSpace(pinned.declared, precisions)
    resources = load_resources(prepared.config, here, device, prepared.splits)
    if fresh:
        optuna_study.set_user_attr(check_module.key(device), None)
    # As in a worker: the imported modules and loaded models out of the collector's sight, so
    # the check's collections between combinations walk only its own objects.
    with memory.long_lived_frozen():
        verdicts = check_module.ensure(optuna_study, resources, precisions, ConsoleDisplay())
    usable = sum(v.usable for v in verdicts)
    print(f"{usable} of {len(verdicts)} model x precision combinations usable on "
          f"{device.describe()}; the study keeps the verdicts for this kind of device")


def run(ref: StudyRef, *, n_trials: int | None, timeout: float | None,
        skip_check: bool, verbose: bool = False) -> None:
    """A worker until the study has `n_trials` finished trials or `timeout` passes; raises
    worker.WorkerStopped after too many failures in a row."""
    prepared = prepare(ref)

    from hpo.app import worker

    worker.work(prepared, worker.Orders(
        n_trials=n_trials if n_trials is not None else math.inf, timeout=timeout,
        run_check=not skip_check, verbose=verbose,
        next_command=study_options(ref, prepared.url)))


def dead_worker_trials(ref: StudyRef) -> Callable[[int, str], list[tuple[int, bool]]]:
    """For the launcher of `hpo run --workers`: given the pid of a worker of this host that
    died and how, fail the trials it left RUNNING and queue their retries, as the reaper would
    after the grace period (`liveness.fail_dead_worker`). The study and its storage are the
    workers' own, opened on the first death: a launcher whose workers end well never opens
    them, and a study file that does not load is the creation step's to report."""
    opened: list[tuple[optuna.Study, ResilientRDBStorage]] = []
    lock = threading.Lock()  # two workers may die at once

    def on_death(pid: int, how: str) -> list[tuple[int, bool]]:
        from hpo.search import liveness

        with lock:
            if not opened:
                opened.append(_workers_study(ref))
        study, storage = opened[0]
        worker = liveness.worker_on_this_host(pid)
        return liveness.fail_dead_worker(study, storage, worker, f"its worker {worker} {how}")

    return on_death


def _workers_study(ref: StudyRef) -> tuple[optuna.Study, ResilientRDBStorage]:
    """The study the workers of `ref` join, on a storage that retries a trial as theirs do."""
    import optuna

    from hpo.search import storage
    from hpo.search.study import pin_liveness

    config = load_config(ref)
    url = storage.storage_url(ref.storage, config.study.storage)
    opened = storage.open_storage(url)
    study = optuna.load_study(study_name=config.study.name, storage=opened)
    # The retry count the study pinned when it was created, which every worker's reaper
    # uses whatever its own file says.
    pin_liveness(study, opened, config)
    return study, opened


def status(ref: StudyRef, fmt: str) -> None:
    from hpo.app import summary

    print(summary.render_status(summary.status(load_study(ref)), fmt))


def best(ref: StudyRef, fmt: str) -> None:
    from hpo.app import summary

    study = load_study(ref)
    info = summary.best(study)
    if info is None:
        raise ConfigError(f"study '{study.study_name}' has no completed trial yet")
    print(summary.dump(info, "yaml" if fmt == "text" else fmt))


def final(ref: StudyRef, *, trial: int | None, seeds: int, refit: bool, tuned: bool,
          output: Path | None) -> None:
    """Train the chosen trial again per seed, score it on the test split, export the model."""
    # The trial's precision is what must be native here (final.validate_precision), not all
    # of the study file's.
    prepared = prepare(ref, runs_trials=False, existing=True)

    from hpo.app import final as final_module
    from hpo.app.console import ConsoleDisplay
    from hpo.search.study import splits_recorded
    from hpo.space import PinnedSpace, declare
    from hpo.training import export
    from hpo.trial.batch_limit import shared_batch_cache
    from hpo.trial.resources import load_resources

    config = prepared.config
    if not prepared.splits.test:
        raise ConfigError(f"data.test_fraction is {config.data.test_fraction:g}: there is no "
                          f"held-out test split to score the final model on")
    optuna_study = load_study(ref, prepared.storage, prepared.url)
    display = ConsoleDisplay()
    if not splits_recorded(optuna_study, prepared.splits):
        display.warning(f"study '{optuna_study.study_name}' recorded no data split (its "
                         f"workers predate that): the test split is taken to be the one its "
                         f"search held out")
    output = output or Path("final") / optuna_study.study_name
    export.validate_output(output)
    pinned = PinnedSpace(declare(config.search_space, None).declared, None)
    resources = load_resources(config, pinned, prepared.device, prepared.splits)
    options = final_module.Options(number=trial, seeds=seeds, refit=refit, tuned=tuned)
    report, model = final_module.final(optuna_study, resources, prepared.splits, options,
                                       display,
                                       shared_batch_cache(optuna_study, prepared.storage))
    export.write(output, model, report)
    print(final_module.render(report))
    print(f"model, report.json and model card written to {output}")


def studies(ref: StudyRef, fmt: str) -> None:
    from hpo.app import summary

    opened, url = open_for_reading(ref)
    print(summary.render_studies(summary.studies(opened), url, fmt))


def delete(ref: StudyRef, confirm: Callable[[str], bool]) -> None:
    """Delete the study, its trials and its kept models, once `confirm` agrees to the
    question it is asked."""
    import optuna

    from hpo.search import artifacts
    from hpo.search.storage import redact

    opened, url = open_for_reading(ref)
    study = load_study(ref, opened, url)
    name = study.study_name
    what = f"study '{name}' with {len(study.get_trials(deepcopy=False))} trials in {redact(url)}"
    if not confirm(f"delete {what}? [y/N] "):
        print(f"hpo: {what} kept")
        return
    where = artifact_location(ref, url)
    store = artifacts.open_existing(where)
    removed = 0 if store is None else artifacts.remove_all(study, opened, store)
    optuna.delete_study(study_name=name, storage=opened)
    print(f"deleted {what}" + (f" and its {removed} kept model(s) in {where}" if removed else ""))


def dashboard(ref: StudyRef, *, host: str, port: int, artifacts_at: str | None,
              allow_writes: bool) -> None:
    import optuna_dashboard

    from hpo.app.dashboard import DashboardArtifactStore, ReadOnlyStorage
    from hpo.search import artifacts
    from hpo.search.resilience import ResilientRDBStorage
    from hpo.search.storage import redact

    kind = ResilientRDBStorage if allow_writes else ReadOnlyStorage
    opened, url = open_for_reading(ref, storage_class=kind)
    may = "read and edit" if allow_writes else "read"
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"hpo: warning: optuna-dashboard has no authentication and binds {host}; "
              f"anyone who can reach port {port} can {may} the studies", file=sys.stderr)
    mode = "edits allowed" if allow_writes else "read-only; --allow-writes to edit"
    print(f"optuna-dashboard for {redact(url)} on http://{host}:{port}/dashboard "
          f"({mode}; Ctrl-C stops it)", flush=True)
    where = artifacts_at or artifact_location(ref, url)
    if artifacts_at and not artifacts_at.startswith("s3://") and not Path(
            artifacts_at).is_dir():
        raise ConfigError(f"--artifacts {artifacts_at}: no such directory")
    store = artifacts.open_existing(where, writable=False)
    if store is not None:
        store = DashboardArtifactStore(store, writable=allow_writes)
        print(f"kept models from the artifact store {where}", flush=True)
    optuna_dashboard.run_server(opened, host=host, port=port, artifact_store=store)


def hardware(device_name: str, steps: int) -> None:
    from hpo import hardware as hardware_module
    from hpo.app import hardware_report

    device = hardware_module.detect(device_name)
    print(hardware_report.render(hardware_report.inspect(device, steps=steps)))
