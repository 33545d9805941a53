"""Search policies replayed in simulated time on tables of learning curves, measured by the
yardstick of benchmarks/yardstick.py (anytime normalized regret over paired worlds, with
bootstrap intervals): many repetitions of a 200-trial, 8-worker search in minutes, where a
real one takes GPU-days.

    python benchmarks/replay.py --mode compute --budget 20 --workers 1 --repetitions 300 \\
        --jobs 2 --output benchmarks/results/replay_compute_20x1.json         # the demo table
    python benchmarks/replay.py --table benchmarks/tables/lcbench/*.jsonl --mode compute \\
        --budget 20 --workers 1 --repetitions 102 --jobs 2 --output ...       # any tables
    python benchmarks/replay.py --render OUT.json ... --plot regret.png       # table and plot
    python benchmarks/replay.py ... --first-seed 17 --repetitions 17 --horizons-from H.json \
        --output chunk1.json; python benchmarks/replay.py --merge chunk*.json --output ...
    python benchmarks/replay.py --reality                                     # against real runs

Two modes, never mixed. `--mode compute`: every policy runs as many trials as it can until a
common horizon (`--horizon SECONDS`; by default the median wall, over the table's worlds, at
which the novice finishes `--budget` trials): equal compute. `--mode trials`: `--budget`
trials each, as users run `--n-trials`; the figures' horizon is the last of them to finish.

The simulation (`simulate`): W workers, each asking its policy for a trial when it is free;
a trial's reports come at the times its curve gives, and at each the policy hears the score
and may stop the trial (a pruner, ASHA, BOHB). Events are taken in time order, so a policy
asking at time t sees exactly the reports made before t, as it would on a real fleet. Every
policy is its own library's code: Optuna through ask/tell on an in-memory storage, Ray Tune's
`OptunaSearch` and `ASHAScheduler` as Ray's controller calls them, Syne Tune's schedulers as
its simulator backend calls them (benchmarks/peer_syne.py).

The demo table (benchmarks/learning_curves.json, the default): a configuration's curve is
interpolated linearly in the logarithm of the learning rate between the two nearest grid
rates, at the nearest weight decay of the grid, for its model, precision and batch. World k
draws, per (model, precision, batch, learning rate), which recorded training seed it reads,
the same at every weight decay (whose effect on the best score is below the seeds' noise), so
the paired policies search the same world and the worlds vary as training noise does. Only
the seeds recorded at every grid point are drawn. Costs: each epoch its recorded seconds; a
trial's set-up its recorded seconds, plus the tokenization where its worker has not tokenized
that model yet, plus hpo's batch search where the study has none cached for the model and
precision; the peers' trials cost the table's seconds times their measured slowdown against
hpo on the table's CPU kind, and every worker starts after its tool's measured start-up (both
from benchmarks/results/search_quality.json); `--even-costs` prices every tool as hpo. A table
in the JSON Lines format (`--table`, benchmarks/tables.py) has no costs but its reports' seconds:
every policy pays the same. Not simulated: the samplers' own seconds.
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import dataclasses
import functools
import heapq
import itertools
import json
import math
import os
import re
import statistics
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import optuna
import peer_syne
import replay_lcbench
import stored
import tables
import tpe_speed
import yaml
import yardstick
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState
from search_quality import MEDIAN_STARTUP, MEDIAN_WARMUP, cpu_model, variant
from tables import Costs, Curve, Point

from hpo import config as config_module
from hpo import study_files
from hpo.search import artifacts
from hpo.search.pausing import PAUSED_AT
from hpo.search.pruning import rung_key
from hpo.search.study import PerTrialSeeded, make_pruner, make_sampler, trial_seed
from hpo.space import PinnedSpace, by_cost, declare, suggest

HERE = Path(__file__).resolve().parent
TABLE = HERE / "learning_curves.json"
REAL = HERE / "results" / "search_quality.json"
REAL_PRUNER = ("study.pruner.name=median", "study.pruner.n_startup_trials=4",
               "study.pruner.n_warmup_steps=1")
# The expert run again with other seeds: the null check's copy.
COPY_SEED = 1_000_003
optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


# ---------------------------------------------------------------------------- the tables


class Table(Protocol):
    """What `simulate` reads of a table: a configuration's curve in a world, and the
    one-off costs a worker and a study pay."""
    name: str
    costs: Costs
    max_physical: int

    def curve(self, config: Any, world: int) -> Curve: ...

    def random_median(self, world: int) -> float: ...


class Curves:
    """The demo's table, looked up by configuration for one repetition's world."""

    name = "demo"

    def __init__(self, table: dict, max_physical: int = 32) -> None:
        self.table, self.epochs = table, table["epochs"]
        self.train_size = table["train_size"]
        columns = table["columns"]
        self.rows = [dict(zip(columns, row, strict=True)) for row in table["rows"]]
        self.max_physical = max_physical
        self.by_point: dict[tuple, dict[int, dict]] = {}
        for row in self.rows:
            point = (row["model"], row["precision"], row["batch"], row["weight_decay"],
                     row["learning_rate"])
            self.by_point.setdefault(point, {})[row["seed"]] = row
        # Seeds recorded at every grid point (a partly recorded seed would be drawn only
        # where it exists, so more often there than elsewhere).
        self.seeds = sorted(set.intersection(*(set(s) for s in self.by_point.values())))
        self.rates = sorted({r["learning_rate"] for r in self.rows})
        self.decays = sorted({r["weight_decay"] for r in self.rows})
        self.models = sorted({r["model"] for r in self.rows})
        self.precisions = sorted({r["precision"] for r in self.rows})
        self.costs = self._costs()

    def _costs(self) -> Costs:
        first: dict[str, list[float]] = {}
        for model in self.models:
            for seed in {r["seed"] for r in self.rows}:
                times = [r["tokenization_seconds"] for r in self.rows
                         if r["model"] == model and r["seed"] == seed]
                if times:
                    first.setdefault(model, []).append(max(times))
        searched: dict[tuple[str, str, int], list[float]] = {}
        for row in self.rows:
            if row["batch_probes"]:
                bound = min(row["batch"], self.max_physical)
                searched.setdefault((row["model"], row["precision"], bound), []).append(
                    row["batch_search_seconds"])
        return Costs({m: statistics.median(v) for m, v in first.items()},
                     {k: statistics.median(v) for k, v in searched.items()})

    def seconds_per_epoch(self, model: str, precision: str) -> float:
        return statistics.median(sum(r["epoch_seconds"]) / len(r["epoch_seconds"])
                                 for r in self.rows
                                 if r["model"] == model and r["precision"] == precision)

    def _row(self, point: tuple, world: int) -> dict:
        rows = self.by_point.get(point)
        if not rows:
            raise KeyError(f"the table has no trial of {point}")
        model, precision, batch, _decay, rate = point
        seed = self.seeds[tables.draw(f"{world}:{(model, precision, batch, rate)}",
                                      len(self.seeds))]
        return rows[seed]

    def curve(self, config: Config, world: int) -> Curve:
        return self.lookup(config.model, config.precision, config.batch,
                           config.learning_rate, config.weight_decay, world)

    def lookup(self, model: str, precision: str, batch: int, learning_rate: float,
               weight_decay: float, world: int) -> Curve:
        decay = min(self.decays, key=lambda d: abs(d - weight_decay))
        rate = min(max(learning_rate, self.rates[0]), self.rates[-1])
        upper = min(bisect.bisect_left(self.rates, rate), len(self.rates) - 1)
        lower = max(upper - 1, 0)
        low, high = self.rates[lower], self.rates[upper]
        share = 0.0 if high == low else math.log(rate / low) / math.log(high / low)
        a = self._row((model, precision, batch, decay, low), world)
        b = self._row((model, precision, batch, decay, high), world)

        def mix(x: Iterable[float], y: Iterable[float]) -> tuple[float, ...]:
            return tuple((1 - share) * u + share * v for u, v in zip(x, y, strict=True))

        def base(row: dict) -> float:
            return max(row["setup_seconds"] - row["tokenization_seconds"]
                       - row["batch_search_seconds"], 0.0)

        return Curve(mix(a["f1"], b["f1"]), mix(a["epoch_seconds"], b["epoch_seconds"]),
                     (1 - share) * base(a) + share * base(b))

    def random_median(self, world: int) -> float:
        """The median last-epoch score over the grid in this world: the grid's rates are
        log-spaced and its batches and decays even, as a random configuration draws them."""
        return statistics.median(self._row(point, world)["f1"][-1] for point in self.by_point)


# ---------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Config:
    model: str
    precision: str
    batch: int
    learning_rate: float
    weight_decay: float


# What a report may decide besides going on (False) or stopping the trial (True): pausing it
# at a rung, resumable from its checkpoint when the policy promotes it (promotion ASHA).
PAUSE = "pause"


class Running(Protocol):
    """A trial a policy started: it hears each report and may stop or pause the trial."""
    config: Any

    def report(self, epoch: int, score: float) -> bool | str: ...  # True, False or PAUSE

    def finish(self, scores: list[float], stopped: bool) -> None: ...


class Policy(Protocol):
    name: str
    startup: float  # seconds before a worker's first trial
    gap: float  # seconds between a trial's end and the worker's next trial

    def ask(self) -> Running: ...  # a new trial, or a paused one it promotes

    def slowdown(self, model: str) -> float: ...  # its trial seconds over hpo's


def best(scores: list[float]) -> float:
    return max(scores)


def last(scores: list[float]) -> float:
    return scores[-1]


def by_epoch(epoch: int, _config: Any) -> int:
    return epoch


@dataclass
class OptunaRunning:
    study: optuna.Study
    trial: optuna.Trial
    config: Any
    report_value: Callable[[list[float]], float]
    step_of: Callable[[int, Any], int]
    tell_value: Callable[[list[float]], float]
    scores: list[float] = field(default_factory=list)

    def report(self, epoch: int, score: float) -> bool:
        self.scores.append(score)
        self.trial.report(self.report_value(self.scores), self.step_of(epoch, self.config))
        return self.trial.should_prune()

    def finish(self, scores: list[float], stopped: bool) -> None:
        if stopped:
            self.study.tell(self.trial, state=TrialState.PRUNED)
        else:
            self.study.tell(self.trial, self.tell_value(scores))


@dataclass
class OptunaPolicy:
    """A policy that is an Optuna study: hpo's own, or a user's glue around the Trainer.
    `report_value` is what each report tells the pruner, `tell_value` the trial's value."""
    name: str
    study: optuna.Study
    sample: Callable[[optuna.Trial], Any]
    startup: float = 0.0
    slowdowns: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    report_value: Callable[[list[float]], float] = best
    tell_value: Callable[[list[float]], float] = best
    step_of: Callable[[int, Any], int] = by_epoch
    # Trials mode under hpo's `study.budget: trainings`: the epochs of one full training, a
    # budget of N counting N of them (None: N trials, as every peer counts).
    training_steps: int | None = None

    def ask(self) -> Running:
        trial = self.study.ask()
        return OptunaRunning(self.study, trial, self.sample(trial), self.report_value,
                             self.step_of, self.tell_value)

    def slowdown(self, model: str) -> float:
        return self.slowdowns.get(model, 1.0)


