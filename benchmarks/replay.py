"""Search policies replayed in simulated time on the table of real learning curves
(benchmarks/learning_curves.py): many repetitions of a 200-trial, 8-worker search in
minutes, where a real one takes GPU-days.

    python benchmarks/replay.py --budget 20 --workers 1 --repetitions 100 --first-seed 0 \\
        --output benchmarks/replay-20x1.json
    python benchmarks/replay.py --render benchmarks/replay-20x1.json ...   # table and plot
    python benchmarks/replay.py --reality benchmarks/search_quality.json   # against real runs

The simulation (`simulate`): W workers, each asking its policy for a trial when it is free;
a trial's epochs end at the times its learning curve gives, and at each epoch's end the
policy hears the score and may stop the trial (a pruner, ASHA). Events are taken in time
order, so a policy asking at time t sees exactly the reports made before t, as it would on
a real fleet. Every policy drives Optuna through ask/tell on an in-memory storage, or Ray
Tune's own `OptunaSearch` and `ASHAScheduler` objects, called as Ray's controller calls them.

The surrogate (`Curves.lookup`): a configuration's curve is interpolated linearly in the
logarithm of the learning rate between the two nearest grid rates, at the nearest weight
decay of the grid, for its model, precision and batch. Repetition k draws, per grid point,
which recorded training seed it reads (seeded by k), so the paired repetitions of all
policies search the same world, and the worlds vary between repetitions as training noise
does.

Costs: each epoch costs its recorded seconds; a trial's set-up (model load and the like)
its recorded seconds, plus the tokenization where its worker has not tokenized that model
yet, plus the batch search where the study has no batch limit cached for its model and
precision (hpo's cache as on a GPU, where a model's first search reaches the physical limit;
it costs the table's search at that bound). The peers' trials cost the table's seconds times
their measured slowdown against hpo on the table's CPU kind, per model, and every worker
starts after its tool's measured start-up (both from benchmarks/search_quality.json);
`--even-costs` prices every tool as hpo and hpo's batch searches as free, to compare the
searches alone. Not simulated: the samplers' own seconds (below 0.1 s per trial, against
10-60 s trials).
"""

from __future__ import annotations

import argparse
import bisect
import concurrent.futures
import functools
import hashlib
import heapq
import itertools
import json
import math
import statistics
import sys
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import optuna
import yaml
from optuna.trial import TrialState
from search_quality import MEDIAN_STARTUP, MEDIAN_WARMUP, variant

from hpo import config as config_module
from hpo import study_files
from hpo.space import PinnedSpace, by_cost, declare, suggest
from hpo.study import make_pruner, make_sampler

HERE = Path(__file__).resolve().parent
TABLE = HERE / "learning_curves.json"
REAL = HERE / "search_quality.json"
REAL_PRUNER = ("study.pruner.name=median", "study.pruner.n_startup_trials=4",
               "study.pruner.n_warmup_steps=1")
optuna.logging.set_verbosity(optuna.logging.WARNING)
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Curve:
    scores: tuple[float, ...]  # validation macro-F1 per epoch
    seconds: tuple[float, ...]  # per epoch, steps and scoring
    setup: float  # before the first epoch, less tokenization and batch search


@dataclass(frozen=True)
class Costs:
    """One-off costs the table measured: a model's first tokenization on a worker, and a
    batch search per model, precision and batch bound."""
    tokenization: dict[str, float]
    batch_search: dict[tuple[str, str, int], float]


class Table(Protocol):
    """What `simulate` reads of a table: a configuration's curve in a world, and the
    one-off costs a worker and a study pay."""
    costs: Costs
    max_physical: int

    def curve(self, config: Any, world: int) -> Curve: ...


