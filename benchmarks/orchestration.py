"""Cost per trial of the worker's orchestration (claim under the study lock, ask, heartbeat,
attributes, tell, reaping, exact budget) against plain Optuna on the same PostgreSQL server,
with a trivial objective so only the orchestration is timed.

    python benchmarks/orchestration.py [--workers 8] [--trials 400] [--repeats 3]

Plain Optuna: each process runs study.optimize with MaxTrialsCallback(trials), Optuna's own
budget (which overshoots). hpo: each process runs hpo.app.worker.run_worker, whose runner suggests
the same parameter, sets the same number of user attributes as a real trial and tells.
Each run gets a fresh database; the script prints a markdown table.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import uuid

import optuna
import sqlalchemy
from optuna.study import MaxTrialsCallback
from optuna.trial import TrialState

SERVER = "postgresql+psycopg2://postgres@127.0.0.1:5432"
ATTRS = 12  # about what hpo records on a trial


def objective(trial: optuna.Trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    for i in range(ATTRS):
        trial.set_user_attr(f"attr_{i}", i)
    return x


def plain_worker(url: str, trials: int, start) -> None:
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120)
    study = optuna.create_study(study_name="bench", storage=storage, load_if_exists=True,
                                sampler=optuna.samplers.RandomSampler())
    start.wait()
    study.optimize(objective, callbacks=[
        MaxTrialsCallback(trials, states=(TrialState.COMPLETE, TrialState.PRUNED))])


def hpo_worker(url: str, trials: int, start) -> None:
    from hpo.app.worker import Limits, run_worker
    from hpo.outcome import Outcome
    from hpo.search.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    storage = open_storage(url, heartbeat_interval=30, grace_period=120)
    study = optuna.create_study(study_name="bench", storage=storage, load_if_exists=True,
                                sampler=optuna.samplers.RandomSampler())

    def run_trial(context):
        value = objective(context.trial)
        return Outcome(TrialState.COMPLETE, value=value), context.study.tell(context.trial,
                                                                             value)

    class Quiet:
        def message(self, text: str) -> None: ...
        def trial_finished(self, trial, outcome) -> None: ...

    start.wait()
    run_worker(study, storage, run_trial, Quiet(), Limits(trials, poll_seconds=0.2))


def fresh_database() -> str:
    name = f"hpo_bench_{uuid.uuid4().hex[:10]}"
    engine = sqlalchemy.create_engine(f"{SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return f"{SERVER}/{name}"


def drop_database(url: str) -> None:
    name = url.rsplit("/", 1)[1]
    engine = sqlalchemy.create_engine(f"{SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    engine.dispose()


def measure(target, workers: int, trials: int) -> tuple[float, int]:
    url = fresh_database()
    try:
        optuna.storages.RDBStorage(url)  # the schema, outside the timed part
        context = multiprocessing.get_context("spawn")
        # Every worker has imported its libraries and opened its storage when all reach the
        # barrier; only what follows is timed.
        start = context.Barrier(workers + 1)
        procs = [context.Process(target=target, args=(url, trials, start))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        start.wait()
        began = time.perf_counter()
        for p in procs:
            p.join()
        elapsed = time.perf_counter() - began
        study = optuna.load_study(study_name="bench", storage=url)
        finished = len(study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)))
        return elapsed, finished
    finally:
        drop_database(url)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = {}
    for name, target in (("plain Optuna", plain_worker), ("hpo", hpo_worker)):
        runs = [measure(target, args.workers, args.trials) for _ in range(args.repeats)]
        rows[name] = runs
    print(f"{args.workers} workers, budget {args.trials} trials, {args.repeats} runs each\n")
    print("| orchestration | finished trials per run | ms per finished trial (median) |")
    print("| --- | --- | ---: |")
    medians = {}
    for name, runs in rows.items():
        medians[name] = statistics.median(1000 * e / f for e, f in runs)
        print(f"| {name} | {', '.join(str(f) for _, f in runs)} | {medians[name]:.1f} |")
    print(f"\nratio hpo / plain Optuna: **{medians['hpo'] / medians['plain Optuna']:.2f}x**")


if __name__ == "__main__":
    main()
