"""A fleet of many workers on one PostgreSQL server: do all finish, is the budget exact, how
many server connections does the fleet hold, and does a claim stay as cheap as the study grows?

    python benchmarks/fleet_scale.py fleet [--workers 64] [--trials 640]
    python benchmarks/fleet_scale.py claims [--sizes 0,1000,3000,10000]

`fleet`: that many processes each open the storage as `hpo run` does and run hpo's worker loop
(`hpo.app.worker.run_worker`: claims under the study lock, heartbeats, reaping, exact budget) with
trivial trials (one parameter, 12 user attributes, tell) on a fresh database of the machine's
server. A monitor counts the database's server connections every 20 ms. When a worker's loop
ends it stays idle, its storage open, until all have ended: the connections counted then are
what a fleet holds between trials.

`claims`: one worker's loop on one study grown to each size in turn (trials added as finished
ones, 12 attributes each); per size, the median time from the end of one trial to the start of
the next (reaping, the study lock, the grouped count, ask) and of a tell, over 50 trials.

The trials need no torch, and 64 imports of it would take about 25 GB: the workers import hpo
with torch and transformers replaced by inert stand-ins (`_torchless`), so 64 fit in memory.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import multiprocessing
import statistics
import sys
import threading
import time
import types
import uuid

import sqlalchemy

SERVER = "postgresql+psycopg2://postgres@127.0.0.1:5432"
ATTRS = 12  # about what hpo records on a trial


class _Meta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Inert,), {})

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _Inert(metaclass=_Meta):
    """Anything: a class to subclass, a decorator, an attribute of any depth."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Inert()

    def __getattr__(self, name: str):
        return _Inert()


class _InertModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (_Inert,), {})