class Curves:
    """The table, looked up by configuration for one repetition's world."""

    def __init__(self, table: dict, max_physical: int = 32) -> None:
        self.table, self.epochs = table, table["epochs"]
        self.train_size = table["train_size"]
        columns = table["columns"]
        self.rows = [dict(zip(columns, row, strict=True)) for row in table["rows"]]
        self.max_physical = max_physical
        self.by_point: dict[tuple, list[dict]] = {}
        for row in self.rows:
            point = (row["model"], row["precision"], row["batch"], row["weight_decay"],
                     row["learning_rate"])
            self.by_point.setdefault(point, []).append(row)
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
        digest = hashlib.sha256(f"{world}:{point}".encode()).digest()
        return rows[int.from_bytes(digest[:4], "little") % len(rows)]

    def curve(self, config: Config, world: int) -> Curve:
        """What `simulate` reads: a trial's curve (benchmarks/replay_lcbench.py has
        another table behind the same method)."""
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


# ---------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Config:
    model: str
    precision: str
    batch: int
    learning_rate: float
    weight_decay: float


class Running(Protocol):
    """A trial a policy started: it hears each epoch's score and may stop it."""
    config: Config

    def report(self, epoch: int, score: float) -> bool: ...  # True: stop here

    def finish(self, scores: list[float], stopped: bool) -> None: ...


class Policy(Protocol):
    name: str
    startup: float  # seconds before a worker's first trial
    gap: float  # seconds between a trial's end and the worker's next trial

    def ask(self) -> Running: ...

    def slowdown(self, model: str) -> float: ...  # its trial seconds over hpo's


@dataclass
class OptunaRunning:
    study: optuna.Study
    trial: optuna.Trial
    config: Config
    report_value: Callable[[list[float]], float]
    step_of: Callable[[int, Config], int]
    epochs: int
    tell_value: Callable[[list[float]], float]
    scores: list[float] = field(default_factory=list)

    def report(self, epoch: int, score: float) -> bool:
        self.scores.append(score)
        self.trial.report(self.report_value(self.scores), self.step_of(epoch, self.config))
        return epoch < self.epochs and self.trial.should_prune()

    def finish(self, scores: list[float], stopped: bool) -> None:
        if stopped:
            self.study.tell(self.trial, state=TrialState.PRUNED)
        else:
            self.study.tell(self.trial, self.tell_value(scores))


def best(scores: list[float]) -> float:
    return max(scores)


def last(scores: list[float]) -> float:
    return scores[-1]


def by_epoch(epoch: int, _config: Config) -> int:
    return epoch


@dataclass
class OptunaPolicy:
    """A policy that is an Optuna study: hpo's own, or a user's glue around the Trainer."""
    name: str
    study: optuna.Study
    sample: Callable[[optuna.Trial], Config]
    epochs: int
    startup: float = 0.0
    slowdowns: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    report_value: Callable[[list[float]], float] = best
    tell_value: Callable[[list[float]], float] = best
    step_of: Callable[[int, Config], int] = by_epoch
    sampler_for: Callable[[int], optuna.samplers.BaseSampler] | None = None

    def ask(self) -> Running:
        trial = self.study.ask()
        if self.sampler_for is not None:
            # As hpo's worker does: one sampler per trial, seeded by the trial's number.
            self.study.sampler = self.sampler_for(trial.number)
        return OptunaRunning(self.study, trial, self.sample(trial), self.report_value,
                             self.step_of, self.epochs, self.tell_value)

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


def hpo_policy(study_config: config_module.StudyConfig, curves: Curves, seed: int,
               name: str = "hpo", startup: float = 0.0, gap: float = 0.0) -> OptunaPolicy:
    """hpo's defaults as `hpo run` builds them: its sampler (seeded per trial), pruner,
    enqueued sets, space and precision rule, from hpo's own functions."""
    config = with_overrides(study_config, f"study.sampler.seed={seed}")
    study = new_study(seed, make_sampler(config), make_pruner(config))
    for params in config.study.enqueue:
        study.enqueue_trial(dict(params), skip_if_exists=True)
    pinned = pinned_space(config, curves)
    rule = config.study.objective_epoch

    def sample(trial: optuna.Trial) -> Config:
        params = suggest(trial, pinned)
        return Config(params.model_name, params.fp_precision, params.target_effective_batch_size,
                      params.learning_rate, float(params.extras.get("weight_decay", 0.0)))

    value = best if rule == "best" else last
    return OptunaPolicy(name, study, sample, config.training.epochs, startup, gap=gap,
                        report_value=value, tell_value=value,
                        sampler_for=lambda number: make_sampler(config, number))


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


