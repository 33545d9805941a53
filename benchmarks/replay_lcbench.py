"""hpo's search defaults against the peers on a second table, from public data: YAHPO Gym's
LCBench surrogate (Pfisterer et al., 2022), learning curves of 2,000 MLP configurations
trained 52 epochs on each of 34 OpenML tasks (Zimmer et al., 2021). A check that a default
chosen on the demo's table (benchmarks/replay.py) is no artefact of the demo.

    git clone https://github.com/slds-lmu/yahpo_data ../yahpo_data   # Apache 2.0
    pip install -e '.[bench]'      # onnxruntime reads the surrogate
    python benchmarks/replay_lcbench.py --data ../yahpo_data --budget 20 --workers 1 \\
        --repetitions 100 --jobs 2 --output benchmarks/replay_lcbench_20x1.json
    python benchmarks/replay.py --render benchmarks/replay_lcbench_20x1.json ...

The same simulation as replay.py (`simulate`, `race`, `versus`), on another table: world k
is LCBench task k mod 34; a trial's curve is the surrogate's validation accuracy at each of
52 epochs, its epochs' seconds the surrogate's time (made monotone). Every policy pays the
same per trial: no set-up, start-up or per-tool slowdown, so only the search differs. The
regret is counted from the best of 2,000 random configurations of the task (at any epoch)
or anything a policy found, whichever is higher.

The surrogate is read with onnxruntime directly, with YAHPO Gym's input encoding (its
`_config_to_xs`: the task id integer-encoded by encoding.json, the other values as they are
in the order of `cont_names`); yahpo-gym itself pins numpy below 2 and ConfigSpace 0.6, which
Ray and hpo's other benchmarks cannot share an environment with. Checked against yahpo-gym
1.0.2: the same outputs for 45 configurations and epochs on 3 tasks (benchmarks/README.md).

The policies, each through its own library's code, with the settings each would use on a
new study (hpo: its schema's defaults, not the demo file's):
- `hpo`: `make_sampler` and `make_pruner` of a study with hpo's default sampler and pruner
  sections (TPE, multivariate, constant liar, 10 start-up trials, reseeded per trial;
  successive halving from epoch 1, reduction factor 3), its best epoch reported and told;
- `expert`: TPE with 10 start-up trials, the median pruner (4 start-up trials, 1 warm-up
  epoch) at epoch ends, the last epoch told;
- `novice`: Optuna's default TPE, no pruner (`Trainer.hyperparameter_search`'s defaults;
  the Trainer's steps differ between batch sizes, so its median pruner compares nothing);
- `ray`: Ray Tune's `OptunaSearch` (TPE, 10 start-up trials) and `ASHAScheduler` (grace 1
  epoch, reduction factor 2, at most 52 epochs);
- `random`: hpo with `sampler.name: random`, no pruner;
- `tpe-hyperband`: hpo with `pruner.name: hyperband`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from replay import (
    Costs,
    Curve,
    OptunaPolicy,
    Policy,
    RayPolicy,
    best,
    last,
    new_study,
    race,
    repeat,
    versus,
    with_overrides,
)
from search_quality import MEDIAN_STARTUP, MEDIAN_WARMUP, variant

from hpo import config as config_module
from hpo import study_files
from hpo.study import make_pruner, make_sampler

EPOCHS = 52
# The surrogate's inputs (YAHPO Gym's `cont_names` for lcbench, in its order) and outputs.
INPUTS = ("epoch", "batch_size", "learning_rate", "momentum", "weight_decay", "num_layers",
          "max_units", "max_dropout")
OUTPUTS = ("time", "val_accuracy", "val_cross_entropy", "val_balanced_accuracy",
           "test_cross_entropy", "test_balanced_accuracy")
# LCBench's search space (the surrogate's config_space.json, less the task and the epoch):
# (low, high, log, integer).
SPACE = {"batch_size": (16, 512, True, True), "learning_rate": (1e-4, 1e-1, True, False),
         "momentum": (0.1, 0.99, False, False), "weight_decay": (1e-5, 0.1, False, False),
         "num_layers": (1, 5, False, True), "max_units": (64, 1024, True, True),
         "max_dropout": (0.0, 1.0, False, False)}
ORACLE_SAMPLES = 2000


@dataclass(frozen=True)
class Mlp:
    """One LCBench configuration, shaped as `simulate` reads a configuration: no model or
    precision of its own, so no per-model costs."""
    params: tuple[tuple[str, float], ...]
    model: str = "mlp"
    precision: str = "none"


def sample(trial: optuna.trial.BaseTrial) -> Mlp:
    values = []
    for name, (low, high, log, integer) in SPACE.items():
        value = (trial.suggest_int(name, low, high, log=log) if integer
                 else trial.suggest_float(name, low, high, log=log))
        values.append((name, float(value)))
    return Mlp(tuple(values))


Evaluate = Callable[[str, list[dict[str, float]]], list[dict[str, float]]]


def onnx_surrogate(data: Path) -> Evaluate:
    """The surrogate of `data`/lcbench: for a task and configurations (each with its epoch),
    their outputs."""
    import numpy as np
    import onnxruntime

    folder = data / "lcbench"
    codes = json.loads((folder / "encoding.json").read_text())["OpenML_task_id"]
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1  # --jobs processes
    session = onnxruntime.InferenceSession(str(folder / "model.onnx"), options)

    def evaluate(task: str, configs: list[dict[str, float]]) -> list[dict[str, float]]:
        x_cat = np.full((len(configs), 1), codes[task], dtype=np.int32)
        x_cont = np.array([[c[k] for k in INPUTS] for c in configs], dtype=np.float32)
        out = session.run(None, {"x_cat": x_cat, "x_cont": x_cont})[0]
        return [dict(zip(OUTPUTS, map(float, row), strict=True)) for row in out]

    return evaluate


@dataclass
class Surrogate:
    """The LCBench table as `simulate` reads one: world k is task k mod the tasks."""
    evaluate: Evaluate
    tasks: tuple[str, ...]
    costs: Costs = field(default_factory=lambda: Costs({}, {}))
    max_physical: int = 0
    _oracles: dict[str, float] = field(default_factory=dict)
    _curves: dict[tuple[Mlp, str], Curve] = field(default_factory=dict)

    def task(self, world: int) -> str:
        return self.tasks[world % len(self.tasks)]

    def curve(self, config: Mlp, world: int) -> Curve:
        key = (config, self.task(world))
        if key not in self._curves:
            self._curves[key] = self._read(config, key[1])
        return self._curves[key]

    def _read(self, config: Mlp, task: str) -> Curve:
        params = dict(config.params)
        rows = self.evaluate(task, [{**params, "epoch": e} for e in range(1, EPOCHS + 1)])
        # The surrogate's cumulative time is not always increasing: each epoch takes at
        # least a millisecond.
        seconds, done = [], 0.0
        for row in rows:
            seconds.append(max(row["time"] - done, 1e-3))
            done = max(done, row["time"])
        return Curve(tuple(r["val_accuracy"] / 100 for r in rows), tuple(seconds), 0.0)

    def oracle(self, world: int) -> float:
        """The best of `ORACLE_SAMPLES` random configurations of the world's task, at any
        epoch: what regret is counted from."""
        task = self.task(world)
        if task not in self._oracles:
            rng = random.Random(f"oracle:{task}")
            configs = [random_params(rng) for _ in range(ORACLE_SAMPLES)]
            rows = self.evaluate(task, [{**c, "epoch": e} for c in configs
                                        for e in range(1, EPOCHS + 1)])
            self._oracles[task] = max(r["val_accuracy"] / 100 for r in rows)
        return self._oracles[task]


def random_params(rng: random.Random) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (low, high, log, integer) in SPACE.items():
        value = (math.exp(rng.uniform(math.log(low), math.log(high))) if log
                 else rng.uniform(low, high))
        out[name] = min(max(round(value), low), high) if integer else value
    return out


def default_study() -> config_module.StudyConfig:
    """A study with hpo's own default sampler and pruner (the schema's), for 52 epochs."""
    study = study_files.load(study_files.study_path("demo"), [f"training.epochs={EPOCHS}"])
    raw = study.model_dump(mode="json")
    raw["study"]["sampler"] = config_module.SamplerConfig().model_dump(mode="json")
    raw["study"]["pruner"] = config_module.PrunerConfig().model_dump(mode="json")
    return config_module.StudyConfig.model_validate(raw)


def ours(config: config_module.StudyConfig, seed: int, name: str) -> OptunaPolicy:
    """hpo's sampler (seeded per trial number, as its workers do) and pruner."""
    config = with_overrides(config, f"study.sampler.seed={seed}")
    study = new_study(seed, make_sampler(config), make_pruner(config))
    value = best if config.study.objective_epoch == "best" else last
    return OptunaPolicy(name, study, sample, EPOCHS, report_value=value, tell_value=value,
                        sampler_for=lambda number: make_sampler(config, number))