class _Torchless(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    ROOTS = ("torch", "transformers", "safetensors", "accelerate", "peft")

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _InertModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _torchless() -> None:
    sys.meta_path.insert(0, _Torchless())


def objective(trial) -> float:
    x = trial.suggest_float("x", 0.0, 1.0)
    for i in range(ATTRS):
        trial.set_user_attr(f"attr_{i}", i)
    return x


class _Quiet:
    def message(self, text: str) -> None: ...
    def trial_finished(self, trial, outcome) -> None: ...
    def interrupted(self, text: str) -> None: ...


def fleet_worker(url: str, trials: int, reports, go, release) -> None:
    _torchless()
    import optuna
    from optuna.trial import TrialState

    from hpo.app.worker import Limits, run_worker
    from hpo.errors import one_line
    from hpo.outcome import Outcome
    from hpo.search.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        storage = open_storage(url, heartbeat_interval=30, grace_period=120)
        study = optuna.create_study(study_name="fleet", storage=storage, load_if_exists=True,
                                    sampler=optuna.samplers.RandomSampler())
    except Exception as exc:
        reports.put(("start", one_line(exc)))
        return
    reports.put(("opened", None))
    go.wait()

    def run_trial(context):
        value = objective(context.trial)
        return Outcome(TrialState.COMPLETE, value=value), context.study.tell(context.trial,
                                                                             value)

    try:
        result = run_worker(study, storage, run_trial, _Quiet(),
                            Limits(trials, poll_seconds=0.2))
        reports.put(("done", result.ran))
    except Exception as exc:
        reports.put(("error", one_line(exc)))
    release.wait()
    storage.engine.dispose()


class Monitor:
    """Server connections to one database, every 20 ms, from a connection of its own to
    another database (so it does not count itself)."""

    def __init__(self, database: str) -> None:
        # Autocommit: within one transaction the server would show one snapshot of its
        # activity, taken at the first look.
        self.engine = sqlalchemy.create_engine(f"{SERVER}/postgres", isolation_level="AUTOCOMMIT")
        self.database = database
        self.peak = 0
        self.last = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        with self.engine.connect() as connection:
            while not self._stop.is_set():
                self.last = connection.execute(
                    sqlalchemy.text("SELECT count(*) FROM pg_stat_activity WHERE datname = :d"),
                    {"d": self.database}).scalar_one()
                self.peak = max(self.peak, self.last)
                time.sleep(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()


def admin(statement: str) -> None:
    engine = sqlalchemy.create_engine(f"{SERVER}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(statement))
    engine.dispose()


def fleet(workers: int, trials: int) -> None:
    import optuna
    from optuna.trial import TrialState

    database = f"hpo_bench_{uuid.uuid4().hex[:10]}"
    admin(f'CREATE DATABASE "{database}"')
    url = f"{SERVER}/{database}"
    monitor = Monitor(database)
    try:
        context = multiprocessing.get_context("spawn")
        reports, go, release = context.Queue(), context.Event(), context.Event()
        began = time.perf_counter()
        procs = [context.Process(target=fleet_worker, args=(url, trials, reports, go, release))
                 for _ in range(workers)]
        for p in procs:
            p.start()
        started = [reports.get() for _ in procs]
        opened = sum(kind == "opened" for kind, _ in started)
        start_peak = monitor.peak
        start_seconds = time.perf_counter() - began
        go.set()
        began = time.perf_counter()
        ended = [reports.get() for _ in range(opened)]
        loop_seconds = time.perf_counter() - began
        run_peak = monitor.peak
        time.sleep(1.0)
        idle = monitor.last
        release.set()
        for p in procs:
            p.join()
        study = optuna.load_study(study_name="fleet", storage=url)
        states = [t.state for t in study.get_trials(deepcopy=False)]
        finished = sum(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states)
        left = sum(s in (TrialState.RUNNING, TrialState.WAITING) for s in states)
    finally:
        monitor.stop()
        admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    errors = [message for kind, message in started + ended if kind in ("start", "error")]
    done = sum(kind == "done" for kind, _ in ended)
    max_connections = _max_connections()
    print(f"{workers} workers, budget {trials} trials, server max_connections "
          f"{max_connections}\n")
    print("| figure | value |")
    print("| --- | ---: |")
    print(f"| workers that opened the storage | {opened} of {workers} |")
    print(f"| workers whose loop ended well | {done} of {workers} |")
    print(f"| finished trials (budget {trials}) | {finished} |")
    print(f"| trials left RUNNING or WAITING | {left} |")
    print(f"| peak server connections while starting | {start_peak} |")
    print(f"| peak server connections while running | {run_peak} |")
    print(f"| server connections with every worker idle | {idle} "
          f"({idle / max(opened, 1):.2f} per worker) |")
    print(f"| start (spawn, import, open storage) | {start_seconds:.1f} s |")
    print(f"| worker loops, first claim to last tell | {loop_seconds:.1f} s "
          f"({1000 * loop_seconds / max(finished, 1):.1f} ms per trial) |")
    for message in sorted(set(errors)):
        print(f"\nerror ({errors.count(message)} workers): {message}")


def _max_connections() -> int:
    engine = sqlalchemy.create_engine(f"{SERVER}/postgres")
    with engine.connect() as connection:
        value = int(connection.execute(sqlalchemy.text("SHOW max_connections")).scalar_one())
    engine.dispose()
    return value


def claims(sizes: list[int], per_size: int = 50) -> None:
    _torchless()
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.trial import TrialState, create_trial

    from hpo.app.worker import Limits, run_worker
    from hpo.outcome import Outcome
    from hpo.search.storage import open_storage

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    database = f"hpo_bench_{uuid.uuid4().hex[:10]}"
    admin(f'CREATE DATABASE "{database}"')
    url = f"{SERVER}/{database}"
    rows = []
    try:
        storage = open_storage(url, heartbeat_interval=30, grace_period=120)
        study = optuna.create_study(study_name="claims", storage=storage,
                                    sampler=optuna.samplers.RandomSampler())
        space = {"x": FloatDistribution(0.0, 1.0)}
        for size in sizes:
            have = len(study.get_trials(deepcopy=False))
            study.add_trials([create_trial(
                params={"x": 0.5}, distributions=space, value=0.5,
                user_attrs={f"attr_{i}": i for i in range(ATTRS)},
            ) for _ in range(max(0, size - have))])
            marks: list[tuple[float, float, float]] = []  # start, before tell, end

            def run_trial(context, marks=marks):
                start = time.perf_counter()
                value = objective(context.trial)
                before_tell = time.perf_counter()
                frozen = context.study.tell(context.trial, value)
                marks.append((start, before_tell, time.perf_counter()))
                return Outcome(TrialState.COMPLETE, value=value), frozen

            total = len(study.get_trials(deepcopy=False))
            run_worker(study, storage, run_trial, _Quiet(),
                       Limits(total + per_size + 1, poll_seconds=0.2))
            between = [b[0] - a[2] for a, b in zip(marks, marks[1:], strict=False)]
            tells = [end - before for _, before, end in marks[1:]]
            rows.append((total, 1000 * statistics.median(between),
                         1000 * statistics.median(tells)))
        storage.engine.dispose()
    finally:
        admin(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    print(f"one worker, {per_size} trials per size, median of each\n")
    print("| trials in the study | claim: end of a trial to start of the next (ms) | tell (ms) |")
    print("| ---: | ---: | ---: |")
    for total, between, tell in rows:
        print(f"| {total} | {between:.1f} | {tell:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("fleet")
    run.add_argument("--workers", type=int, default=64)
    run.add_argument("--trials", type=int, default=640)
    grow = commands.add_parser("claims")
    grow.add_argument("--sizes", default="0,1000,3000,10000")
    args = parser.parse_args()
    if args.command == "fleet":
        fleet(args.workers, args.trials)
    else:
        claims([int(s) for s in args.sizes.split(",")])


if __name__ == "__main__":
    main()