def plain_sample(space: config_module.SearchSpace, precision: str) -> Callable[[optuna.Trial],
                                                                               Config]:
    """A user's own objective: the study file's ranges, one precision."""
    decay = space.extras()["weight_decay"]

    def sample(trial: optuna.Trial) -> Config:
        model = trial.suggest_categorical("model_name", space.model_name)
        batch = trial.suggest_categorical("batch", space.target_effective_batch_size)
        rate = trial.suggest_float("learning_rate", space.learning_rate.low,
                                   space.learning_rate.high, log=space.learning_rate.log)
        wd = trial.suggest_float("weight_decay", decay.low, decay.high)
        return Config(model, precision, batch, rate, wd)

    return sample


@dataclass
class RayRunning:
    """A trial under Ray Tune's `OptunaSearch` and `ASHAScheduler`, called in the order
    Ray's controller calls them for each result and at the trial's end."""
    policy: RayPolicy
    trial_id: str
    config: Config
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
    """Ray Tune: ASHA (grace 1 epoch, reduction factor 2, at most the study's epochs) with
    Optuna's TPE as `OptunaSearch`, as benchmarks/peer_ray.py sets them up."""
    name: str
    space: config_module.SearchSpace
    precision: str
    seed: int
    epochs: int
    n_startup_trials: int
    startup: float = 0.0
    slowdowns: dict[str, float] = field(default_factory=dict)
    gap: float = 0.0
    handles: dict[str, _RayTrial] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ray.tune.schedulers import ASHAScheduler
        from ray.tune.search.optuna import OptunaSearch

        sample = self.sample()
        self.searcher = OptunaSearch(
            space=lambda trial: sample(trial) and None, metric="objective", mode="max",
            sampler=optuna.samplers.TPESampler(seed=self.seed,
                                               n_startup_trials=self.n_startup_trials))
        self.scheduler = ASHAScheduler(metric="objective", mode="max", time_attr="epoch",
                                       max_t=self.epochs, grace_period=1, reduction_factor=2)

    def ask(self) -> Running:
        trial_id = str(len(self.handles))
        params = self.searcher.suggest(trial_id)
        self.handles[trial_id] = _RayTrial(trial_id)
        self.scheduler.on_trial_add(None, self.handles[trial_id])
        return RayRunning(self, trial_id, self.config_of(params))

    def sample(self) -> Callable[[optuna.Trial], Any]:
        """The define-by-run space OptunaSearch samples (replay_lcbench.py: another)."""
        return plain_sample(self.space, self.precision)

    def config_of(self, params: dict[str, Any]) -> Any:
        return Config(params["model_name"], self.precision, params["batch"],
                      params["learning_rate"], params["weight_decay"])

    def slowdown(self, model: str) -> float:
        return self.slowdowns.get(model, 1.0)


# ---------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Finished:
    start: float
    end: float
    config: Config
    scores: tuple[float, ...]
    state: str  # COMPLETE or PRUNED

    @property
    def value(self) -> float | None:
        """As every tool is scored: a COMPLETE trial's best epoch."""
        return max(self.scores) if self.state == "COMPLETE" else None


