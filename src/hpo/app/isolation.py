"""Each trial in a fresh child process, for libraries that leak memory or state.

The parent claims the trial and keeps its heartbeat; the child opens its own storage
connection, runs the trial exactly as a worker would in-process and tells the study. A child
that dies without telling is told for by its parent, as `executor.outcome_of` judges a dead
child: killed by SIGKILL, the kernel OOM killer's signal, the trial is pruned as out of
memory and the micro-batch it was trying, which the child wrote into memory shared with its
parent, lowers the study's batch limit; any other death (a segfault, an abort) fails it.
A parent that dies takes its child with it (PR_SET_PDEATHSIG on Linux), so no orphan trains
on.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpo import hardware
from hpo.app.console import ConsoleDisplay
from hpo.app.preflight import Prepared
from hpo.config import StudyConfig
from hpo.outcome import ChildDied, Outcome, as_told
from hpo.search import artifacts, pausing
from hpo.search.liveness import WORKER_PID, heartbeat
from hpo.search.resilience import OUTAGE_SECONDS
from hpo.search.storage import open_storage
from hpo.search.study import make_pruner
from hpo.space import Params, PinnedSpace, suggest
from hpo.training import memory, models
from hpo.trial.context import TrialContext, claimed
from hpo.trial.executor import execute, outcome_of, tell
from hpo.trial.resources import load_resources

_PR_SET_PDEATHSIG = 1


def in_child(site: Prepared, pinned: PinnedSpace
             ) -> Callable[[TrialContext], tuple[Outcome, FrozenTrial]]:
    """A trial runner for worker.run_worker that runs every trial of the worker's `site` (its
    study file, device, storage) in a new process."""
    config, device, url, storage = site.config, site.device, site.url, site.storage
    # spawn, not fork: the parent holds threads (heartbeat, torch's pools) and open
    # connections that a forked child must not inherit.
    context = multiprocessing.get_context("spawn")
    checkpoints = artifacts.checkpoint_store(config, url)
    payload = {"config": config.model_dump(mode="json"), "pinned": pinned.to_json(),
               "device": device, "url": url, "heartbeat_interval": storage.heartbeat_interval,
               "grace_period": storage.grace_period}

    def run(claim: TrialContext) -> tuple[Outcome, FrozenTrial]:
        trial = claim.trial
        # Sampled here, once, by the worker's long-lived sampler; the child is given them.
        params = suggest(trial, pinned)
        attempt = _Attempt(context)
        receiver, sender = context.Pipe(duplex=False)
        child = context.Process(
            target=_child_main,
            args=(payload, trial._trial_id, params, os.getpid(), attempt, sender),
            daemon=True,
        )
        started = time.perf_counter()
        child.start()
        sender.close()
        try:
            # The child sends its outcome and the trial it told (its retry copy, if it was
            # reaped while it ran) just before it exits.
            told = receiver.recv() if receiver.poll(None) else None
        except EOFError:
            told = None  # it died without a word
        except BaseException:
            child.kill()
            raise
        finally:
            child.join()
            receiver.close()
        if told is not None:
            outcome, trial_id = told
            return outcome, storage.get_trial(trial_id)
        frozen = storage.get_trial(trial._trial_id)
        if frozen.state != TrialState.RUNNING:
            return as_told(frozen), frozen
        tried = attempt.read()
        outcome = outcome_of(trial.number, ChildDied(child.exitcode, tried))
        told_here = tell(claim, outcome, tried=tried, started=started)
        # The trial's own process died: its end is the trial's, a checkpoint it resumed
        # from or paused with is needed no more.
        pausing.remove(checkpoints, pausing.checkpoint_of(told_here[1]))
        return told_here

    return run


class _Attempt:
    """The batch cache key and micro-batch a child is trying, in memory it shares with its
    parent: written before each step, so it is there when the step kills the child."""

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self._key = context.Array("c", 1024, lock=False)
        self._batch = context.Value("i", 0, lock=False)

    def __call__(self, key: str, batch: int) -> None:
        self._batch.value = 0  # a key without its batch is never read half-written
        self._key.value = key.encode()[:1023]
        self._batch.value = batch

    def read(self) -> tuple[str, int] | None:
        batch = self._batch.value
        return (self._key.value.decode(errors="ignore"), batch) if batch else None


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child_main(payload: dict[str, Any], trial_id: int, params: Params, parent: int,
                attempt: _Attempt, sender: multiprocessing.connection.Connection) -> None:
    _die_with_parent(parent)
    os.environ[WORKER_PID] = str(parent)  # its trials are the worker's (records.worker_name)
    models.quiet_transformers()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    config = StudyConfig.model_validate(payload["config"])
    device = payload["device"]
    hardware.configure_backends(device)
    # The child beats too: if its trial is reaped and carried over to its retry copy, only
    # the child knows the copy.
    storage = open_storage(payload["url"], heartbeat_interval=payload["heartbeat_interval"],
                           grace_period=payload["grace_period"], start_seconds=OUTAGE_SECONDS)
    study = optuna.load_study(study_name=config.study.name, storage=storage,
                              pruner=make_pruner(config))
    keeper = None if config.data.cv_folds else artifacts.keeper_for(config, payload["url"])
    resources = load_resources(config, PinnedSpace.from_json(payload["pinned"]), device,
                               keeper=keeper,
                               checkpoints=artifacts.checkpoint_store(config, payload["url"]))
    # The trial's context again, in this process: its own connection, the parent's watch.
    context = claimed(study, storage, optuna.trial.Trial(study, trial_id), ConsoleDisplay(),
                      attempt)
    with memory.long_lived_frozen(), heartbeat(storage, context.live):
        outcome, told = execute(context, resources, params)
    sender.send((outcome, told._trial_id))
