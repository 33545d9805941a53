"""A study in its storage: created or joined with its sampler, pruner and pinned search space
(the batch-size limits its workers share are `hpo.trial.batch_limit`'s)."""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import cast

import optuna
from optuna.trial import TrialState

from hpo.config import ADAPTER_RATE, SearchSpace, StudyConfig
from hpo.data.splits import Splits, fingerprint
from hpo.errors import ConfigError, DataError
from hpo.hardware import Device
from hpo.search import budget, pruning, release
from hpo.search.paused_view import PausedAsPruned
from hpo.search.resilience import ResilientRDBStorage
from hpo.search.startup import PausedCountStartup
from hpo.search.storage import retry_callback
from hpo.space import PIN_ATTR, PinnedSpace, StepCosts, by_cost, pin


def make_sampler(config: StudyConfig) -> optuna.samplers.BaseSampler:
    """The study's sampler. With `sampler.seed`, each trial draws from a sampler made for it
    from the seed and the trial's number (`PerTrialSeeded`): a sampler seeded once per
    process would draw the same values again in every worker and after every restart."""
    seed = config.study.sampler.seed
    if seed is None:
        return _sampler(config, None)
    return PerTrialSeeded(functools.partial(_seeded_sampler, config, seed))


def trial_seed(seed: int, trial_number: int) -> int:
    """The seed of trial `trial_number`'s sampler in a study seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}:{trial_number}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _seeded_sampler(config: StudyConfig, seed: int, trial_number: int
                    ) -> optuna.samplers.BaseSampler:
    return _sampler(config, trial_seed(seed, trial_number))


def _sampler(config: StudyConfig, seed: int | None) -> optuna.samplers.BaseSampler:
    sampler = config.study.sampler
    if sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    counted = sampler.startup_counts_paused and sampler.n_startup_trials > 0
    with warnings.catch_warnings():
        # multivariate, group and constant_liar are "experimental" in Optuna's words only.
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        tpe: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=0 if counted else sampler.n_startup_trials,
            multivariate=sampler.multivariate, group=sampler.group,
            constant_liar=sampler.constant_liar,
        )
    if sampler.paused_as_pruned_from is not None:
        from_step = math.ceil(sampler.paused_as_pruned_from * config.max_steps())
        tpe = PausedAsPruned(tpe, from_step)
    if counted:
        return PausedCountStartup(tpe, optuna.samplers.RandomSampler(seed=seed),
                                  sampler.n_startup_trials, sampler.startup_min_complete)
    return tpe


class PerTrialSeeded(optuna.samplers.BaseSampler):
    """A sampler whose draws for a trial depend only on the trial's number and the study's
    history, not on which worker asked or how long it has run: every call is answered by
    `make(trial.number)`, made once per trial. Optuna calls a sampler with the trial it is
    for (`before_trial` at the claim, the samples at the first suggestion), so this needs
    no hook in the worker's loop; the inner samplers keep no state between trials that a
    fresh one lacks (TPE reads the history from the storage)."""

    def __init__(self, make: Callable[[int], optuna.samplers.BaseSampler]) -> None:
        self._make = make
        self._number: int | None = None
        self._inner: optuna.samplers.BaseSampler | None = None

    def sampler_for(self, trial_number: int) -> optuna.samplers.BaseSampler:
        """A new sampler as trial `trial_number` draws from."""
        return self._make(trial_number)

    def _for(self, trial: optuna.trial.FrozenTrial) -> optuna.samplers.BaseSampler:
        if self._inner is None or self._number != trial.number:
            self._number, self._inner = trial.number, self._make(trial.number)
        return self._inner

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self._for(trial).before_trial(study, trial)

    def infer_relative_search_space(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
    ) -> dict[str, optuna.distributions.BaseDistribution]:
        return self._for(trial).infer_relative_search_space(study, trial)

    def sample_relative(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
        search_space: dict[str, optuna.distributions.BaseDistribution],
    ) -> dict[str, object]:
        return self._for(trial).sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str,
        param_distribution: optuna.distributions.BaseDistribution,
    ) -> object:
        return self._for(trial).sample_independent(study, trial, param_name,
                                                   param_distribution)

    def after_trial(
        self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
        state: TrialState, values: Sequence[float] | None,
    ) -> None:
        # A trial told while another is being sampled (many trials in one process) gets a
        # sampler of its own, leaving the one the sampled trial draws from as it is.
        inner = self._inner if trial.number == self._number else self._make(trial.number)
        if inner is not None:
            inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        # Optuna reseeds a study's sampler for `optimize(n_jobs>1)`; a trial's draws here
        # are fixed by its number, which is what seeding the study asked for.
        return None


def make_pruner(config: StudyConfig) -> optuna.pruners.BasePruner:
    pruner = config.study.pruner
    first = pruner.first_rung(config.max_steps())
    if pruner.name == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=pruner.n_startup_trials, n_warmup_steps=pruner.n_warmup_steps
        )
    if pruner.name == "successive_halving" and pruner.on_evidence():
        return pruning.EvidenceHalvingPruner(
            min_resource=first, reduction_factor=pruner.reduction_factor,
            max_resource=config.max_steps(), min_trials=pruner.min_rung_trials,
            min_agreement=pruner.min_rung_agreement,
        )
    if pruner.name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=first, reduction_factor=pruner.reduction_factor
        )
    if pruner.name == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=first, max_resource=config.max_steps(),
            reduction_factor=pruner.reduction_factor,
        )
    return optuna.pruners.NopPruner()



def join(
    config: StudyConfig, storage: ResilientRDBStorage, device: Device | None,
    splits: Splits | None = None,
) -> tuple[optuna.Study, PinnedSpace]:
    """Create the study or load it, and the space this worker may search in it (`device`
    None: a host that runs no trial, which leaves `auto` to the first worker that does),
    with the data split pinned (`pin_splits`) when `splits` is given. Under the study lock,
    so that of many workers starting at once exactly one pins them."""
    assert config.study.name is not None  # named when the study file was loaded
    with budget.study_lock(storage.engine, config.study.name):
        study = optuna.create_study(
            storage=storage,
            study_name=config.study.name,
            direction="maximize",
            sampler=make_sampler(config),
            pruner=make_pruner(config),
            load_if_exists=True,
        )
        release.record(study)
        pin_liveness(study, storage, config)
        if device is not None:  # a worker: it counts the budget
            pin_budget(study, config)
        if splits is not None:
            pin_splits(study, splits)
        pinned = pin(study, config.search_space, device)
        seed_queue(study, storage, config)
        return study, pinned


QUEUED = "enqueued"


def seed_queue(study: optuna.Study, storage: ResilientRDBStorage, config: StudyConfig) -> int:
    """Enqueue the study file's `enqueue` parameter sets, then the best trials of
    `warm_start_from`, once in the study's life (its first join, under the study lock):
    every worker joins, but the fleet runs each set once. Returns how many were enqueued."""
    if study.user_attrs.get(QUEUED) is not None:
        return 0
    queued = [dict(params) for params in config.study.enqueue]
    if config.study.warm_start_from:
        queued += warm_start(storage, config)
    for params in queued:
        study.enqueue_trial(params, skip_if_exists=True)
    study.set_user_attr(QUEUED, len(queued))
    return len(queued)


def warm_start(storage: ResilientRDBStorage, config: StudyConfig) -> list[dict]:
    """The parameters of the best COMPLETE trials of `warm_start_from` that are points of
    this study's space (a precision is left to sample where this space has `auto`)."""
    name = config.study.warm_start_from
    try:
        other = optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise ConfigError(f"study.warm_start_from {name}: no such study in this storage "
                          f"(hpo studies lists them)") from None
    space = config.search_space
    best = sorted((t for t in other.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))),
                  key=lambda t: (-cast(float, t.value), t.number))  # COMPLETE: valued
    chosen = []
    for trial in best:
        params = _rate_renamed(dict(trial.params), space)
        if space.by_device:
            params.pop("fp_precision", None)
        if space.rejects(params) is None and params not in chosen:
            chosen.append(params)
        if len(chosen) == config.study.warm_start_trials:
            break
    return chosen