def simulate(policy: Policy, curves: Table, world: int, budget: int, workers: int,
             epochs: int, horizon: float = 0.0, searches_batches: bool = False
             ) -> list[Finished]:
    """The trials of one search, in the order they finished: `budget` trials, then more
    until `horizon` (simulated seconds) has passed."""
    events: list[tuple[float, int, int, int]] = []
    running: dict[int, tuple[Running, Curve, float, float]] = {}
    tokenized: list[set[str]] = [set() for _ in range(workers)]
    searched: set[tuple[str, str, int]] = set()
    finished: list[Finished] = []
    counter = 0

    def start(worker: int, now: float) -> None:
        nonlocal counter
        if counter >= budget and now >= horizon:
            return
        run = policy.ask()
        c = run.config
        curve = curves.curve(c, world)
        setup = curve.setup
        if c.model not in tokenized[worker]:
            tokenized[worker].add(c.model)
            setup += curves.costs.tokenization.get(c.model, 0.0)
        # hpo's first search per model and precision probes up to the physical limit.
        bound = (c.model, c.precision, curves.max_physical)
        if searches_batches and bound not in searched:
            searched.add(bound)
            setup += curves.costs.batch_search.get(bound, 0.0)
        factor = policy.slowdown(c.model)
        running[counter] = (run, curve, now, factor)
        heapq.heappush(events, (now + (setup + curve.seconds[0]) * factor, counter, worker, 1))
        counter += 1

    for worker in range(workers):
        start(worker, policy.startup)
    while events:
        now, number, worker, epoch = heapq.heappop(events)
        run, curve, began, factor = running[number]
        stop = run.report(epoch, curve.scores[epoch - 1])
        if epoch < epochs and not stop:
            heapq.heappush(events, (now + curve.seconds[epoch] * factor, number, worker,
                                    epoch + 1))
            continue
        pruned = stop and epoch < epochs
        run.finish(list(curve.scores[:epoch]), pruned)
        del running[number]
        finished.append(Finished(began, now, run.config, curve.scores[:epoch],
                                 "PRUNED" if pruned else "COMPLETE"))
        start(worker, now + policy.gap)
    return finished


def best_by(trials: list[Finished], moment: float) -> float | None:
    values = [t.value for t in trials if t.value is not None and t.end <= moment]
    return max(values) if values else None


def reached(trials: list[Finished], target: float) -> float:
    """When the best so far first reached `target` (infinite: never)."""
    return next((t.end for t in trials if t.value is not None and t.value >= target),
                math.inf)


def wall(trials: list[Finished], budget: int) -> float:
    """When the budget's last trial finished (trials in the order they started)."""
    return max(t.end for t in sorted(trials, key=lambda t: t.start)[:budget])


def steps_of(trials: list[Finished]) -> list[list[float]]:
    """The best-so-far curve as its steps: [time, best]."""
    out, top = [], -math.inf
    for trial in trials:
        if trial.value is not None and trial.value > top:
            top = trial.value
            out.append([round(trial.end, 2), round(top, 5)])
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


def even(facts: Measured, curves: Curves) -> Measured:
    """Every tool's trials priced as hpo's, for `--even-costs`: no slowdowns, hpo's start-up
    and gap for all, and hpo's batch searches free (`curves` changed so): what the searches
    alone make of a world, apart from what each tool costs around them."""
    curves.costs = replace(curves.costs, batch_search={})
    start, gap = facts.startup.get("hpo", 0.0), facts.gaps.get("hpo", 0.0)
    return Measured({tool: start for tool in facts.startup}, {}, facts.runs,
                    {tool: gap for tool in facts.gaps})


def short(model: str) -> str:
    return model.rsplit("/", 1)[-1]


# A prior-guided start from the literature: the fine-tuning rates BERT's paper recommends
# (2e-5 to 5e-5, batches 16 and 32; MiniLM's and sentence-transformers' recipes sit in the
# same range), enqueued for each model before TPE takes over.
PRIOR_RATES = (2.0e-5, 5.0e-5)