def new_study(seed: int, sampler: optuna.samplers.BaseSampler,
              pruner: optuna.pruners.BasePruner) -> optuna.Study:
    """An in-memory study named by the repetition's seed: Optuna's HyperbandPruner puts a
    trial in a bracket by a hash of the study's name, which a nameless study draws at random,
    so that a replay would not repeat."""
    return optuna.create_study(storage=optuna.storages.InMemoryStorage(),
                               study_name=f"replay-{seed}", direction="maximize",
                               sampler=sampler, pruner=pruner)


def with_overrides(study: config_module.StudyConfig, *sets: str
                   ) -> config_module.StudyConfig:
    """The study with `--set`-style overrides, validated as hpo validates them."""
    raw = study.model_dump(mode="json")
    for item in sets:
        study_files.apply_override(raw, item)
    return config_module.StudyConfig.model_validate(raw)


def pinned_space(config: config_module.StudyConfig, curves: Curves) -> PinnedSpace:
    """The precisions hpo would search on the table's machine: what the table recorded
    (the native ones), narrowed by `auto`'s rule (`space.by_cost`) on the table's seconds."""
    pinned = declare(config.search_space, None)
    declared = config.search_space.fp_precision
    native = tuple(curves.precisions)
    if declared == "auto":
        seconds = {m: {p: curves.seconds_per_epoch(m, p) for p in native}
                   for m in curves.models}
        kept = by_cost(seconds, native, config.study.precision_tolerance).kept
    elif declared == "native":
        kept = native
    else:
        kept = tuple(declared)
    return replace(pinned, fp_precision=kept)


def plain_space(space: config_module.SearchSpace) -> dict[str, BaseDistribution]:
    """A user's own objective's space: the study file's ranges, as Optuna distributions."""
    decay = space.extras()["weight_decay"]
    rate = space.learning_rate
    return {"model_name": CategoricalDistribution(list(space.model_name)),
            "batch": CategoricalDistribution(list(space.target_effective_batch_size)),
            "learning_rate": FloatDistribution(rate.low, rate.high, log=rate.log),
            "weight_decay": FloatDistribution(decay.low, decay.high)}


def demo_config(precision: str) -> Callable[[dict[str, Any]], Config]:
    def config_of(params: dict[str, Any]) -> Config:
        return Config(params["model_name"], precision, params["batch"],
                      params["learning_rate"], params["weight_decay"])
    return config_of


def table_config(params: dict[str, Any]) -> Point:
    return Point(tuple(params.items()))


def sampling(space: dict[str, BaseDistribution], config_of: Callable[[dict[str, Any]], Any]
             ) -> Callable[[optuna.Trial], Any]:
    def sample(trial: optuna.Trial) -> Any:
        return config_of(tables.suggest(trial, space).as_dict())
    return sample


@dataclass
class RayRunning:
    """A trial under Ray Tune's `OptunaSearch` and `ASHAScheduler`, called in the order
    Ray's controller calls them for each result and at the trial's end."""
    policy: RayPolicy
    trial_id: str
    config: Any
    last: dict[str, Any] = field(default_factory=dict)

    @property
    def handle(self) -> Any:
        return self.policy.handles[self.trial_id]

    def report(self, epoch: int, score: float) -> bool:
        from ray.tune.schedulers import TrialScheduler

        self.last = {"objective": score, "epoch": epoch, "training_iteration": epoch}
        self.policy.searcher.on_trial_result(self.trial_id, self.last)
        action = self.policy.scheduler.on_trial_result(None, self.handle, self.last)
        return action == TrialScheduler.STOP

    def finish(self, scores: list[float], stopped: bool) -> None:
        self.policy.searcher.on_trial_complete(self.trial_id, result=self.last)
        self.policy.scheduler.on_trial_complete(None, self.handle, self.last)


@dataclass(frozen=True)
class _RayTrial:
    trial_id: str


@dataclass
class RayPolicy:
    """Ray Tune: `ASHAScheduler` (grace 1 epoch, at most the table's epochs, the reduction
    factor given: Ray's default is 4) with Optuna's TPE as `OptunaSearch`, as
    benchmarks/peer_ray.py sets them up."""
    name: str
    space: dict[str, BaseDistribution]
    config_of: Callable[[dict[str, Any]], Any]
    seed: int
    epochs: int
    n_startup_trials: int
    reduction_factor: int = 4
    startup: float = 0.0
    slowdowns: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    sampler: optuna.samplers.BaseSampler | None = None  # None: TPESampler(seed=seed)
    handles: dict[str, _RayTrial] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ray.tune.schedulers import ASHAScheduler
        from ray.tune.search.optuna import OptunaSearch

        space = self.space
        self.searcher = OptunaSearch(
            space=lambda trial: tables.suggest(trial, space) and None, metric="objective",
            mode="max", sampler=self.sampler or optuna.samplers.TPESampler(
                seed=self.seed, n_startup_trials=self.n_startup_trials))
        self.scheduler = ASHAScheduler(metric="objective", mode="max", time_attr="epoch",
                                       max_t=self.epochs, grace_period=1,
                                       reduction_factor=self.reduction_factor)

    def ask(self) -> Running:
        trial_id = str(len(self.handles))
        params = self.searcher.suggest(trial_id)
        self.handles[trial_id] = _RayTrial(trial_id)
        self.scheduler.on_trial_add(None, self.handles[trial_id])
        return RayRunning(self, trial_id, self.config_of(params))

    def slowdown(self, model: str) -> float:
        return self.slowdowns.get(model, 1.0)


@dataclass(eq=False)
class SyneRunning:
    policy: SynePolicy
    number: int
    config: Any

    def report(self, epoch: int, score: float) -> bool | str:
        decision = self.policy.scheduler.result(self.number, epoch, score)
        return PAUSE if decision == "pause" else decision == "stop"

    def finish(self, scores: list[float], stopped: bool) -> None:
        if not stopped:
            self.policy.scheduler.complete(self.number)


@dataclass
class SynePolicy:
    """A Syne Tune scheduler at its defaults (benchmarks/peer_syne.py: BOHB, and ASHA and
    BOHB in promotion form, which pause trials at rungs and resume those they promote)."""
    name: str
    space: dict[str, BaseDistribution]
    config_of: Callable[[dict[str, Any]], Any]
    seed: int
    epochs: int
    method: str = "bohb"
    startup: float = 0.0
    slowdowns: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    asked: int = 0
    runs: dict[int, SyneRunning] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scheduler = peer_syne.Scheduler(
            {n: optuna.distributions.distribution_to_json(d) for n, d in self.space.items()},
            self.epochs, self.seed, method=self.method)

    def ask(self) -> Running:
        # As Syne Tune's tuner: the next trial's id is offered, and used only if the
        # scheduler starts a new trial rather than resuming a paused one.
        config, resumed = self.scheduler.suggest(self.asked + 1)
        if resumed is not None:
            return self.runs[resumed]
        self.asked += 1
        self.runs[self.asked] = SyneRunning(self, self.asked, self.config_of(config))
        return self.runs[self.asked]

    def slowdown(self, model: str) -> float:
        return self.slowdowns.get(model, 1.0)

    def close(self) -> None:
        self.scheduler.close()


@dataclass(eq=False)  # compared by identity: the policy's rungs hold runs, not values
class PromotingRun:
    policy: PromotionPolicy
    trial: optuna.Trial
    config: Any
    scores: list[float] = field(default_factory=list)
    rung: int = 0  # the next rung it pauses at
    lost: bool = False  # paused, its checkpoint given up (`max_checkpoints`)
    again: int = 0  # trained again from its start: the epochs it reported before

    def report(self, epoch: int, score: float) -> bool | str:
        if epoch <= self.again:  # as hpo: reported, and ranked, the first time
            return False
        self.scores.append(score)
        self.trial.report(max(self.scores), epoch)
        return self.policy.reached(self, epoch)

    def finish(self, scores: list[float], stopped: bool) -> None:
        self.policy.base.study.tell(self.trial, max(scores))