@dataclass
class MlpRay(RayPolicy):
    """Ray Tune's ASHA and OptunaSearch, as replay.RayPolicy, on LCBench's space."""

    def sample(self) -> Callable[[optuna.Trial], Mlp]:
        return sample

    def config_of(self, params: dict[str, float]) -> Mlp:
        return Mlp(tuple((k, float(params[k])) for k in SPACE))


def policies(names: list[str], seed: int, variants: dict[str, list[str]]
             ) -> list[tuple[Policy, bool]]:
    """Each named policy for repetition `seed`; a variant is hpo with `--set` overrides, and
    one named "hpo" replaces hpo's defaults."""
    study = default_study()
    startup = study.study.sampler.n_startup_trials

    def glue(name: str, sampler: optuna.samplers.BaseSampler,
             pruner: optuna.pruners.BasePruner) -> Policy:
        return OptunaPolicy(name, new_study(seed, sampler, pruner), sample, EPOCHS,
                            report_value=last, tell_value=last)

    build: dict[str, Callable[[], Policy]] = {
        "hpo": lambda: ours(study, seed, "hpo"),
        "expert": lambda: glue("expert", optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=startup), optuna.pruners.MedianPruner(
            n_startup_trials=MEDIAN_STARTUP, n_warmup_steps=MEDIAN_WARMUP)),
        "novice": lambda: glue("novice", optuna.samplers.TPESampler(seed=seed),
                               optuna.pruners.NopPruner()),
        "ray": lambda: MlpRay("ray", study.search_space, "none", seed, EPOCHS, startup),
        "random": lambda: ours(with_overrides(study, "study.sampler.name=random",
                                              "study.pruner.name=none"), seed, "random"),
        # Optuna's HyperbandPruner as it comes: the first rung at one epoch.
        "tpe-hyperband": lambda: ours(with_overrides(
            study, "study.pruner.name=hyperband", "study.pruner.min_resource=1"),
            seed, "tpe-hyperband"),
    }
    for label, sets in variants.items():
        build[label] = functools.partial(
            lambda sets, label: ours(with_overrides(study, *sets), seed, label), sets, label)
    unknown = [n for n in names if n not in build]
    if unknown:
        raise SystemExit(f"unknown policy {unknown[0]}: choose from {', '.join(build)}")
    return [(build[name](), False) for name in names]