def policies(names: list[str], study: config_module.StudyConfig, curves: Curves, seed: int,
             facts: Measured, variants: dict[str, list[str]] | None = None
             ) -> list[tuple[Policy, bool]]:
    """Each named policy for repetition `seed`, and whether it searches batches as hpo;
    `variants` names hpo with `--set` overrides (candidate defaults)."""
    space = study.search_space
    fastest = min(curves.precisions, key=lambda p: sum(
        curves.seconds_per_epoch(m, p) for m in curves.models))
    sampler = study.study.sampler
    epochs = study.training.epochs
    slow = {tool: {m: facts.slowdowns.get(tool, {}).get(short(m), 1.0) for m in curves.models}
            for tool in ("novice", "expert", "ray")}

    def median(n_startup: int, warmup: int) -> optuna.pruners.MedianPruner:
        return optuna.pruners.MedianPruner(n_startup_trials=n_startup, n_warmup_steps=warmup)

    def study_of(sampler: optuna.samplers.BaseSampler,
                 pruner: optuna.pruners.BasePruner) -> optuna.Study:
        return new_study(seed, sampler, pruner)

    def steps(epoch: int, config: Config) -> int:
        # The Trainer reports at its global step: trials of different batches never share
        # a step, so the median pruner compares only trials of one batch.
        return epoch * (curves.train_size // config.batch)

    def override(*sets: str) -> config_module.StudyConfig:
        return with_overrides(study, *sets)

    prior = [{"model_name": m, "learning_rate": r} for m in space.model_name
             for r in PRIOR_RATES]

    def ours(config: config_module.StudyConfig, name: str) -> tuple[Policy, bool]:
        return hpo_policy(config, curves, seed, name, facts.startup.get("hpo", 0.0),
                          facts.gaps.get("hpo", 0.0)), True

    def glue(name: str, sampler: optuna.samplers.BaseSampler, precision: str,
             **how: Any) -> tuple[Policy, bool]:
        study = study_of(sampler, median(MEDIAN_STARTUP, MEDIAN_WARMUP))
        return OptunaPolicy(name, study, plain_sample(space, precision), epochs,
                            facts.startup.get(name, 0.0), slow[name], facts.gaps.get(name, 0.0),
                            report_value=last, tell_value=last, **how), False

    enqueue = "study.enqueue=" + yaml.safe_dump(prior, default_flow_style=True, width=math.inf)
    build: dict[str, Callable[[], tuple[Policy, bool]]] = {
        "hpo": lambda: ours(study, "hpo"),
        "novice": lambda: glue("novice", optuna.samplers.TPESampler(seed=seed), "none",
                               step_of=steps),
        "expert": lambda: glue("expert", optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=sampler.n_startup_trials), fastest),
        "ray": lambda: (RayPolicy("ray", space, fastest, seed, epochs,
                                  sampler.n_startup_trials, facts.startup.get("ray", 0.0),
                                  slow["ray"], facts.gaps.get("ray", 0.0)), False),
        "random": lambda: ours(override("study.sampler.name=random", "study.pruner.name=none"),
                               "random"),
        # Optuna's HyperbandPruner as it comes: the first rung at one epoch.
        "tpe-hyperband": lambda: ours(override("study.pruner.name=hyperband",
                                               "study.pruner.min_resource=1"), "tpe-hyperband"),
        "prior": lambda: ours(override(enqueue), "prior"),
    }
    # A variant named "hpo" replaces hpo's defaults (--hpo-set).
    for label, sets in (variants or {}).items():
        build[label] = functools.partial(lambda sets, label: ours(override(*sets), label),
                                         sets, label)
    unknown = [n for n in names if n not in build]
    if unknown:
        raise SystemExit(f"unknown policy {unknown[0]}: choose from {', '.join(build)}")
    return [build[name]() for name in names]


PEERS = ["novice", "expert", "ray", "random", "tpe-hyperband", "prior"]


# ---------------------------------------------------------------------------- the figures


def oracle(curves: Curves, world: int, epochs: int) -> float:
    """The best score any grid point reaches in this world: regret is counted from it."""
    return max(max(curves._row(point, world)["f1"][:epochs]) for point in curves.by_point)


def repetition(names: list[str], study: config_module.StudyConfig, curves: Curves,
               seed: int, *, budget: int, workers: int, facts: Measured,
               variants: dict[str, list[str]] | None = None) -> dict[str, dict]:
    """One paired repetition: every peer for `budget` trials, then hpo for `budget` trials
    and on until the slowest peer's wall time, all in world `seed`."""
    epochs = study.training.epochs
    out = race(policies(names, study, curves, seed, facts, variants), curves, seed,
               budget=budget, workers=workers, epochs=epochs)
    out["oracle"] = {"best": oracle(curves, seed, epochs)}
    return out