@dataclass
class PromotionPolicy:
    """hpo's sampler and rungs in asynchronous successive halving's promotion form (Li et
    al. 2020, as Syne Tune's `type="promotion"`): a trial pauses at each rung (hpo's
    `min_resource` x `reduction_factor`^k epochs, below the last) and frees its worker; a
    free worker resumes the best paused trial of the highest rung in whose top
    1/reduction_factor it ranks (no rung promotes before it holds reduction_factor trials),
    else starts a new one. Paused trials stay RUNNING to the sampler (its constant liar
    counts them as poor); a finished one is told its best epoch. A replay-only policy:
    hpo cannot pause a trial yet (issue 63)."""
    name: str
    base: OptunaPolicy
    steps: tuple[int, ...]
    reduction_factor: int
    # Pause only what stopping successive halving would stop: a trial in its rung's top
    # 1/reduction_factor when it arrives (the best of fewer) goes straight on.
    eager: bool = False
    # Tell a paused trial PRUNED, and resume it as a new trial of the same parameters (Optuna
    # has no PRUNED -> RUNNING): the sampler then sees a pause as it sees a stop.
    tell_paused: bool = False
    # Trials mode: a paused trial gives its slot of the trial budget back (a resume takes
    # one again), so N trials are trained to their end or stopped, besides those paused.
    frees_slot: bool = False
    # hpo's `study.pruner.max_checkpoints`: past it, the paused run least likely to be
    # promoted gives its checkpoint up (`hpo.search.pausing.over_limit`) and, promoted,
    # trains again from its start (the simulation pays those epochs again).
    max_checkpoints: int | None = None
    values: dict[int, list[tuple[float, PromotingRun]]] = field(default_factory=dict)
    waiting: dict[int, list[PromotingRun]] = field(default_factory=dict)

    @property
    def startup(self) -> float:
        return self.base.startup

    @property
    def training_steps(self) -> int | None:
        return self.base.training_steps

    @property
    def gap(self) -> float:
        return self.base.gap

    def slowdown(self, model: str) -> float:
        return self.base.slowdown(model)

    def reached(self, run: PromotingRun, epoch: int) -> bool | str:
        if run.rung >= len(self.steps) or epoch != self.steps[run.rung]:
            return False
        value = max(run.scores)
        self.values.setdefault(run.rung, []).append((value, run))
        # Recorded on the trial as hpo's pruner records a rung (its system attribute), so that
        # what reads a trial's rungs (`pausing.rung_reached`) reads the replay's as hpo's.
        self.base.study._storage.set_trial_system_attr(  # noqa: SLF001 as Optuna's pruners
            run.trial._trial_id, rung_key(run.rung), value)  # noqa: SLF001
        run.rung += 1
        if self.eager and run in self.top(run.rung - 1):
            return False
        self.waiting.setdefault(run.rung - 1, []).append(run)
        if self.tell_paused:
            self.base.study.tell(run.trial, state=TrialState.PRUNED)
        else:  # marked as hpo's workers mark it, which its sampler may read
            run.trial.set_user_attr(PAUSED_AT, epoch)
        self.bound()
        return PAUSE

    def bound(self) -> None:
        """Past `max_checkpoints`, the paused runs least likely to be promoted give their
        checkpoints up: by the share of their rung's values above their own, of equals the
        lower rung, then the later."""
        if self.max_checkpoints is None:
            return
        paused = [(rung, run) for rung, runs in self.waiting.items() for run in runs
                  if not run.lost]
        excess = len(paused) - self.max_checkpoints
        if excess <= 0:
            return

        def behind(entry: tuple[int, PromotingRun]) -> tuple[float, int, int]:
            rung, run = entry
            values = [v for v, _ in self.values[rung]]
            mine = next(v for v, r in self.values[rung] if r is run)
            return (sum(v > mine for v in values) / len(values), -rung, run.trial.number)

        for _, run in sorted(paused, key=behind, reverse=True)[:excess]:
            run.lost = True

    def resume(self, run: PromotingRun) -> PromotingRun:
        if run.lost:  # the simulation trains it again from its start
            run.again = self.steps[run.rung - 1]
        if self.tell_paused:
            self.base.study.enqueue_trial(run.trial.params)
            run.trial = self.base.study.ask()
            self.base.sample(run.trial)
        else:
            run.trial.set_user_attr(PAUSED_AT, None)
        return run

    def top(self, rung: int) -> list[PromotingRun]:
        """The runs in rung `rung`'s top 1/reduction_factor (eager: the best of fewer)."""
        ranked = sorted(self.values.get(rung, []), key=lambda v: -v[0])
        keep = len(ranked) // self.reduction_factor
        return [run for _, run in ranked[:max(keep, 1) if self.eager else keep]]

    def resumable(self, fits: Callable[[PromotingRun], bool] = lambda _: True
                  ) -> PromotingRun | None:
        """The paused run a free worker resumes, if a rung promotes one (and it `fits` the
        budget): of the highest rung, the best first."""
        for rung in reversed(range(len(self.steps))):
            for run in self.top(rung):
                if run in self.waiting.get(rung, []) and fits(run):
                    self.waiting[rung].remove(run)
                    return self.resume(run)
        return None

    def ask(self) -> Running:
        run = self.resumable()
        if run is not None:
            return run
        trial = self.base.study.ask()
        return PromotingRun(self, trial, self.base.sample(trial))


def promoting(base: OptunaPolicy, study: config_module.StudyConfig, name: str,
              eager: bool = False, tell_paused: bool = False) -> PromotionPolicy:
    """`base` (hpo's search) in promotion form at the rungs of `study`'s pruner."""
    pruner, epochs = study.study.pruner, study.training.epochs
    first = pruner.first_rung(epochs)
    steps = tuple(itertools.takewhile(
        lambda s: s < epochs, (first * pruner.reduction_factor**k for k in itertools.count())))
    return PromotionPolicy(name, base, steps, pruner.reduction_factor, eager, tell_paused,
                           max_checkpoints=pruner.max_checkpoints)


# ---------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Finished:
    start: float
    end: float
    config: Any
    scores: tuple[float, ...]
    state: str  # COMPLETE, PRUNED, or PAUSED (never resumed by the end)

    @property
    def value(self) -> float | None:
        """As every tool is scored: a COMPLETE trial's best report."""
        return max(self.scores) if self.state == "COMPLETE" else None


