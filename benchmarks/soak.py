"""A fleet soak: workers on a private PostgreSQL under random faults for a while, with readers
polling alongside, then the checks a fleet must pass whatever happened on the way.

    python benchmarks/soak.py                          # 4 workers, 30 minutes, seed 0
    python benchmarks/soak.py --minutes 180 --seed 7   # hours, another random schedule
    python benchmarks/soak.py --minutes 3 --workers 3  # the CI soak (tests/system/test_soak.py)

The study is the demo's on its tiny model (trials of a second or two, so a soak sees hundreds),
keeping its 3 best models in an artifact directory. Each worker is `hpo run` in a process of its
own, restarted whenever it exits non-zero, as docker-compose's `restart: on-failure` restarts it.
Until `--minutes` have passed, a schedule drawn from `--seed` (printed, so a failure can be
replayed) stops the database for 1-60 s at a time, and SIGKILLs or SIGTERMs a random worker at
a random moment (some restarts also die at a named point: claiming, before the first
heartbeat, in training, while telling). Readers poll `hpo status`, optuna-dashboard's API and
the study itself. Then the fleet finishes its budget of `--trials` and the soak checks:

- the budget kept exactly and never overrun, as the study counts it: by default
  (`study.budget: trainings`) between N - 1 and N full trainings trained, under
  `study.budget: trials` N trials finished; nothing RUNNING or WAITING;
- every result a worker printed is stored with that value;
- FAIL at most the number of workers killed or stopped; no worker exit 1 (or 2);
- each worker process's memory flat (`worker_rss_mb` from its 5th trial to its last, at most
  +60 MiB);
- every kept model listed in `kept_models` downloads as a zip holding a model;
- readers answered whenever the database had been up for 20 s.

Exit code 0 when every check passes, 1 when one fails; the report is markdown.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import optuna
from optuna.trial import TrialState
from postgres import PrivateServer  # the tests' disposable server, beside this script

from hpo import study_files
from hpo.app.launcher import exit_code
from hpo.search import budget as budget_module

REPO = Path(__file__).resolve().parents[1]

STUDY = "demo"
SETTINGS = ("--set", "search_space.model_name=[data/demo/models/tiny-bert]",
            "--set", "study.keep_best=3")
# Scaled down from 30 s and 120 s so that kills are found and retried within the soak.
LIVENESS = {"HPO_HEARTBEAT_INTERVAL": "2", "HPO_GRACE_PERIOD": "8"}
KILL_POINTS = ("claim", "heartbeat", "train", "tell")
# Exit codes as a shell (and hpo's launcher) reads them: done; stopped by SIGTERM; killed.
# A SIGTERM that lands while Python is still starting, before `hpo` installed its handler,
# ends the run by the default action: nothing was claimed yet, and it reads as 143 too.
STOPPED = (128 + signal.SIGTERM, 128 + signal.SIGKILL)
GOOD_EXITS = (0, *STOPPED)
RSS_GROWTH_MIB = 60.0
READER_SLACK = 20.0  # seconds after the database is back before a reader must answer


@dataclass(frozen=True)
class Budget:
    """The study's budget as its workers keep it: `n` trials finished, or (`steps` set, the
    default `study.budget: trainings`) `n` full trainings of `steps` reported steps."""

    n: int
    steps: int | None

    @classmethod
    def of_study(cls, n: int, overrides: list[str]) -> Budget:
        config = study_files.load(study_files.study_path(STUDY), overrides)
        return cls(n, config.max_steps() if config.study.budget == "trainings" else None)

    def used(self, trials: list[optuna.trial.FrozenTrial]) -> float:
        if self.steps is None:
            return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        return budget_module.Trainings(self.n, self.steps).spent(budget_module.trained_of(trials))

    def kept(self, used: float) -> bool:
        """Spent exactly: N trials, or N trainings short of less than one (a whole training
        no longer fits, so none starts)."""
        return used == self.n if self.steps is None else self.n - 1 < used <= self.n + 1e-9

    def unit(self) -> str:
        return "trials finished" if self.steps is None else "trainings trained"


@dataclass
class Events:
    """What happened, shared by the threads: outages (start, end), signals sent, reader
    answers and failures, the highest finished count seen."""

    outages: list[list[float]] = field(default_factory=list)
    signals: Counter = field(default_factory=Counter)
    reads: Counter = field(default_factory=Counter)
    read_failures: list[str] = field(default_factory=list)
    most_used: float = 0.0  # of the budget: trials finished, or trainings trained
    lock: threading.Lock = field(default_factory=threading.Lock)

    def database_settled(self, since: float, until: float) -> bool:
        """Whether no outage overlapped [since, until], nor ended within READER_SLACK before
        `since`."""
        with self.lock:
            return all(not (start <= until and (end is None or since < end + READER_SLACK))
                       for start, end in self.outages)


class Worker:
    """One `hpo run`, restarted whenever it exits non-zero, as compose's `restart: on-failure`
    does (without its cap: a soak kills each worker many times)."""

    def __init__(self, index: int, command: list[str], env: dict, logs: Path,
                 rng: random.Random, chaos_on: threading.Event) -> None:
        self.index, self.command, self.env, self.logs = index, command, env, logs
        self.rng, self.chaos_on = rng, chaos_on
        self.runs: list[tuple[int, int, Path]] = []  # pid, exit code, stdout file
        self.process: subprocess.Popen | None = None
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._supervise, daemon=True)
        self.thread.start()

    def _supervise(self) -> None:
        while not self.stopping.is_set():
            env = dict(self.env)
            if self.runs and self.chaos_on.is_set() and self.rng.random() < 0.3:
                env["HPO_FAULT_KILL_AT"] = self.rng.choice(KILL_POINTS)
            out = self.logs / f"worker{self.index}-run{len(self.runs)}.out"
            with out.open("w") as stdout, (out.with_suffix(".err")).open("w") as stderr:
                self.process = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=stdout,
                                                stderr=stderr, text=True)
                code = self.process.wait()
            self.runs.append((self.process.pid, code, out))
            if code == 0:
                return
            time.sleep(1.0)  # compose's restart delay

    def stop(self) -> None:
        self.stopping.set()
        self.signal(signal.SIGKILL)
        self.thread.join(timeout=30)

    def signal(self, sig: int) -> bool:
        process = self.process
        if process is None or process.poll() is not None:
            return False
        process.send_signal(sig)
        return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def chaos(server: PrivateServer, workers: list[Worker], events: Events, rng: random.Random,
          until: float, chaos_on: threading.Event, done: threading.Event) -> None:
    """Outages and signals at random until `until`, then the database stays up."""
    next_outage = time.monotonic() + rng.uniform(20, 90)
    next_signal = time.monotonic() + rng.uniform(5, 30)
    while time.monotonic() < until and not done.is_set():
        now = time.monotonic()
        if now >= next_outage:
            seconds = rng.uniform(1, 60)
            with events.lock:
                events.outages.append([time.monotonic(), None])
            server.stop()
            time.sleep(min(seconds, max(0.0, until - time.monotonic()) + 1))
            server.start_again()
            with events.lock:
                events.outages[-1][1] = time.monotonic()
            next_outage = time.monotonic() + rng.uniform(30, 150)
        elif now >= next_signal:
            sig = rng.choice((signal.SIGKILL, signal.SIGTERM))
            if rng.choice(workers).signal(sig):
                events.signals[sig.name] += 1
            next_signal = time.monotonic() + rng.uniform(5, 40)
        else:
            time.sleep(0.5)
    chaos_on.clear()


def readers(url: str, dashboard_port: int, study_file_args: list[str], budget: Budget,
            events: Events, done: threading.Event) -> None:
    """Poll what a user and a dashboard read, every few seconds, until `done`."""
    turn = 0
    storage: list[optuna.storages.RDBStorage] = []  # one, opened once the database answers

    def study() -> None:
        if not storage:
            storage.append(optuna.storages.RDBStorage(
                url, engine_kwargs={"pool_pre_ping": True}))
        _read_study(storage[0], budget, events)

    while not done.is_set():
        turn += 1
        for name, read in (("study", study),
                           ("dashboard", lambda: _read_dashboard(dashboard_port)),
                           ("status", lambda: _read_status(study_file_args))):
            if name == "status" and turn % 3:
                continue  # a process of its own each time: every third turn
            asked = time.monotonic()
            try:
                read()
                events.reads[name] += 1
            except Exception as exc:  # noqa: BLE001 - a reader's failure is a finding
                # Before its first answer the study may not exist yet, or the dashboard
                # still be starting.
                if events.reads[name] and events.database_settled(asked, time.monotonic()):
                    events.read_failures.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
        done.wait(3.0)
    if storage:
        storage[0].engine.dispose()


def _read_study(storage: optuna.storages.RDBStorage, budget: Budget, events: Events) -> None:
    study = optuna.load_study(study_name=STUDY, storage=storage)
    used = budget.used(study.get_trials(deepcopy=False))
    with events.lock:
        events.most_used = max(events.most_used, used)
    if used > budget.n + 1e-9:
        raise AssertionError(f"{used:g} {budget.unit()}, over the budget of {budget.n}")


def _read_dashboard(port: int) -> None:
    """The study list, then the study's trials, as the dashboard's page asks for them."""
    def get(path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return json.load(answer)

    ours = [s for s in get("/api/studies")["study_summaries"] if s["study_name"] == STUDY]
    if not ours:
        raise AssertionError("the dashboard does not list the study")
    get(f"/api/studies/{ours[0]['study_id']}")


def _read_status(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "hpo.cli", "status", *args, "--format", "json"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip()[-200:])
    json.loads(done.stdout)


def check(url: str, artifacts: Path, workers: list[Worker], events: Events,
          budget: Budget) -> list[tuple[str, bool, str]]:
    """Each check: (what, passed, the figures)."""
    from hpo.search import artifacts as artifacts_module

    runs = [run for worker in workers for run in worker.runs]
    codes = Counter(exit_code(code) for _, code, _ in runs)
    study = optuna.load_study(study_name=STUDY, storage=url)
    trials = {t.number: t for t in study.trials}
    states = Counter(t.state.name for t in trials.values())
    finished = states["COMPLETE"] + states["PRUNED"]
    used = budget.used(list(trials.values()))
    printed = [(int(n), float(v)) for _, _, out in runs
               for n, v in re.findall(r"^trial (\d+) value ([\d.]+)", out.read_text(),
                                      re.MULTILINE)]
    wrong = [(n, v) for n, v in printed if trials[n].state != TrialState.COMPLETE
             or abs(trials[n].value - v) > 1e-4]
    stopped = sum(n for code, n in codes.items() if code in STOPPED)
    growth: dict[str, float] = {}
    by_worker: dict[str, list[tuple[int, float]]] = {}
    for t in trials.values():
        if "worker_rss_mb" in t.user_attrs and "worker" in t.user_attrs:
            by_worker.setdefault(t.user_attrs["worker"], []).append(
                (t.number, t.user_attrs["worker_rss_mb"]))
    for name, series in by_worker.items():
        series.sort()
        if len(series) >= 10:
            growth[name] = series[-1][1] - min(rss for _, rss in series[4:])
    store = artifacts_module.open_existing(str(artifacts), writable=False)
    kept = artifacts_module.kept(study)
    unreadable = []
    for number, entry in kept.items():
        try:
            with store.open_reader(entry["artifact_id"]) as reader:
                bundle = zipfile.ZipFile(io.BytesIO(reader.read()))
            if "config.json" not in bundle.namelist():
                unreadable.append(f"{number}: no config.json")
        except Exception as exc:  # noqa: BLE001 - a finding
            unreadable.append(f"{number}: {type(exc).__name__}")
    # A trial reaped while it kept its model, its result carried to a copy: the entry names
    # the reaped trial (a known bound, counted here).
    not_complete = [n for n in kept if trials[n].state != TrialState.COMPLETE]
    listed = {entry["artifact_id"] for entry in kept.values()}
    stray = [p.name for p in artifacts.iterdir() if p.name not in listed]
    worst = max(growth.values(), default=0.0)
    return [
        ("budget exact", budget.kept(used), f"{used:g} {budget.unit()} for a budget of "
         f"{budget.n} ({finished} finished: {states['COMPLETE']} COMPLETE, "
         f"{states['PRUNED']} PRUNED)"),
        ("never over the budget", events.most_used <= budget.n + 1e-9,
         f"most seen by the readers {events.most_used:g} {budget.unit()}"),
        ("nothing RUNNING or WAITING", states["RUNNING"] + states["WAITING"] == 0,
         f"{states['RUNNING']} RUNNING, {states['WAITING']} WAITING"),
        ("every printed result stored", not wrong,
         f"{len(printed)} printed, {len(wrong)} missing or different {wrong[:5]}"),
        ("FAIL at most the workers killed or stopped", states["FAIL"] <= stopped,
         f"{states['FAIL']} FAIL, {stopped} worker runs ended by SIGKILL or SIGTERM"),
        ("no worker exit 1 or 2", set(codes) <= set(GOOD_EXITS),
         "exit codes " + ", ".join(f"{code}: {n}" for code, n in sorted(codes.items()))),
        ("each worker's memory flat", worst <= RSS_GROWTH_MIB,
         f"{len(growth)} worker processes with 10+ trials, largest growth from the 5th "
         f"trial {worst:+.0f} MiB (at most +{RSS_GROWTH_MIB:.0f})"),
        ("every kept model downloadable", len(kept) > 0 and not unreadable,
         f"{len(kept)} kept, unreadable {unreadable}; kept under a trial not COMPLETE: "
         f"{len(not_complete)}; files in the store not listed: {len(stray)}"),
        ("readers answered", not events.read_failures and all(
            events.reads[name] for name in ("study", "dashboard", "status")),
         f"answers {dict(events.reads)}; failures with the database up "
         f"{len(events.read_failures)} {events.read_failures[:3]}"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="how long faults are injected")
    parser.add_argument("--trials", type=int, default=None,
                        help="the study's budget (default: 10 per minute)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    budget = Budget.of_study(args.trials or max(20, round(10 * args.minutes)),
                             list(SETTINGS[1::2]))
    rng = random.Random(args.seed)
    started = time.monotonic()
    print(f"soak: {args.workers} workers, {args.minutes:g} min of faults, budget {budget.n} "
          f"{'trials' if budget.steps is None else 'trainings'}, "
          f"seed {args.seed}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hpo-soak-") as scratch:
        root = Path(scratch)
        server = PrivateServer(root)
        server.start()
        artifacts = root / "artifacts"
        artifacts.mkdir()
        logs = root / "logs"
        logs.mkdir()
        url = server.url
        study_args = ["--study", STUDY, "--storage", url]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HPO_ARTIFACTS": str(artifacts),
               "HPO_STORAGE_WAIT": "120", **LIVENESS}
        command = [sys.executable, "-m", "hpo.cli", "run", *study_args,
                   "--n-trials", str(budget.n), *SETTINGS]
        events, done, chaos_on = Events(), threading.Event(), threading.Event()
        chaos_on.set()
        port = free_port()
        dashboard = subprocess.Popen(
            [sys.executable, "-m", "hpo.cli", "dashboard", "--storage", url, "--port",
             str(port), "--artifacts", str(artifacts)], cwd=REPO, env=env,
            stdout=subprocess.DEVNULL, stderr=(logs / "dashboard.err").open("w"))
        workers: list[Worker] = []
        try:
            workers += [Worker(i, command, env, logs, random.Random(rng.random()), chaos_on)
                        for i in range(args.workers)]
            poller = threading.Thread(target=readers, args=(url, port, study_args, budget,
                                                            events, done), daemon=True)
            poller.start()
            chaos(server, workers, events, rng, started + 60 * args.minutes, chaos_on, done)
            faults_over = time.monotonic()
            for worker in workers:
                worker.thread.join(timeout=900)
            done.set()
            poller.join(timeout=120)
            ended = time.monotonic()
            results = check(url, artifacts, workers, events, budget)
        finally:
            done.set()
            for worker in workers:
                worker.stop()
            dashboard.terminate()
            dashboard.wait(timeout=30)
            server.destroy()
    outages = [end - start for start, end in events.outages if end is not None]
    print(f"\nfaults for {(faults_over - started) / 60:.1f} min, the fleet finished "
          f"{(ended - faults_over):.0f} s later; {len(outages)} outages "
          f"({sum(outages):.0f} s down, longest {max(outages, default=0):.0f} s); signals "
          f"{dict(events.signals)}; seed {args.seed}\n")
    print("| check | passed | figures |\n| --- | --- | --- |")
    for what, passed, figures in results:
        print(f"| {what} | {'yes' if passed else '**NO**'} | {figures} |")
    return 0 if all(passed for _, passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