def _rate_renamed(params: dict, space: SearchSpace) -> dict:
    """An adapter trial's rate under the name this space samples it by: the other study may
    have given adapters a range of their own (`adapter_learning_rate`) or not."""
    if params.get("peft", "none") == "none":
        return params
    name, other = ((ADAPTER_RATE, "learning_rate") if space.adapter_learning_rate is not None
                   else ("learning_rate", ADAPTER_RATE))
    if other in params:
        params[name] = params.pop(other)
    return params


SPLITS = "data_splits"


def pin_splits(study: optuna.Study, splits: Splits) -> None:
    """The data split fixed in the study by its first worker: a worker (or `hpo final`) whose
    data or split settings give other posts in a split refuses, since a trial trained on
    another worker's validation or test posts would make the search's scores, and the
    final test score, dishonest."""
    if not splits_recorded(study, splits):
        study.set_user_attr(SPLITS, fingerprint(splits))


def splits_recorded(study: optuna.Study, splits: Splits) -> bool:
    """True if the study recorded these splits, False if it recorded none; DataError if it
    recorded others."""
    stored, mine = study.user_attrs.get(SPLITS), fingerprint(splits)
    if stored is None:
        return False
    for name in ("train", "validation", "test"):
        if stored[name] != mine[name]:
            raise DataError(
                f"study '{study.study_name}' searched on another data split ({name}: "
                f"{stored[name]['posts']} posts, digest {stored[name]['sha256']}; here "
                f"{mine[name]['posts']} posts, digest {mine[name]['sha256']}): use the same "
                f"data.dir, split_seed and fractions as the study's workers")
    return True