def race(chosen: list[tuple[Policy, bool]], curves: Table, world: int, *, budget: int,
         workers: int, epochs: int) -> dict[str, dict]:
    """Each policy's search in one world: every peer for `budget` trials, then hpo for
    `budget` trials and on until the slowest peer's wall time."""
    out: dict[str, dict] = {}
    for policy, searches in chosen:
        if policy.name == "hpo":
            continue
        trials = simulate(policy, curves, world, budget, workers, epochs,
                          searches_batches=searches)
        out[policy.name] = {"wall": round(wall(trials, budget), 2), "steps": steps_of(trials),
                            "pruned": sum(t.state == "PRUNED" for t in trials)}
    hpo, searches = next(p for p in chosen if p[0].name == "hpo")
    horizon = max((run["wall"] for run in out.values()), default=0.0)
    trials = simulate(hpo, curves, world, budget, workers, epochs, horizon=horizon,
                      searches_batches=searches)
    out["hpo"] = {"wall": round(wall(trials, budget), 2), "steps": steps_of(trials),
                  "pruned": sum(t.state == "PRUNED" for t in trials[:budget])}
    return out


def at(steps: list[list[float]], moment: float) -> float | None:
    values = [best for time, best in steps if time <= moment]
    return values[-1] if values else None


def when(steps: list[list[float]], target: float) -> float:
    return next((time for time, best in steps if best >= target), math.inf)


def versus(reps: list[dict], peer: str) -> dict[str, Any]:
    """G1 and G2 of hpo against `peer` over paired repetitions."""
    wins = ties = 0
    shares = []
    for rep in reps:
        theirs, ours = rep[peer], rep["hpo"]
        final = theirs["steps"][-1][1] if theirs["steps"] else None
        mine = at(ours["steps"], theirs["wall"])
        if final is None or (mine is not None and mine > final):
            wins += 1
        elif mine is not None and mine == final:
            ties += 1
        shares.append(0.0 if final is None else when(ours["steps"], final) / theirs["wall"])
    n = len(reps)
    return {"g1": round((wins + ties) / n, 3), "g1_strict": round(wins / n, 3),
            "ties": round(ties / n, 3), "g2_median": statistics.median(shares),
            "never": sum(math.isinf(s) for s in shares),
            "g1_interval": share_interval(wins + ties, n),
            "g2_interval": median_interval(shares)}


def share_interval(hits: int, n: int, confidence: float = 0.95) -> list[float]:
    """Wilson's interval for the share `hits`/`n` of paired repetitions: what 100
    repetitions can tell a G1 of 0.67 from the goal's 0.8."""
    import scipy.stats

    found = scipy.stats.binomtest(hits, n).proportion_ci(confidence, method="wilson")
    return [round(found.low, 3), round(found.high, 3)]


def median_interval(values: list[float], confidence: float = 0.95) -> list[float] | None:
    """A distribution-free interval for the median of `values` (infinities included): the
    order statistics that binomial(n, 1/2) puts the median between; None where even the
    smallest and largest value hold it with less than `confidence` (5 values or fewer)."""
    import scipy.stats

    ordered, n = sorted(values), len(values)
    low = int(scipy.stats.binom.ppf((1 - confidence) / 2, n, 0.5))
    return None if low < 1 else [ordered[low - 1], ordered[n - low]]


def repeat(one: Callable[[int], dict], seeds: range, jobs: int) -> list[dict]:
    """`one(seed)` for every seed, in seed order. Repetitions are independent (each its own
    seeded world and samplers): they run on `jobs` processes, whatever finishes first."""
    reps = []
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        for k, rep in enumerate(pool.map(one, seeds), 1):
            reps.append(rep)
            if k % 10 == 0:
                print(f"  {k}/{len(seeds)} repetitions", file=sys.stderr, flush=True)
    return reps


