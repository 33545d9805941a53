"""Each trial in a fresh child process, for libraries that leak memory or state.

The parent claims the trial and keeps its heartbeat; the child opens its own storage
connection, runs the trial exactly as a worker would in-process and tells the study. A child
that dies without telling (a segfault, the kernel's OOM killer) fails its trial; a parent that
dies takes its child with it (PR_SET_PDEATHSIG on Linux), so no orphan trains on.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo.config import StudyConfig
from hpo.executor import Outcome, execute
from hpo.hardware import Device
from hpo.space import PinnedSpace, suggest

_PR_SET_PDEATHSIG = 1


def in_child(
    config: StudyConfig, pinned: PinnedSpace, device: Device, url: str,
    storage: optuna.storages.BaseStorage,
):
    """A trial runner for worker.run_worker that runs every trial in a new process."""
    # spawn, not fork: the parent holds threads (heartbeat, torch's pools) and open
    # connections that a forked child must not inherit.
    context = multiprocessing.get_context("spawn")
    payload = {"config": config.model_dump(mode="json"), "pinned": pinned.to_json(),
               "device": device, "url": url}

    def run(study: optuna.Study, trial: optuna.Trial) -> tuple[Outcome, FrozenTrial]:
        # Sampled here, by the worker's long-lived sampler; the child reads them back.
        suggest(trial, pinned)
        child = context.Process(
            target=_child_main, args=(payload, trial._trial_id, os.getpid()), daemon=True
        )
        child.start()
        try:
            child.join()
        except BaseException:
            child.kill()
            child.join()
            raise
        frozen = storage.get_trial(trial._trial_id)
        if frozen.state == TrialState.RUNNING:
            error = f"trial process died with exit code {child.exitcode}"
            trial.set_user_attr("error", error)
            frozen = study.tell(trial, state=TrialState.FAIL)
            return Outcome(TrialState.FAIL, error=error), frozen
        return _outcome(frozen), frozen

    return run


def _outcome(frozen: FrozenTrial) -> Outcome:
    attrs = frozen.user_attrs
    return Outcome(frozen.state, value=frozen.value, prune_reason=attrs.get("prune_reason"),
                   error=attrs.get("error"))


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(payload: dict[str, Any], trial_id: int, parent: int) -> None:
    _die_with_parent(parent)
    from hpo import hardware, models
    from hpo.report import ConsoleReporter
    from hpo.resources import load_resources
    from hpo.storage import open_storage
    from hpo.study import make_pruner, shared_batch_cache

    models.quiet_transformers()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = StudyConfig.model_validate(payload["config"])
    device = payload["device"]
    hardware.configure_backends(device)
    storage = open_storage(payload["url"])
    study = optuna.load_study(study_name=config.study.name, storage=storage,
                              pruner=make_pruner(config))
    resources = load_resources(config, PinnedSpace.from_json(payload["pinned"]), device)
    execute(study, optuna.trial.Trial(study, trial_id), resources, ConsoleReporter(),
            shared_batch_cache(study, storage))