BUDGET = "budget"


def pin_budget(study: optuna.Study, config: StudyConfig) -> None:
    """What `--n-trials` counts (`study.budget`), fixed in the study by its first worker, so
    that every worker counts one budget. A study with trials but no record was made by a
    release before hpo counted full trainings by default: unless the file sets
    `study.budget`, it counted trials, and goes on so. A worker whose file counts otherwise
    is refused in one line (a budget counted two ways is kept by neither)."""
    section = config.study
    pinned = study.user_attrs.get(BUDGET)
    if pinned is None:
        older = bool(study.get_trials(deepcopy=False))
        pinned = ("trials" if older and "budget" not in section.model_fields_set
                  else section.budget)
        study.set_user_attr(BUDGET, pinned)
    if pinned != section.budget:
        raise ConfigError(
            f"study.budget: study '{study.study_name}' counts {pinned} (fixed when its first "
            f"worker joined), this file {section.budget}: set study.budget: {pinned}")
    if pinned == "trainings":
        pin_training_steps(study, config)


TRAINING_STEPS = "training_steps"


def pin_training_steps(study: optuna.Study, config: StudyConfig) -> None:
    """Under a budget of trainings, the steps of one full training (`max_steps`), fixed by
    the first worker: N trainings are N x that many steps, which a worker whose trials train
    more or fewer would count otherwise (it is refused in one line)."""
    pinned = study.user_attrs.get(TRAINING_STEPS)
    if pinned is None:
        pinned = config.max_steps()
        study.set_user_attr(TRAINING_STEPS, pinned)
    if pinned != config.max_steps():
        what = ("data.cv_folds" if config.data.cv_folds is not None
                else "search_space.epochs" if config.search_space.epochs is not None
                else "training.epochs")
        raise ConfigError(
            f"{what}: study '{study.study_name}' counts full trainings of {pinned} steps "
            f"(fixed when its first worker joined), this file's of {config.max_steps()}: "
            "workers sharing a budget of trainings must train alike (or set study.budget: "
            "trials in a new study)")


LIVENESS = "liveness"


def pin_liveness(study: optuna.Study, storage: ResilientRDBStorage,
                 config: StudyConfig) -> dict[str, int]:
    """The heartbeat interval, grace period and retry count fixed in the study when it is
    created, and used by this worker whatever its own settings: a worker with a shorter
    grace period than another's heartbeat interval would reap that worker's live trials."""
    section = config.study
    pinned = study.user_attrs.get(LIVENESS)
    if pinned is None:
        pinned = {"heartbeat_interval": section.heartbeat_interval,
                  "grace_period": section.grace_period, "max_retry": section.max_retry}
        study.set_user_attr(LIVENESS, pinned)
    storage.heartbeat_interval = pinned["heartbeat_interval"]
    storage.grace_period = pinned["grace_period"]
    retry = retry_callback(pinned["max_retry"])
    storage.heartbeat_stale_trial_callback = storage.failed_trial_callback = retry
    return pinned


def decide_precisions(study: optuna.Study, storage: ResilientRDBStorage, pinned: PinnedSpace,
                      costs: StepCosts | None, tolerance: float) -> PinnedSpace:
    """For `fp_precision: auto`, the precisions the study searches, decided once for the
    whole fleet, before any trial samples one (Optuna's categorical choices cannot change
    later): those `space.by_cost` keeps from the check's measured step `costs`, or, with no
    measurement, every native one. Under the study lock: the first worker to decide decides
    for all; the others read its decision."""
    if pinned.declared.get("fp_precision") != "auto" or pinned.decided is not None:
        return pinned
    with budget.study_lock(storage.engine, study.study_name):
        stored = PinnedSpace.from_json(study.user_attrs[PIN_ATTR])
        if stored.decided is not None or stored.fp_precision is None:
            return stored
        sampled = any("fp_precision" in t.params for t in study.get_trials(deepcopy=False))
        if sampled or costs is None or not costs.seconds:
            why = ("trials already sampled a precision" if sampled
                   else "no step was measured (the check was skipped)")
            decided = PinnedSpace(stored.declared, stored.fp_precision,
                                  {"by": "native", "why": why})
        else:
            choice = by_cost(costs.seconds, stored.fp_precision, tolerance, costs.spreads,
                             costs.crowded)
            decided = PinnedSpace(stored.declared, choice.kept,
                                  {"by": "cost", "tolerance": tolerance,
                                   "dropped": choice.dropped,
                                   **({"unsettled": choice.unsettled} if choice.unsettled
                                      else {})})
        study.set_user_attr(PIN_ATTR, decided.to_json())
        return decided


def finished_count(study: optuna.Study) -> int:
    return budget.count(study).finished