def simulate(policy: Policy, table: Table, world: int, workers: int, *,
             budget: int | None = None, horizon: float = math.inf,
             searches_batches: bool = False) -> list[Finished]:
    """The trials of one search, in the order they finished. Trials mode: `budget` trials.
    Compute mode (no budget): trials start until `horizon` (simulated seconds) and only those
    finished by then count. A trial its policy pauses frees its worker; when the policy
    promotes it, a free worker resumes it from its checkpoint at its next epoch (paying the
    curve's set-up again, no epoch twice). Trials mode counts started trials: once `budget`
    have started nothing new starts, and a paused trial resumes only where its rung promotes
    it (as hpo's workers do); one still paused at the end counts as stopped there."""
    events: list[tuple[float, int, int, int]] = []
    running: dict[int, tuple[Running, Curve, float, float]] = {}
    paused: dict[int, tuple[int, int, Finished]] = {}  # id(run): its number, epoch, record
    tokenized: list[set[str]] = [set() for _ in range(workers)]
    searched: set[tuple[str, str, int]] = set()
    finished: list[Finished] = []
    idle: set[int] = set()  # workers waiting, past the budget, for a promotion
    again = 0  # epochs trained a second time: promoted runs whose checkpoints were given up
    counter = 0

    def setup(worker: int, config: Any, curve: Curve) -> float:
        seconds = curve.setup
        if config.model not in tokenized[worker]:
            tokenized[worker].add(config.model)
            seconds += table.costs.tokenization.get(config.model, 0.0)
        return seconds

    frees = getattr(policy, "frees_slot", False)
    unit = getattr(policy, "training_steps", None) if budget is not None else None

    def room() -> int:
        """Under a budget of trainings: the epochs left once every trial's are counted, a
        running trial's whole curve (it may train them all), a paused or ended one's trained."""
        held = {number for number, _, _ in paused.values()}
        committed = sum(len(t.scores) for t in finished) + sum(
            len(curve.scores) for number, (_, curve, _, _) in running.items()
            if number not in held)
        return budget * unit - committed - again

    def fits(run: Any) -> bool:
        number, epoch, _ = paused[id(run)]
        kept = 0 if getattr(run, "lost", False) else epoch  # without it: from the start
        return len(running[number][1].scores) - kept <= room()

    def start(worker: int, now: float) -> None:
        nonlocal counter, again
        if budget is None and now >= horizon:
            return
        if unit is not None:
            # As `hpo run --n-trials N` under study.budget: trainings: a trial starts, or a
            # paused one resumes, only while all it may train fits; a worker waits while a
            # running trial may still give some back.
            if room() >= unit:
                run = policy.ask()
            else:
                resumable = getattr(policy, "resumable", None)
                run = resumable(fits) if resumable is not None else None
                if run is None:
                    if len(running) > len(paused):
                        idle.add(worker)
                    return
        elif budget is not None and frees and counter - len(paused) >= budget:
            return  # every slot held by a trial that trains or ended: nothing starts
        elif budget is not None and not frees and counter >= budget:
            # As `hpo run --n-trials N` under study.pruner.pause: no new trial past the
            # budget, but a paused one that a rung promotes still resumes.
            resumable = getattr(policy, "resumable", None)
            run = resumable() if resumable is not None else None
            if run is None:
                if resumable is not None:
                    idle.add(worker)  # it waits: a later report may promote one
                return
        else:
            run = policy.ask()
        if id(run) in paused:
            number, epoch, record = paused.pop(id(run))
            finished.remove(record)
            _, curve, _, factor = running[number]
            if getattr(run, "lost", False):  # its checkpoint given up: from its start again
                run.lost, again, epoch = False, again + epoch, 0
            seconds = setup(worker, run.config, curve) + curve.seconds[epoch]
            heapq.heappush(events, (now + seconds * factor, number, worker, epoch + 1))
            return
        c = run.config
        curve = table.curve(c, world)
        seconds = setup(worker, c, curve)
        # hpo's first search per model and precision probes up to the physical limit.
        bound = (c.model, c.precision, table.max_physical)
        if searches_batches and bound not in searched:
            searched.add(bound)
            seconds += table.costs.batch_search.get(bound, 0.0)
        factor = policy.slowdown(c.model)
        running[counter] = (run, curve, now, factor)
        heapq.heappush(events, (now + (seconds + curve.seconds[0]) * factor, counter, worker, 1))
        counter += 1

    def wake(now: float) -> None:
        for waiting in sorted(idle):
            idle.discard(waiting)
            start(waiting, now + policy.gap)

    for worker in range(workers):
        start(worker, policy.startup)
    while events:
        now, number, worker, epoch = heapq.heappop(events)
        if now > horizon:
            break
        run, curve, began, factor = running[number]
        length = len(curve.scores)
        decision = run.report(epoch, curve.scores[epoch - 1])
        if epoch < length and decision == PAUSE:
            record = Finished(began, now, run.config, curve.scores[:epoch], "PAUSED")
            finished.append(record)
            paused[id(run)] = (number, epoch, record)
            wake(now)  # once it is paused: a rung may promote it at once
            start(worker, now + policy.gap)
            continue
        wake(now)  # a value at a rung may have promoted a paused trial
        if epoch < length and not decision:
            heapq.heappush(events, (now + curve.seconds[epoch] * factor, number, worker,
                                    epoch + 1))
            continue
        pruned = bool(decision) and epoch < length
        run.finish(list(curve.scores[:epoch]), pruned)
        del running[number]
        finished.append(Finished(began, now, run.config, curve.scores[:epoch],
                                 "PRUNED" if pruned else "COMPLETE"))
        start(worker, now + policy.gap)
        if unit is not None:  # what it did not train may let a waiting worker start
            wake(now)
    return finished


def best_by(trials: list[Finished], moment: float) -> float | None:
    values = [t.value for t in trials if t.value is not None and t.end <= moment]
    return max(values) if values else None


def wall(trials: list[Finished]) -> float:
    return max((t.end for t in trials), default=0.0)


def steps_of(trials: list[Finished]) -> list[list[float]]:
    """The best-so-far curve as its steps: [time, best]."""
    out, top = [], -math.inf
    for trial in trials:
        if trial.value is not None and trial.value > top:
            top = trial.value
            out.append([round(trial.end, 3), round(top, 6)])
    return out


# ---------------------------------------------------------------------------- the peers


@dataclass(frozen=True)
class Measured:
    """What the real runs on the table's CPU kind say of each tool beside the curves: its
    workers' start-up seconds and its trials' seconds over hpo's, per model."""
    startup: dict[str, float]
    slowdowns: dict[str, dict[str, float]]
    runs: int
    # Seconds between a trial's end and the next trial's start on the same worker: what the
    # tool does between trials (a Trainer built, a Ray trial's actor started, a study read).
    gaps: dict[str, float] = field(default_factory=dict)


NOTHING = Measured({}, {}, 0)


def measured(real: dict, machine: str) -> Measured:
    runs = [r for r in real["runs"] if r["label"] == "default"
            and r.get("machine", real["machine"]) == machine]
    startup: dict[str, list[float]] = {}
    gaps: dict[str, list[float]] = {}
    seconds: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        startup.setdefault(run["tool"], []).append(min(t["start"] for t in run["trials"]))
        ordered = sorted(run["trials"], key=lambda t: t["start"])
        gaps.setdefault(run["tool"], []).extend(
            max(b["start"] - a["end"], 0.0) for a, b in itertools.pairwise(ordered))
        for trial in run["trials"]:
            if trial["state"] == "COMPLETE":
                seconds.setdefault(run["tool"], {}).setdefault(trial["model"], []).append(
                    trial["end"] - trial["start"])
    ours = seconds.get("hpo", {})
    slowdowns = {tool: {model: statistics.median(v) / statistics.median(ours[model])
                        for model, v in by_model.items() if model in ours}
                 for tool, by_model in seconds.items()}
    return Measured({tool: statistics.median(v) for tool, v in startup.items()}, slowdowns,
                    len(runs), {tool: statistics.median(v) for tool, v in gaps.items() if v})


# The parts of a tool's cost `--even-costs` can price as hpo's.
EVEN_PARTS = ("startup", "gaps", "slowdowns", "searches")


def even(facts: Measured, curves: Curves, parts: tuple[str, ...] = EVEN_PARTS) -> Measured:
    """Every tool's trials priced as hpo's, for `--even-costs`: hpo's start-up and gap for
    all, no slowdowns, and hpo's batch searches free (`curves` changed so): what the searches
    alone make of a world, apart from what each tool costs around them. `parts` names which
    of those to even, so that each cost's share of a gap can be read alone."""
    if "searches" in parts:
        curves.costs = replace(curves.costs, batch_search={})
    start, gap = facts.startup.get("hpo", 0.0), facts.gaps.get("hpo", 0.0)
    return Measured(
        {tool: start for tool in facts.startup} if "startup" in parts else facts.startup,
        {} if "slowdowns" in parts else facts.slowdowns, facts.runs,
        {tool: gap for tool in facts.gaps} if "gaps" in parts else facts.gaps)


def short(model: str) -> str:
    return model.rsplit("/", 1)[-1]


# A prior-guided start from the literature: the fine-tuning rates BERT's paper recommends
# (2e-5 to 5e-5, batches 16 and 32; MiniLM's and sentence-transformers' recipes sit in the
# same range), enqueued for each model before TPE takes over.
PRIOR_RATES = (2.0e-5, 5.0e-5)


@dataclass(frozen=True)
class Ground:
    """What a repetition's policies are built for: hpo's study (the demo's file, or a study
    at hpo's schema defaults on another table), the table, and each tool's measured costs
    (the demo's only)."""
    study: config_module.StudyConfig
    table: Any
    facts: Measured = NOTHING

    @property
    def demo(self) -> bool:
        return isinstance(self.table, Curves)

    @property
    def epochs(self) -> int:
        return self.study.training.epochs


def table_study(table: tables.RecordedTable) -> config_module.StudyConfig:
    """hpo's study on a table: the schema's default sampler and pruner, the table's reports
    as its epochs (the demo file lends the rest, which a table never reads)."""
    study = study_files.load(study_files.study_path("demo"),
                             [f"training.epochs={table.epochs}"])
    raw = study.model_dump(mode="json")
    raw["study"]["sampler"] = config_module.SamplerConfig().model_dump(mode="json")
    raw["study"]["pruner"] = config_module.PrunerConfig().model_dump(mode="json")
    raw["study"]["enqueue"] = []
    return config_module.StudyConfig.model_validate(raw)


def hpo_policy(config: config_module.StudyConfig, ground: Ground, seed: int, name: str,
               costs_of: str = "hpo", report_value: Callable[[list[float]], float] | None = None
               ) -> OptunaPolicy:
    """hpo's search as `hpo run` builds it: its sampler (seeded per trial number), pruner, enqueued
    sets and value rule from hpo's own functions; on the demo also its space and precision
    rule. `costs_of` names the tool whose measured costs it pays."""
    config = with_overrides(config, f"study.sampler.seed={seed}")
    study = new_study(seed, make_sampler(config), make_pruner(config))
    for params in config.study.enqueue:
        study.enqueue_trial(dict(params), skip_if_exists=True)
    value = best if config.study.objective_epoch == "best" else last
    if ground.demo:
        pinned = pinned_space(config, ground.table)

        def sample(trial: optuna.Trial) -> Any:
            params = suggest(trial, pinned)
            return Config(params.model_name, params.fp_precision,
                          params.target_effective_batch_size, params.learning_rate,
                          float(params.extras.get("weight_decay", 0.0)))
    else:
        sample = sampling(ground.table.space, table_config)
    facts = ground.facts
    slow = {m: facts.slowdowns.get(costs_of, {}).get(short(m), 1.0)
            for m in getattr(ground.table, "models", [])} if costs_of != "hpo" else {}
    return OptunaPolicy(name, study, sample, facts.startup.get(costs_of, 0.0), slow,
                        facts.gaps.get(costs_of, 0.0), report_value=report_value or value,
                        tell_value=value,
                        training_steps=(config.max_steps() if config.study.budget == "trainings"
                                        else None))


