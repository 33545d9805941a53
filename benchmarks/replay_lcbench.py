"""LCBench as tables of the replay's format (benchmarks/tables.py): YAHPO Gym's LCBench
surrogate (Pfisterer et al., 2022) of learning curves of MLPs trained 52 epochs on each of 34
OpenML tasks (Zimmer et al., 2021), read at 2,000 random configurations per task, as the
original LCBench recorded 2,000. One table per task; a replay over them searches task k mod 34
in world k.

    git clone https://github.com/slds-lmu/yahpo_data ../yahpo_data   # Apache 2.0
    pip install -e '.[bench]'      # onnxruntime reads the surrogate
    python benchmarks/replay_lcbench.py --data ../yahpo_data --output benchmarks/tables/lcbench
    python benchmarks/replay.py --table benchmarks/tables/lcbench/*.jsonl --mode compute ...

A run's curve is the surrogate's validation accuracy (as a share) at each epoch and its
cumulative time (made increasing: each epoch at least a millisecond). The surrogate is read
with onnxruntime directly, with YAHPO Gym's input encoding (its `_config_to_xs`: the task id
integer-encoded by encoding.json, the other values as they are in the order of `cont_names`);
yahpo-gym itself pins numpy below 2 and ConfigSpace 0.6, which Ray and hpo's other benchmarks
cannot share an environment with. Checked against yahpo-gym 1.0.2: the same outputs for 45
configurations and epochs on 3 tasks (benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tables
from optuna.distributions import BaseDistribution, FloatDistribution, IntDistribution

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


def random_params(rng: random.Random) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, (low, high, log, integer) in SPACE.items():
        value = (math.exp(rng.uniform(math.log(low), math.log(high))) if log
                 else rng.uniform(low, high))
        out[name] = min(max(round(value), low), high) if integer else value
    return out


def space() -> dict[str, BaseDistribution]:
    return {name: (IntDistribution(low, high, log=log) if integer
                   else FloatDistribution(low, high, log=log))
            for name, (low, high, log, integer) in SPACE.items()}


def curve_of(rows: list[dict[str, float]]) -> list[list[float]]:
    """A run's curve from the surrogate's outputs at its epochs 1 to 52."""
    curve, done = [], 0.0
    for row in rows:
        done = max(done + 1e-3, row["time"])
        curve.append([round(done, 4), round(row["val_accuracy"] / 100, 6)])
    return curve


def runs(evaluate: Evaluate, task: str, count: int
         ) -> Iterator[tuple[dict[str, float], list[list[float]]]]:
    """`count` random configurations of `task` (seeded by the task) and their curves."""
    rng = random.Random(f"lcbench:{task}")
    configs = [random_params(rng) for _ in range(count)]
    for start in range(0, count, 100):
        chunk = configs[start:start + 100]
        rows = evaluate(task, [{**c, "epoch": e} for c in chunk for e in range(1, EPOCHS + 1)])
        for k, config in enumerate(chunk):
            yield config, curve_of(rows[k * EPOCHS:(k + 1) * EPOCHS])


def task_of(table: str) -> str | None:
    """The task of a table this module wrote ("lcbench-3945"), else None."""
    prefix, _, task = table.partition("-")
    return task if prefix == "lcbench" and task else None


def answerer(evaluate: Evaluate, task: str) -> Callable[[dict[str, Any]], tables.Run]:
    """The surrogate's run of `task` at any configuration, as its table records one (the
    same rounding: at a recorded configuration, the recorded run)."""

    def answer(params: dict[str, Any]) -> tables.Run:
        config = {name: params[name] for name in SPACE}
        rows = evaluate(task, [{**config, "epoch": e} for e in range(1, EPOCHS + 1)])
        curve = curve_of(rows)
        return tables.Run(config, tuple(s for s, _ in curve), tuple(v for _, v in curve))

    return answer


def tasks_of(data: Path) -> list[str]:
    """The 34 tasks of the surrogate's space (its encoding also holds one more, 167083)."""
    found = json.loads((data / "lcbench" / "config_space.json").read_text())
    return next(h["choices"] for h in found["hyperparameters"]
                if h["name"] == "OpenML_task_id")


def check(evaluate: Evaluate, folder: Path, tasks: list[str], count: int) -> int:
    """0 if the surrogate's answer at each of the first `count` runs of every task's table
    is that run, to the digit; else 1, the runs that differ said."""
    differ = checked = 0
    for task in tasks:
        table = tables.read(folder / f"lcbench-{task}.jsonl")
        answer = answerer(evaluate, task)
        for run in table.runs[:count]:
            checked += 1
            if answer(run.params) != run:
                differ += 1
                print(f"lcbench-{task}: the surrogate differs at {run.params}", file=sys.stderr)
    print(f"{checked - differ} of {checked} recorded runs answered exactly by the surrogate")
    return 1 if differ or not checked else 0


def main(argv: list[str] | None = None, evaluate: Evaluate | None = None,
         tasks: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="a clone of slds-lmu/yahpo_data")
    parser.add_argument("--output", type=Path, required=True, help="a folder for the tables")
    parser.add_argument("--configurations", type=int, default=2000, help="per task")
    parser.add_argument("--tasks", nargs="*", help="only these tasks")
    parser.add_argument("--check", type=int, metavar="N",
                        help="write nothing: check that the surrogate at the first N runs "
                        "of each table in --output gives those runs (replay.py --surrogate)")
    args = parser.parse_args(argv)
    if evaluate is None:
        if args.data is None or not (args.data / "lcbench" / "model.onnx").is_file():
            parser.error("--data must name a clone of slds-lmu/yahpo_data (its "
                         "lcbench/model.onnx)")
        evaluate = onnx_surrogate(args.data)
        tasks = tasks_of(args.data)
    chosen = args.tasks or tasks or []
    if args.check is not None:
        raise SystemExit(check(evaluate, args.output, chosen, args.check))
    args.output.mkdir(parents=True, exist_ok=True)
    for task in chosen:
        count = tables.write(args.output / f"lcbench-{task}.jsonl", f"lcbench-{task}",
                             "maximize", space(), "epoch",
                             runs(evaluate, task, args.configurations))
        print(f"lcbench-{task}: {count} runs", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