def run(args: argparse.Namespace) -> dict:
    table = json.loads(args.table.read_text())
    curves = Curves(table)
    study = study_files.load(study_files.study_path("demo"),
                               [f"training.epochs={args.epochs or table['epochs']}"])
    facts = measured(json.loads(args.real.read_text()), table["machine"])
    if args.even_costs:
        facts = even(facts, curves)
    variants = dict(args.variants)
    names = ["hpo", *[p for p in args.policies if p != "hpo"], *variants]
    if args.hpo_sets:
        # A candidate default scored as hpo itself against every peer, run to their wall.
        variants["hpo"] = args.hpo_sets
    one = functools.partial(repetition, names, study, curves, budget=args.budget,
                            workers=args.workers, facts=facts, variants=variants)
    reps = repeat(one, range(args.first_seed, args.first_seed + args.repetitions), args.jobs)
    return {
        "budget": args.budget, "workers": args.workers, "repetitions": args.repetitions,
        "first_seed": args.first_seed, "epochs": study.training.epochs,
        "hpo_sets": args.hpo_sets, "even_costs": args.even_costs,
        "table": {"file": args.table.name, "machine": table["machine"], "dates": table["dates"],
                  "rows": len(table["rows"]), "seeds": sorted({r[5] for r in table["rows"]})},
        "measured": {"startup": facts.startup, "slowdowns": facts.slowdowns,
                     "gaps": facts.gaps, "runs": facts.runs},
        "versus": {peer: versus(reps, peer) for peer in names if peer != "hpo"},
        "repetitions_data": reps,
    }


def regret_curves(result: dict, points: int = 200) -> tuple[list[float], dict[str, Any]]:
    """Per policy, the regret (the world's best grid score less the best found so far) at
    `points` times: its interquartile mean over repetitions and a bootstrap 95% band."""
    import numpy as np

    reps = result["repetitions_data"]
    names = [n for n in reps[0] if n != "oracle"]
    end = max(rep[n]["wall"] for rep in reps for n in names)
    times = np.linspace(0, end, points)
    rng = np.random.default_rng(0)
    out = {}
    for name in names:
        regret = np.array([[rep["oracle"]["best"] - (at(rep[name]["steps"], t) or 0.0)
                            for t in times] for rep in reps])
        boot = np.array([iqm(regret[rng.integers(0, len(reps), len(reps))])
                         for _ in range(200)])
        out[name] = (iqm(regret), np.percentile(boot, 2.5, axis=0),
                     np.percentile(boot, 97.5, axis=0))
    return list(times), out


def iqm(values: Any) -> Any:
    """The interquartile mean over the first axis (rliable's aggregate): the mean of the
    middle half, a quarter cut from each end."""
    import numpy as np

    ordered = np.sort(values, axis=0)
    cut = int(0.25 * len(ordered))
    return ordered[cut:len(ordered) - cut].mean(axis=0)