def hpo_search(config: config_module.StudyConfig, ground: Ground, seed: int, name: str
               ) -> Policy:
    """hpo's search as its study file sets it: `hpo_policy`, in promotion form where
    `study.pruner.pause` pauses what its rungs would stop (`PromotionPolicy`)."""
    policy = hpo_policy(config, ground, seed, name)
    # `auto` as on hpo's default storage (a SQLite file, its artifact store beside it).
    config, _ = artifacts.with_pause_decided(config, "sqlite:///hpo.db")
    return promoting(policy, config, name, eager=True) if config.study.pruner.pause else policy


# Optuna's own rule, hpo's before issue 63: a stopped trial ends, `--n-trials N` counts trials.
OPTUNA_COUNT = ("study.pruner.pause=false", "study.budget=trials")


def as_expert(study: config_module.StudyConfig) -> config_module.StudyConfig:
    """hpo configured exactly as the expert's glue: Optuna 5's TPE defaults with the study's
    start-up trials, the median pruner (4 start-up trials, 1 warm-up epoch), the best epoch
    told, nothing enqueued."""
    return with_overrides(
        study, "study.sampler.name=tpe", "study.sampler.multivariate=true",
        "study.sampler.constant_liar=true", "study.sampler.group=false",
        "study.sampler.paused_as_pruned_from=null", "study.pruner.name=median",
        f"study.pruner.n_startup_trials={MEDIAN_STARTUP}",
        f"study.pruner.n_warmup_steps={MEDIAN_WARMUP}", "study.objective_epoch=best",
        "study.enqueue=[]", *OPTUNA_COUNT)


def policies(names: list[str], ground: Ground, seed: int,
             variants: dict[str, list[str]] | None = None, own_draws: bool = False
             ) -> list[tuple[Policy, bool]]:
    """Each named policy for repetition `seed`, and whether it searches batches as hpo;
    `variants` names hpo with `--set` overrides (one named "hpo" replaces hpo's defaults)."""
    build = builders(ground, seed, own_draws)
    for label, sets in (variants or {}).items():
        build[label] = functools.partial(
            lambda sets, label: (hpo_search(with_overrides(ground.study, *sets), ground, seed,
                                            label), ground.demo), sets, label)
    unknown = [n for n in names if n not in build]
    if unknown:
        raise SystemExit(f"unknown policy {unknown[0]}: choose from {', '.join(build)}")
    return [build[name]() for name in names]


@dataclass(frozen=True)
class PeerSpace:
    """What a user's own script searches: the space, how a sampled set becomes what the
    table reads (per tool: the novice's fp32, the expert's fastest precision), and each
    tool's measured slowdown per model."""
    space: dict[str, BaseDistribution]
    config_of: dict[str, Callable[[dict[str, Any]], Any]]
    slow: dict[str, dict[str, float]]


def peer_space(ground: Ground) -> PeerSpace:
    table, facts = ground.table, ground.facts
    if not ground.demo:
        return PeerSpace(table.space, {"novice": table_config, "expert": table_config}, {})
    fastest = min(table.precisions, key=lambda p: sum(
        table.seconds_per_epoch(m, p) for m in table.models))
    return PeerSpace(plain_space(ground.study.search_space),
                     {"novice": demo_config("none"), "expert": demo_config(fastest)},
                     {tool: {m: facts.slowdowns.get(tool, {}).get(short(m), 1.0)
                             for m in table.models} for tool in ("novice", "expert", "ray")})


def shared_tpe(seed: int, startup: int) -> optuna.samplers.BaseSampler:
    """Optuna's TPE at its defaults, trial n drawn by `TPESampler(seed=trial_seed(seed, n))`
    as hpo's seeded sampler draws it. TPE reads the history from the study and its seed only
    draws, so a TPE seeded per trial searches as one seeded once; but now, where the same
    space is suggested in the same order, its random start-up draws trial for trial what
    hpo's and the random search's draw in the same world (common random numbers): the luck
    of the first draws, which decides most of the early regret, no longer differs between
    the policies compared (benchmarks/README.md, "Shared start-up draws")."""
    return PerTrialSeeded(tpe_speed.one_search_space(lambda number: optuna.samplers.TPESampler(
        seed=trial_seed(seed, number), n_startup_trials=startup)))