PEERS = ["novice", "expert", "ray", "random", "tpe-hyperband"]
_SURROGATES: dict[Path, Surrogate] = {}


def surrogate_at(data: Path) -> Surrogate:
    """One surrogate per process (an onnxruntime session does not survive a fork)."""
    if data not in _SURROGATES:
        # The 34 tasks of the surrogate's space (its encoding also holds one more, 167083).
        space = json.loads((data / "lcbench" / "config_space.json").read_text())
        tasks = next(h["choices"] for h in space["hyperparameters"]
                     if h["name"] == "OpenML_task_id")
        _SURROGATES[data] = Surrogate(onnx_surrogate(data), tuple(tasks))
    return _SURROGATES[data]


def repetition(names: list[str], variants: dict[str, list[str]], seed: int, *,
               budget: int, workers: int, table: Callable[[], Surrogate]) -> dict[str, dict]:
    surrogate = table()
    out = race(policies(names, seed, variants), surrogate, seed, budget=budget,
               workers=workers, epochs=EPOCHS)
    found = max((s[-1][1] for run in out.values() for s in [run["steps"]] if s), default=0.0)
    out["oracle"] = {"best": max(surrogate.oracle(seed), found),
                     "task": surrogate.task(seed)}
    return out


def run(args: argparse.Namespace, table: Callable[[], Surrogate]) -> dict:
    variants = dict(args.variants)
    names = ["hpo", *[p for p in args.policies if p != "hpo"], *variants]
    if args.hpo_sets:
        variants["hpo"] = args.hpo_sets
    one = functools.partial(repetition, names, variants, budget=args.budget,
                            workers=args.workers, table=table)
    reps = repeat(one, range(args.first_seed, args.first_seed + args.repetitions), args.jobs)
    return {
        "budget": args.budget, "workers": args.workers, "repetitions": args.repetitions,
        "first_seed": args.first_seed, "epochs": EPOCHS, "hpo_sets": args.hpo_sets,
        "score": "validation accuracy", "table": {"file": "yahpo_data lcbench/model.onnx",
                                                  "tasks": len(table().tasks)},
        "versus": {peer: versus(reps, peer) for peer in names if peer != "hpo"},
        "repetitions_data": reps,
    }


def main(argv: list[str] | None = None, table: Callable[[], Surrogate] | None = None
         ) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a clone of slds-lmu/yahpo_data")
    parser.add_argument("--budget", type=int, default=20, help="trials per search")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--repetitions", type=int, default=100)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="processes for the repetitions")
    parser.add_argument("--policies", nargs="*", default=PEERS)
    parser.add_argument("--variant", dest="variants", type=variant, action="append",
                        default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE...]",
                        help="also hpo with these overrides, as a peer named NAME")
    parser.add_argument("--hpo-set", dest="hpo_sets", action="append", default=[],
                        metavar="KEY=VALUE", help="hpo's defaults changed so")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if min(args.budget, args.workers, args.repetitions, args.jobs) < 1:
        parser.error("--budget, --workers, --repetitions and --jobs must be at least 1")
    if table is None:
        if args.data is None or not (args.data / "lcbench" / "model.onnx").is_file():
            parser.error("--data must name a clone of slds-lmu/yahpo_data (its "
                         "lcbench/model.onnx)")
        table = functools.partial(surrogate_at, args.data.resolve())
    result = run(args, table)
    for peer, figures in result["versus"].items():
        print(f"{args.budget} trials x {args.workers} workers, hpo vs {peer}: "
              f"G1 {figures['g1']:.2f} (ties {figures['ties']:.2f}), "
              f"median G2 {figures['g2_median']:.2f}", file=sys.stdout)
    if args.output:
        args.output.write_text(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