def render(paths: list[Path], plot: Path | None) -> str:
    lines = ["| setting | peer | G1 (ties) | G1 95% | G1 strict | median G2 | G2 95% "
             "| never reached |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    results = [json.loads(p.read_text()) for p in paths]

    def interval(bounds: list[float] | None) -> str:
        return "-" if bounds is None else f"{bounds[0]:.2f}-{bounds[1]:.2f}"

    for r in results:
        setting = f"{r['budget']} trials x {r['workers']}"
        for peer, f in r["versus"].items():
            lines.append(f"| {setting} | {peer} | {f['g1']:.2f} ({f['ties']:.2f}) | "
                         f"{interval(f.get('g1_interval'))} | {f['g1_strict']:.2f} | "
                         f"{f['g2_median']:.2f} | {interval(f.get('g2_interval'))} | "
                         f"{f['never']} |")
    if plot is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
        for ax, r in zip(axes[0], results, strict=True):
            times, curves = regret_curves(r)
            hours = [t / 3600 for t in times]
            for name, (mean, low, high) in curves.items():
                ax.plot(hours, mean, label=name)
                ax.fill_between(hours, low, high, alpha=0.2)
            ax.set_title(f"{r['budget']} trials on {r['workers']} worker(s), "
                         f"{r['repetitions']} repetitions")
            ax.set_xlabel("simulated hours")
            ax.set_ylabel(f"regret ({r.get('score', 'macro-F1')}), IQM and 95% band")
            ax.set_yscale("log")
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
    return "\n".join(lines)


def reality(real_path: Path, table_path: Path) -> str:
    """The real runs of benchmarks/search_quality.json on the table's CPU kind replayed with
    their seeds and budget: each tool's wall time and best, real against replayed."""
    real, table = json.loads(real_path.read_text()), json.loads(table_path.read_text())
    curves = Curves(table)
    facts = measured(real, table["machine"])
    # Those runs' hpo ran the median pruner, the default of the time.
    study = study_files.load(study_files.study_path("demo"), list(REAL_PRUNER))
    runs = [r for r in real["runs"] if r["label"] == "default"
            and r.get("machine", real["machine"]) == table["machine"]]
    lines = ["| seed | tool | real wall | replayed wall | ratio | real best | replayed best "
             "| MiniLM trials real / replayed | pruned real / replayed |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    budget = real["n_trials"]
    for seed in sorted({r["seed"] for r in runs}):
        chosen = dict((p.name, (p, searches)) for p, searches in policies(
            [r["tool"] for r in runs if r["seed"] == seed], study, curves, seed, facts))
        for run in (r for r in runs if r["seed"] == seed):
            policy, searches = chosen[run["tool"]]
            trials = simulate(policy, curves, seed, budget, 1, study.training.epochs,
                              searches_batches=searches)
            mine = wall(trials, budget)
            theirs = run.get("trial_budget_wall") or sum(run["walls"])
            first = sorted(run["trials"], key=lambda t: t["number"])[:budget]
            real_best = max((t["value"] for t in first if t["state"] == "COMPLETE"),
                            default=None)
            ran = sorted(trials, key=lambda t: t.start)[:budget]
            large = sum("MiniLM" in t["model"] for t in first), sum(
                "MiniLM" in t.config.model for t in ran)
            pruned = sum(t["state"] != "COMPLETE" for t in first), sum(
                t.state != "COMPLETE" for t in ran)
            lines.append(f"| {seed} | {run['tool']} | {theirs:.0f} s | {mine:.0f} s | "
                         f"{mine / theirs:.2f} | {fmt(real_best)} | "
                         f"{fmt(best_by(ran, math.inf))} | {large[0]} / {large[1]} | "
                         f"{pruned[0]} / {pruned[1]} |")
    return "\n".join(lines)


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=20, help="trials per search")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repetitions", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="processes for the repetitions")
    parser.add_argument("--epochs", type=int, help="the study's epochs (default: the table's)")
    parser.add_argument("--policies", nargs="*", default=PEERS)
    parser.add_argument("--variant", dest="variants", type=variant, action="append",
                        default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE...]",
                        help="also hpo with these overrides, as a peer named NAME")
    parser.add_argument("--hpo-set", dest="hpo_sets", action="append", default=[],
                        metavar="KEY=VALUE", help="hpo's defaults changed so; the peers, "
                        "those built on hpo too, keep the study file's")
    parser.add_argument("--even-costs", action="store_true",
                        help="every tool's trials cost hpo's, and hpo searches no batch: "
                        "the searches alone")
    parser.add_argument("--table", type=Path, default=TABLE)
    parser.add_argument("--real", type=Path, default=REAL,
                        help="real runs: the peers' start-up and slowdowns")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--render", type=Path, nargs="+",
                        help="write the table of these outputs (and --plot) instead")
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--reality", action="store_true",
                        help="replay the real runs of --real on the table's CPU kind")
    args = parser.parse_args(argv)
    if args.reality:
        print(reality(args.real, args.table))
        return
    if args.render:
        print(render(args.render, args.plot))
        return
    if min(args.budget, args.workers, args.repetitions, args.jobs) < 1:
        parser.error("--budget, --workers, --repetitions and --jobs must be at least 1")
    result = run(args)
    for peer, figures in result["versus"].items():
        print(f"{args.budget} trials x {args.workers} workers, hpo vs {peer}: "
              f"G1 {figures['g1']:.2f} (ties {figures['ties']:.2f}), "
              f"median G2 {figures['g2_median']:.2f}")
    if args.output:
        args.output.write_text(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