def builders(ground: Ground, seed: int, own_draws: bool = False
             ) -> dict[str, Callable[[], tuple[Policy, bool]]]:
    """The peers as their users build them with the installed Optuna (each setting stated
    in benchmarks/README.md, "The search yardstick"): `novice`, `expert`, `ray` (ASHA at
    Ray's reduction factor 4), `ray-rf2`, `random`, `tpe-hyperband`, `bohb` (Syne Tune's),
    `prior` (the demo), hpo itself, the null checks `expert-copy` (other seeds) and
    `hpo-as-expert` (hpo's code path set as the expert, at the expert's costs), and issue
    63's replay-only candidates `hpo-promotion`, `hpo-pause`, `hpo-pause-pruned`
    (`PromotionPolicy`)."""
    study, table, facts = ground.study, ground.table, ground.facts
    startup = study.study.sampler.n_startup_trials
    epochs = ground.epochs
    peers = peer_space(ground)
    space, of, slow = peers.space, peers.config_of, peers.slow

    def tpe(s: int) -> optuna.samplers.BaseSampler:
        if own_draws:
            return optuna.samplers.TPESampler(seed=s, n_startup_trials=startup)
        return shared_tpe(s, startup)

    def glue(name: str, tool: str, s: int, pruner: optuna.pruners.BasePruner,
             **how: Any) -> tuple[Policy, bool]:
        return OptunaPolicy(name, new_study(seed, tpe(s), pruner), sampling(space, of[tool]),
                            facts.startup.get(tool, 0.0), slow.get(tool, {}),
                            facts.gaps.get(tool, 0.0), report_value=last, **how), False

    def median() -> optuna.pruners.MedianPruner:
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP,
                                           n_warmup_steps=MEDIAN_WARMUP)

    def trainer_steps(epoch: int, config: Config) -> int:
        # The Trainer reports at its global step: trials of different batches never share
        # a step, so the median pruner compares only trials of one batch.
        return epoch * (table.train_size // config.batch)

    def novice() -> tuple[Policy, bool]:
        if ground.demo:
            return glue("novice", "novice", seed, median(), tell_value=last,
                        step_of=trainer_steps)
        return glue("novice", "novice", seed, optuna.pruners.NopPruner(), tell_value=last)

    def ours(config: config_module.StudyConfig, name: str) -> tuple[Policy, bool]:
        return hpo_search(config, ground, seed, name), ground.demo

    def ray(name: str, factor: int) -> tuple[Policy, bool]:
        return RayPolicy(name, space, of["expert"], seed, epochs, startup, factor,
                         facts.startup.get("ray", 0.0), slow.get("ray", {}),
                         facts.gaps.get("ray", 0.0), sampler=tpe(seed)), False

    prior = [{"model_name": m, "learning_rate": r} for m in study.search_space.model_name
             for r in PRIOR_RATES]
    enqueue = "study.enqueue=" + yaml.safe_dump(prior, default_flow_style=True, width=math.inf)
    build: dict[str, Callable[[], tuple[Policy, bool]]] = {
        "hpo": lambda: ours(study, "hpo"),
        "novice": novice,
        "expert": lambda: glue("expert", "expert", seed, median(), tell_value=best),
        "expert-copy": lambda: glue("expert-copy", "expert", seed + COPY_SEED, median(),
                                    tell_value=best),
        "hpo-as-expert": lambda: (hpo_policy(as_expert(study), ground, seed, "hpo-as-expert",
                                             costs_of="expert", report_value=last), False),
        "ray": lambda: ray("ray", 4),
        "ray-rf2": lambda: ray("ray-rf2", 2),
        # The peers a user builds in Optuna count trials, as Optuna's `n_trials` does.
        "random": lambda: ours(with_overrides(study, "study.sampler.name=random",
                                              "study.pruner.name=none", *OPTUNA_COUNT),
                               "random"),
        "tpe-hyperband": lambda: ours(with_overrides(
            study, "study.pruner.name=hyperband", "study.pruner.min_resource=1",
            *OPTUNA_COUNT), "tpe-hyperband"),
        # A user's Syne Tune script trains with the expert's Trainer set-up: its costs.
        **{name: functools.partial(
            lambda name: (SynePolicy(name, space, of["expert"], seed, epochs, method=name,
                                     startup=facts.startup.get("expert", 0.0),
                                     slowdowns=slow.get("expert", {}),
                                     gap=facts.gaps.get("expert", 0.0)), False), name)
           for name in ("bohb", "asha-promotion", "bohb-promotion")},
    }
    # Issue 63's replay-only candidates, as measured: on a budget of trials.
    counted = with_overrides(study, *OPTUNA_COUNT)
    build["hpo-promotion"] = lambda: (promoting(
        hpo_policy(counted, ground, seed, "hpo-promotion"), counted, "hpo-promotion"),
        ground.demo)
    build["hpo-pause"] = lambda: (promoting(hpo_policy(counted, ground, seed, "hpo-pause"),
                                            counted, "hpo-pause", eager=True), ground.demo)
    build["hpo-pause-free"] = lambda: (dataclasses.replace(promoting(
        hpo_policy(counted, ground, seed, "hpo-pause-free"), counted, "hpo-pause-free",
        eager=True), frees_slot=True), ground.demo)
    build["hpo-pause-pruned"] = lambda: (promoting(
        hpo_policy(counted, ground, seed, "hpo-pause-pruned"), counted, "hpo-pause-pruned",
        eager=True, tell_paused=True), ground.demo)
    if ground.demo:
        build["prior"] = lambda: ours(with_overrides(study, enqueue), "prior")
    return build


PEERS = ["novice", "expert", "ray", "ray-rf2", "random", "tpe-hyperband", "bohb"]
# Each null check: a policy and the one it must come out level with.
NULLS = [("expert-copy", "expert"), ("hpo-as-expert", "expert")]


# ---------------------------------------------------------------------------- worlds


@dataclass(frozen=True)
class Setting:
    """One replay: its tables, mode and size. World k searches table k mod the tables."""
    mode: str  # compute or trials
    budget: int
    workers: int
    names: tuple[str, ...]
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()
    horizons: tuple[float, ...] = ()  # compute mode: per table
    exact_tpe: bool = False  # Optuna's own _log_ndtr, not benchmarks/tpe_speed.py's
    own_draws: bool = False  # each peer's TPE seeded once (before 2026-12-06): `shared_tpe`

    def variant_sets(self) -> dict[str, list[str]]:
        return {label: list(sets) for label, sets in self.variants}


def race(chosen: list[tuple[Policy, bool]], table: Any, world: int, setting: Setting,
         horizon: float) -> dict[str, dict]:
    """Every policy's search in one world, and the world's figures: its horizon, the best
    any policy found by then and a random configuration's median."""
    out: dict[str, dict] = {}
    for policy, searches in chosen:
        if setting.mode == "compute":
            trials = simulate(policy, table, world, setting.workers, horizon=horizon,
                              searches_batches=searches)
        else:
            trials = simulate(policy, table, world, setting.workers, budget=setting.budget,
                              searches_batches=searches)
        if hasattr(policy, "close"):
            policy.close()
        out[policy.name] = {"steps": steps_of(trials), "trials": len(trials),
                            "pruned": sum(t.state == "PRUNED" for t in trials),
                            "paused": sum(t.state == "PAUSED" for t in trials),
                            "reports": sum(len(t.scores) for t in trials),
                            # Curves met: fewer than its trials where suggestions near each
                            # other read the same recorded run (a table's nearest lookup).
                            "distinct": len({table.curve(t.config, world) for t in trials}),
                            "wall": round(wall(trials), 3)}
    end = horizon if setting.mode == "compute" else max(r["wall"] for r in out.values())
    found = [yardstick.incumbent(r["steps"], end) for r in out.values()]
    out["world"] = {"table": table.name, "seed": world, "horizon": end,
                    "best": max((f for f in found if f is not None), default=0.0),
                    "baseline": table.random_median(world)}
    return out


def one_world(setting: Setting, load: Callable[[], list[Ground]], world: int) -> dict:
    (tpe_speed.uninstall if setting.exact_tpe else tpe_speed.install)()
    grounds = load()
    ground = grounds[world % len(grounds)]
    horizon = (setting.horizons[world % len(grounds)] if setting.mode == "compute"
               else math.inf)
    chosen = policies(list(setting.names), ground, world, setting.variant_sets(),
                      own_draws=setting.own_draws)
    return race(chosen, ground.table, world, setting, horizon)


def repeat(one: Callable[[int], dict], seeds: range, jobs: int) -> list[dict]:
    """`one(seed)` for every seed, in seed order. Repetitions are independent (each its own
    seeded world and samplers): they run on `jobs` processes, whatever finishes first."""
    reps = []
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for k, rep in enumerate(pool.map(one, seeds), 1):
            reps.append(rep)
            if k % 10 == 0:
                print(f"  {k}/{len(seeds)} worlds", file=sys.stderr, flush=True)
    return reps


def horizons(setting: Setting, load: Callable[[], list[Ground]], seeds: range,
             jobs: int) -> tuple[float, ...]:
    """Per table, the median wall at which the novice finishes `budget` trials over the
    table's worlds: compute mode's default horizon."""
    probe = replace(setting, mode="trials", names=("novice",), variants=())
    reps = repeat(functools.partial(one_world, probe, load), seeds, jobs)
    walls: list[list[float]] = [[] for _ in load()]
    for k, rep in zip(seeds, reps, strict=True):
        walls[k % len(walls)].append(rep["novice"]["wall"])
    # A table no world searches (fewer worlds than tables) needs no horizon.
    return tuple(statistics.median(w) if w else math.nan for w in walls)


# ---------------------------------------------------------------------------- the figures


_GROUNDS: dict[tuple, list[Ground]] = {}


def cut(made: dict, epochs: int | None) -> dict:
    """The demo's table with its curves cut to their first `epochs` epochs: a study of fewer
    epochs than the recording trains (and is scored) that far."""
    if epochs is None or epochs == made["epochs"]:
        return made
    if not 1 <= epochs < made["epochs"]:
        raise SystemExit(f"--epochs {epochs}: the table's curves have {made['epochs']}")
    columns = made["columns"]
    at = {columns.index("f1"), columns.index("epoch_seconds")}
    rows = [[value[:epochs] if k in at else value for k, value in enumerate(row)]
            for row in made["rows"]]
    return {**made, "epochs": epochs, "rows": rows}


def grounds(paths: tuple[str, ...], real: str, even_costs: tuple[str, ...], epochs: int | None,
            surrogate: str | None = None) -> list[Ground]:
    """The tables of a replay, read once per process: the demo's (a .json file of
    benchmarks/learning_curves.py) with hpo's demo study and the tools' measured costs, or
    tables in the JSON Lines format with a study at hpo's defaults; LCBench's answered by its
    surrogate in `surrogate` (a yahpo_data clone) where one is given."""
    key = (paths, real, even_costs, epochs, surrogate)
    if key not in _GROUNDS:
        found = []
        evaluate = replay_lcbench.onnx_surrogate(Path(surrogate)) if surrogate else None
        for path in map(Path, paths):
            if path.suffix == ".jsonl":
                table = tables.read(path)
                task = replay_lcbench.task_of(table.name)
                if evaluate is not None and task is not None:
                    table.answer = replay_lcbench.answerer(evaluate, task)
                found.append(Ground(table_study(table), table))
                continue
            made = cut(stored.read(path), epochs or None)
            curves = Curves(made)
            study = study_files.load(study_files.study_path("demo"),
                                     [f"training.epochs={made['epochs']}"])
            facts = measured(stored.read(Path(real)), made["machine"])
            found.append(Ground(study, curves,
                                even(facts, curves, even_costs) if even_costs else facts))
        _GROUNDS[key] = found
    return _GROUNDS[key]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("optuna", "ray", "numpy", "scipy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    out["syne-tune"] = "0.13.0 (benchmarks/peers/syne.txt)"
    return out


def even_parts(given: list[str] | None) -> tuple[str, ...]:
    """`--even-costs` alone evens every part; not given, none."""
    if given is None:
        return ()
    return tuple(p for p in EVEN_PARTS if p in given) if given else EVEN_PARTS


def run(args: argparse.Namespace) -> dict:
    surrogate = str(args.surrogate) if args.surrogate else None
    load = functools.partial(grounds, tuple(str(p) for p in args.table), str(args.real),
                             even_parts(args.even_costs), args.epochs, surrogate)
    variants = tuple((label, tuple(sets)) for label, sets in args.variants)
    # A variant named in --policies too runs once.
    names = tuple(dict.fromkeys(("hpo", *args.policies, *(label for label, _ in variants))))
    if args.hpo_sets:
        variants = (*variants, ("hpo", tuple(args.hpo_sets)))
    setting = Setting(args.mode, args.budget, args.workers, names, variants,
                      exact_tpe=args.exact_tpe, own_draws=args.own_draws)
    seeds = range(args.first_seed, args.first_seed + args.repetitions)
    count = len(load())
    if args.mode == "compute":
        chosen = ((args.horizon,) * count if args.horizon
                  else horizons_of(args.horizons_from, count) if args.horizons_from
                  else horizons(setting, load, seeds, args.jobs))
        setting = replace(setting, horizons=chosen)
    reps = repeat(functools.partial(one_world, setting, load), seeds, args.jobs)
    return {
        "mode": args.mode, "budget": args.budget, "workers": args.workers,
        "repetitions": args.repetitions, "first_seed": args.first_seed,
        "horizons": [h if math.isfinite(h) else None for h in setting.horizons],
        "hpo_sets": args.hpo_sets,
        "even_costs": list(even_parts(args.even_costs)), "policies": list(names),
        "answers": ("the surrogate at the point" if surrogate
                    else "the nearest recorded run"),
        "tables": [{"file": Path(p).name, "name": g.table.name,
                    # A part recorded on another CPU kind, and how its gate came out.
                    **({"parts": g.table.table["parts"]}
                       if g.demo and g.table.table.get("parts") else {})}
                   for p, g in zip(args.table, load(), strict=True)],
        "machine": cpu_model(), "versions": versions(),
        "tpe": "Optuna's" if args.exact_tpe else "Optuna's, log_ndtr vectorised (tpe_speed.py)",
        "draws": OWN if args.own_draws else SHARED,
        "measured": next((dataclasses.asdict(g.facts) for g in load() if g.demo), None),
        **figures(reps, names),
    }


def figures(reps: list[dict], names: tuple[str, ...] | list[str]) -> dict:
    """hpo against each peer and the null checks over the worlds `reps`, and the worlds."""
    null_names = {a for a, _ in NULLS}
    return {
        "versus": {peer: yardstick.compare(reps, "hpo", peer) for peer in names
                   if peer != "hpo" and peer not in null_names},
        "nulls": {f"{a} vs {b}": {**(f := yardstick.compare(reps, a, b)),
                                  "level": yardstick.level(f)}
                  for a, b in NULLS if a in names and b in names},
        "repetitions_data": reps,
    }


def horizons_of(path: Path, count: int) -> tuple[float, ...]:
    """The per-table horizons of an earlier output, so that chunks of one setting's worlds
    run to the same horizons (each chunk's own median would differ)."""
    found = stored.read(path).get("horizons") or []
    if len(found) != count or any(h is None for h in found):
        raise SystemExit(f"{path}: no horizon for each of the {count} tables")
    return tuple(found)


# What must agree between outputs merged into one.
SAME = ("mode", "budget", "workers", "horizons", "hpo_sets", "even_costs", "policies",
        "tables", "tpe", "answers", "draws")
OWN = "each peer's TPE seeded once"
SHARED = "the peers' TPE seeded per trial as hpo's (start-up draws shared)"
# What an output made before a key existed did: every suggestion read the nearest run, and
# each peer's TPE drew from its own seed.
BEFORE = {"answers": "the nearest recorded run", "draws": OWN}


def recorded(result: dict, key: str) -> Any:
    value = result.get(key, BEFORE.get(key))
    if key == "even_costs" and isinstance(value, bool):  # written before its parts existed
        return list(EVEN_PARTS) if value else []
    return value


def merge(results: list[dict], keep: frozenset[int] | None = None) -> dict:
    """One output from chunks of one setting's worlds (`--first-seed`, `--horizons-from`):
    the worlds together in seed order, the figures computed over all of them. `keep`: only
    these worlds, as where each world's policies must come from one CPU kind (the outputs
    of two kinds split by world, benchmarks/README.md "CPU kinds")."""
    first = results[0]
    for other in results[1:]:
        differs = [key for key in SAME if recorded(other, key) != recorded(first, key)]
        if differs:
            raise SystemExit(f"cannot merge: the outputs differ in {differs[0]}")
    if keep is not None:
        results = [{**r, "repetitions_data": [w for w in r["repetitions_data"]
                                              if w["world"]["seed"] in keep]}
                   for r in results]
        results = [r for r in results if r["repetitions_data"]]
        if not results:
            raise SystemExit("cannot merge: none of the worlds kept is in the outputs")
    reps = sorted((w for r in results for w in r["repetitions_data"]),
                  key=lambda w: w["world"]["seed"])
    seeds = [w["world"]["seed"] for w in reps]
    if len(set(seeds)) != len(seeds):
        raise SystemExit("cannot merge: a world is in two outputs")
    return {**first, "repetitions": len(reps), "first_seed": seeds[0],
            "machines": machines(results), **figures(reps, first["policies"])}


def join(results: list[dict], renames: dict[str, str]) -> dict:
    """One output from runs of the same worlds with different policies (a slow peer run
    apart, a candidate run beside another run's peers): each world's policies together, a
    policy in two outputs only where both searched alike, each world's best and end over
    all of them. `renames` relabels policies at once (`new=hpo hpo=hpo-stop`: a candidate
    becomes the subject of the figures)."""
    first = results[0]
    for other in results[1:]:
        differs = [key for key in SAME
                   if key != "policies" and recorded(other, key) != recorded(first, key)]
        if differs:
            raise SystemExit(f"cannot join: the outputs differ in {differs[0]}")
    by_seed = [{w["world"]["seed"]: w for w in r["repetitions_data"]} for r in results]
    if any(set(worlds) != set(by_seed[0]) for worlds in by_seed):
        raise SystemExit("cannot join: the outputs hold different worlds")
    names = list(dict.fromkeys(renames.get(n, n) for r in results for n in r["policies"]))
    if len(names) != len({n for r in results for n in r["policies"]}):
        raise SystemExit("cannot join: two policies would share a name")
    reps = []
    for seed in sorted(by_seed[0]):
        worlds = [found[seed] for found in by_seed]
        ends = [w["world"] for w in worlds]
        if any((e["table"], e["baseline"]) != (ends[0]["table"], ends[0]["baseline"])
               for e in ends):
            raise SystemExit(f"cannot join: world {seed} is not the same world in each output")
        rep: dict[str, Any] = {}
        for name, got in ((n, v) for w in worlds for n, v in w.items() if n != "world"):
            if not alike(rep.setdefault(name, got), got):
                raise SystemExit(f"cannot join: {name} searched otherwise in world {seed}")
        rep = {renames.get(n, n): v for n, v in rep.items()}
        # In compute mode every end is the horizon; in trials mode the last wall of all.
        rep["world"] = {**ends[0], "horizon": max(e["horizon"] for e in ends),
                        "best": max(e["best"] for e in ends)}
        reps.append(rep)
    return {**first, "policies": names, "joined": {"outputs": len(results), "renames": renames},
            "machines": machines(results), **figures(reps, names)}


def machines(results: list[dict]) -> list[str]:
    """The CPU kinds the outputs' worlds were searched on, merged or joined ones included."""
    return sorted({m for r in results for m in r.get("machines", [r["machine"]])})


def alike(one: dict, other: dict) -> bool:
    """Two records of a policy's search in a world agree in every figure both hold (an
    output made before a figure existed, as `distinct`, lacks it) and in its steps."""
    shared = one.keys() & other.keys()
    return "steps" in shared and all(one[key] == other[key] for key in shared)


def where(result: dict) -> str:
    """The tables of a result in a few words: "demo", or "lcbench (34 tables)"."""
    names = sorted({t["name"] for t in result["tables"]})
    at = ", surrogate" if result.get("answers") == "the surrogate at the point" else ""
    if len(names) == 1:
        return names[0] + (f" ({at[2:]})" if at else "")
    return f"{os.path.commonprefix(names).rstrip('-_') or 'tables'} ({len(names)} tables{at})"


def span(bounds: list[float] | None, digits: int = 2) -> str:
    return "-" if bounds is None else f"{bounds[0]:.{digits}f} to {bounds[1]:.{digits}f}"


def render(paths: list[Path], plot: Path | None) -> str:
    lines = ["| table | mode | setting | hpo vs | auc_ratio (95%) | final regret diff (95%) "
             "| G1 strict (95%) | median G2 (95%) | worlds |",
             "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    results = [stored.read(p) for p in paths]
    for r in results:
        setting = f"{r['budget']} x {r['workers']}"
        rows = [(f"hpo vs {peer}", f) for peer, f in r["versus"].items()]
        rows += [(f"null: {pair}", f) for pair, f in r["nulls"].items()]
        for label, f in rows:
            g2 = "-" if f["g2_median"] is None else f"{f['g2_median']:.2f}"
            mark = "" if "level" not in f else (" (level)" if f["level"] else " (NOT level)")
            lines.append(
                f"| {where(r)} | {r['mode']} | {setting} | {label.removeprefix('hpo vs ')}{mark} | "
                f"{f['auc_ratio']:.3f} ({span(f['auc_ratio_interval'], 3)}) | "
                f"{f['final_regret_diff']:+.3f} ({span(f['final_regret_diff_interval'], 3)}) | "
                f"{f['g1_strict']:.2f} ({span(f['g1_interval'])}) | {g2} "
                f"({span(f['g2_interval'])}) | {f['worlds']} |")
    if plot is not None:
        draw(results, plot)
    return "\n".join(lines)


def render_blocks(paths: list[Path], size: int) -> str:
    """The null checks of each output over each `size` consecutive worlds and over all of
    them (`yardstick.blocks`)."""
    lines = ["| table | mode | setting | null | worlds | auc_ratio (95%) | "
             "final regret diff (95%) | level |",
             "| --- | --- | --- | --- | --- | ---: | ---: | --- |"]
    for path in paths:
        r = stored.read(path)
        reps = r["repetitions_data"]
        for a, b in NULLS:
            if not reps or a not in reps[0] or b not in reps[0]:
                continue
            for f in yardstick.blocks(reps, a, b, size):
                seeds = (f"{reps[f['first']]['world']['seed']}-"
                         f"{reps[f['last']]['world']['seed']}")
                which = f"all {f['worlds']}" if f["worlds"] > size else seeds
                lines.append(
                    f"| {where(r)} | {r['mode']} | {r['budget']} x {r['workers']} | {a} vs {b} "
                    f"| {which} | {f['auc_ratio']:.3f} ({span(f['auc_ratio_interval'], 3)}) | "
                    f"{f['final_regret_diff']:+.3f} "
                    f"({span(f['final_regret_diff_interval'], 3)}) | "
                    f"{'yes' if f['level'] else 'NO'} |")
    return "\n".join(lines)


def draw(results: list[dict], plot: Path) -> None:
    """Per result, normalized regret (IQM and bootstrap 95% band) and average rank over the
    share of the horizon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5 * len(results), 8), squeeze=False)
    for k, r in enumerate(results):
        names = [n for n in r["policies"] if n not in {a for a, _ in NULLS}]
        found = yardstick.over_time(r["repetitions_data"], names)
        top, bottom = axes[0][k], axes[1][k]
        for name in names:
            top.plot(found["shares"], found[name]["iqm"], label=name)
            top.fill_between(found["shares"], found[name]["low"], found[name]["high"],
                             alpha=0.15)
            bottom.plot(found["shares"], found[name]["rank"], label=name)
        top.set_title(f"{where(r)}: {r['mode']}, {r['budget']} x {r['workers']}, "
                      f"{r['repetitions']} worlds", fontsize=9)
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xlabel("share of the horizon")
        top.set_ylabel("normalized regret, IQM and 95% band")
        bottom.set_ylabel("average rank (1 best)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plot, dpi=90)


def reality(real_path: Path, table_path: Path) -> str:
    """The real runs of benchmarks/results/search_quality.json on the table's CPU kind replayed with
    their seeds and budget: each tool's wall time and best, real against replayed."""
    real, table = stored.read(real_path), stored.read(table_path)
    curves = Curves(table)
    facts = measured(real, table["machine"])
    # Those runs' hpo ran the median pruner, the default of the time.
    study = study_files.load(study_files.study_path("demo"), list(REAL_PRUNER))
    ground = Ground(study, curves, facts)
    runs = [r for r in real["runs"] if r["label"] == "default"
            and r.get("machine", real["machine"]) == table["machine"]]
    lines = ["| seed | tool | real wall | replayed wall | ratio | real best | replayed best "
             "| MiniLM trials real / replayed | pruned real / replayed |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    budget = real["n_trials"]
    for seed in sorted({r["seed"] for r in runs}):
        chosen = {p.name: (p, searches) for p, searches in policies(
            [r["tool"] for r in runs if r["seed"] == seed], ground, seed)}
        for run in (r for r in runs if r["seed"] == seed):
            policy, searches = chosen[run["tool"]]
            trials = simulate(policy, curves, seed, 1, budget=budget,
                              searches_batches=searches)
            mine = wall(trials)
            theirs = run.get("trial_budget_wall") or sum(run["walls"])
            first = sorted(run["trials"], key=lambda t: t["number"])[:budget]
            real_best = max((t["value"] for t in first if t["state"] == "COMPLETE"),
                            default=None)
            large = sum("MiniLM" in t["model"] for t in first), sum(
                "MiniLM" in t.config.model for t in trials)
            pruned = sum(t["state"] != "COMPLETE" for t in first), sum(
                t.state != "COMPLETE" for t in trials)
            lines.append(f"| {seed} | {run['tool']} | {theirs:.0f} s | {mine:.0f} s | "
                         f"{mine / theirs:.2f} | {fmt(real_best)} | "
                         f"{fmt(best_by(trials, math.inf))} | {large[0]} / {large[1]} | "
                         f"{pruned[0]} / {pruned[1]} |")
    return "\n".join(lines)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def world_set(text: str) -> frozenset[int]:
    """`1-22,36,70-84`: a set of worlds (seeds), as --worlds takes it."""
    worlds: set[int] = set()
    for part in text.split(","):
        found = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if found is None:
            raise argparse.ArgumentTypeError(f"{part!r} is not a world or A-B")
        first, last = int(found[1]), int(found[2] or found[1])
        if last < first:
            raise argparse.ArgumentTypeError(f"{part!r}: A-B with A <= B")
        worlds.update(range(first, last + 1))
    return frozenset(worlds)


def parser() -> argparse.ArgumentParser:
    found = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    found.add_argument("--table", type=Path, nargs="+", default=[TABLE],
                       help="tables: the demo's .json, or .jsonl files in the replay format; "
                       "world k searches table k mod their number")
    found.add_argument("--mode", choices=("compute", "trials"), default="compute")
    found.add_argument("--budget", type=int, default=20,
                       help="trials per search (compute mode: the novice's, for the horizon)")
    found.add_argument("--horizon", type=float, help="compute mode's horizon in seconds")
    found.add_argument("--horizons-from", type=Path, metavar="OUTPUT.json",
                       help="compute mode: the per-table horizons of an earlier output (one "
                       "setting's worlds run in chunks)")
    found.add_argument("--workers", type=int, default=1)
    found.add_argument("--repetitions", type=int, default=100, help="worlds")
    found.add_argument("--first-seed", type=int, default=0,
                       help="reporting seeds from 0, tuning seeds from 1000")
    found.add_argument("--jobs", type=int, default=1, help="processes for the worlds")
    found.add_argument("--epochs", type=int, help="the demo study's epochs (default: the "
                       "table's)")
    found.add_argument("--policies", nargs="*", default=[*PEERS, *(a for a, _ in NULLS)])
    found.add_argument("--variant", dest="variants", type=variant, action="append",
                       default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE...]",
                       help="also hpo with these overrides, as a peer named NAME")
    found.add_argument("--hpo-set", dest="hpo_sets", action="append", default=[],
                       metavar="KEY=VALUE", help="hpo's defaults changed so; the peers, "
                       "those built on hpo too, keep the study file's")
    found.add_argument("--surrogate", type=Path, metavar="YAHPO_DATA",
                       help="LCBench's tables (replay_lcbench.py) answered by YAHPO's "
                       "surrogate at each suggested point, not by the nearest of their "
                       "recorded runs: a clone of slds-lmu/yahpo_data")
    found.add_argument("--own-draws", action="store_true",
                       help="seed each peer's TPE once, as before 2026-12-06, rather than "
                            "per trial as hpo's (shared start-up draws)")
    found.add_argument("--exact-tpe", action="store_true",
                       help="Optuna's own _log_ndtr in TPE (slower; the same figures)")
    found.add_argument("--even-costs", nargs="*", choices=EVEN_PARTS, metavar="PART",
                       help="the demo: every tool's trials cost hpo's, and hpo searches no "
                       "batch: the searches alone; or only the PARTs named of "
                       f"{', '.join(EVEN_PARTS)}")
    found.add_argument("--real", type=Path, default=REAL,
                       help="real runs: the peers' start-up and slowdowns on the demo")
    found.add_argument("--output", type=Path)
    found.add_argument("--merge", type=Path, nargs="+", metavar="OUTPUT.json",
                       help="write to --output these outputs' worlds as one (chunks of one "
                       "setting, disjoint seeds)")
    found.add_argument("--worlds", type=world_set, metavar="A-B[,C...]",
                       help="with --merge: only these worlds (seeds)")
    found.add_argument("--join", type=Path, nargs="+", metavar="OUTPUT.json",
                       help="write to --output these outputs' policies as one (runs of the "
                       "same worlds, different policies)")
    found.add_argument("--rename", nargs="+", default=[], metavar="OLD=NEW",
                       help="with --join: relabel policies (new=hpo hpo=hpo-stop)")
    found.add_argument("--render", type=Path, nargs="+",
                       help="write the table of these outputs (and --plot) instead")
    found.add_argument("--plot", type=Path)
    found.add_argument("--blocks", type=int, metavar="WORLDS",
                       help="with --render: the null checks over each WORLDS consecutive "
                       "worlds and over all, instead")
    found.add_argument("--reality", action="store_true",
                       help="replay the real runs of --real on the demo table's CPU kind")
    return found


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.reality:
        print(reality(args.real, args.table[0]))
        return
    if args.render:
        if args.blocks is not None and args.blocks < 1:
            parser().error("--blocks must be at least 1")
        print(render_blocks(args.render, args.blocks) if args.blocks
              else render(args.render, args.plot))
        return
    if args.worlds is not None and not args.merge:
        parser().error("--worlds goes with --merge")
    if args.merge:
        if args.output is None:
            parser().error("--merge needs --output")
        merged = merge([stored.read(p) for p in args.merge], args.worlds)
        stored.write_text(args.output, json.dumps(merged, separators=(",", ":")))
        print(f"{merged['repetitions']} worlds from {len(args.merge)} outputs in {args.output}")
        return
    if args.join:
        renames = dict(item.split("=", 1) for item in args.rename if "=" in item)
        if args.output is None or len(renames) != len(args.rename):
            parser().error("--join needs --output, and --rename OLD=NEW pairs")
        joined = join([stored.read(p) for p in args.join], renames)
        stored.write_text(args.output, json.dumps(joined, separators=(",", ":")))
        print(f"{len(joined['policies'])} policies from {len(args.join)} outputs in "
              f"{args.output}")
        return
    if min(args.budget, args.workers, args.repetitions, args.jobs) < 1:
        parser().error("--budget, --workers, --repetitions and --jobs must be at least 1")
    missing = [p for p in args.table if not p.is_file()]
    if missing:
        parser().error(f"no table at {missing[0]}")
    for path in (p for p in args.table if p.suffix == ".jsonl"):
        try:
            tables.read(path)
        except (ValueError, KeyError) as error:  # json's errors are ValueErrors
            parser().error(f"table {path}: {error}")
    if args.surrogate and not (args.surrogate / "lcbench" / "model.onnx").is_file():
        parser().error(f"--surrogate {args.surrogate}: no lcbench/model.onnx there (a clone "
                       "of slds-lmu/yahpo_data)")
    if set(args.policies) & set(peer_syne.METHODS) and not peer_syne.available():
        parser().error(f"the Syne Tune peers need Syne Tune at {peer_syne.PYTHON}: "
                       "python3 -m venv .venv-syne && .venv-syne/bin/pip install -r "
                       "benchmarks/peers/syne.txt (or leave it out of --policies)")
    result = run(args)
    for peer, f in [*result["versus"].items(), *result["nulls"].items()]:
        print(f"{args.mode}, {args.budget} x {args.workers}, {peer}: auc_ratio "
              f"{f['auc_ratio']:.3f} ({span(f['auc_ratio_interval'], 3)}), final regret "
              f"diff {f['final_regret_diff']:+.3f}, G1 strict {f['g1_strict']:.2f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        stored.write_text(args.output, json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
