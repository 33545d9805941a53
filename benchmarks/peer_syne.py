"""The model-based multi-fidelity peer: Syne Tune's Hyper-Tune (Li et al., VLDB 2022), run by
Syne Tune 0.13's own scheduler, driven asynchronously as Syne Tune's simulator backend drives
it: `suggest` when a worker is free, `on_trial_result` at every epoch's end (its decision
stops a trial), `on_trial_complete` at a trial's end.

Why Hyper-Tune: it is the maintained model-based variant of asynchronous successive halving
(a Gaussian process per rung, rungs weighted by how well they rank what later rungs see, the
bracket chosen by that model), the family hpo's own search belongs to; 0.13 is the last Syne
Tune release that holds it and MOBSTER. Its settings are Syne Tune's defaults
(`HyperbandScheduler`: type "stopping", grace period 1, reduction factor 3; the searcher's
defaults), given the table's epochs as `max_t` and the repetition's seed.

Syne Tune 0.13 pins numpy below 1.27, which hpo's environment cannot share, so the scheduler
runs in its own environment and process and this file is both ends of a pipe:

    python3 -m venv .venv-syne && .venv-syne/bin/pip install -r benchmarks/peers/syne.txt
    python benchmarks/replay.py ... --policies hyper-tune ...   # finds .venv-syne/bin/python

`serve()` (in Syne Tune's environment) answers JSON lines on stdin; `Scheduler` (in hpo's)
starts one server per process and speaks to it. HPO_SYNE_PYTHON names another interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = Path(os.environ.get("HPO_SYNE_PYTHON", ROOT / ".venv-syne" / "bin" / "python"))


def available() -> bool:
    return PYTHON.is_file()


# ---------------------------------------------------------------------------- hpo's side


class Server:
    """One Syne Tune process, shared by every scheduler of this process."""

    def __init__(self) -> None:
        if not available():
            raise SystemExit(f"the hyper-tune peer needs Syne Tune 0.13 at {PYTHON}: "
                             "python3 -m venv .venv-syne && .venv-syne/bin/pip install -r "
                             "benchmarks/peers/syne.txt")
        self.process = subprocess.Popen(
            [str(PYTHON), __file__, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            # Syne Tune's notes on missing extras; a failure comes back as a reply.
            stderr=subprocess.DEVNULL, text=True, bufsize=1,
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                 "MKL_NUM_THREADS": "1"})
        self.count = 0

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(message) + "\n")
        answer = self.process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the Syne Tune server ended (exit {self.process.poll()})")
        reply = json.loads(answer)
        if "error" in reply:
            raise RuntimeError(f"Syne Tune: {reply['error']}")
        return reply


_SERVER: Server | None = None


def server() -> Server:
    global _SERVER
    if _SERVER is None or _SERVER.process.poll() is not None:
        _SERVER = Server()
        atexit.register(shutdown)
    return _SERVER


def shutdown() -> None:
    """Ends this process's server: it leaves when its input closes."""
    global _SERVER
    if _SERVER is not None:
        assert _SERVER.process.stdin is not None
        _SERVER.process.stdin.close()
        _SERVER.process.wait(timeout=30)
        _SERVER = None


class Scheduler:
    """A Hyper-Tune scheduler in the server: `space` maps names to Optuna distributions'
    JSON (`optuna.distributions.distribution_to_json`)."""

    def __init__(self, space: dict[str, str], max_t: int, seed: int, method: str = "bohb",
                 mode: str = "max") -> None:
        self.server = server()
        self.server.count += 1
        self.id = self.server.count
        self.server.ask({"op": "new", "id": self.id, "space": space, "max_t": max_t,
                         "seed": seed, "mode": mode, "method": method})

    def suggest(self, trial: int) -> dict[str, Any]:
        return self.server.ask({"op": "suggest", "id": self.id, "trial": trial})["config"]

    def result(self, trial: int, epoch: int, value: float) -> bool:
        """True: the scheduler stops the trial here."""
        return self.server.ask({"op": "result", "id": self.id, "trial": trial,
                                "epoch": epoch, "value": value})["stop"]

    def complete(self, trial: int) -> None:
        """A trial that ran to its end (a stopped one is not told again, as in Syne Tune's
        own loop)."""
        self.server.ask({"op": "complete", "id": self.id, "trial": trial})

    def close(self) -> None:
        self.server.ask({"op": "drop", "id": self.id})


# ---------------------------------------------------------------------------- Syne Tune's side


# The schedulers a replay may name: Syne Tune's own classes at their defaults.
METHODS = {"bohb": "BOHB", "mobster": "MOBSTER", "hyper-tune": "HyperTune", "asha": "ASHA"}


def domain(encoded: str) -> Any:
    """An Optuna distribution's JSON as Syne Tune's domain."""
    from syne_tune.config_space import choice, lograndint, loguniform, randint, uniform

    found = json.loads(encoded)
    kind, a = found["name"], found["attributes"]
    if kind == "CategoricalDistribution":
        return choice(list(a["choices"]))
    if kind == "FloatDistribution":
        return (loguniform if a["log"] else uniform)(a["low"], a["high"])
    if kind == "IntDistribution":
        return (lograndint if a["log"] else randint)(a["low"], a["high"])
    raise ValueError(f"no Syne Tune domain for {kind}")


def serve() -> None:
    # Syne Tune prints notes on import: stdout carries only the replies.
    out, sys.stdout = sys.stdout, sys.stderr
    import datetime
    import logging
    import warnings

    warnings.filterwarnings("ignore")

    from syne_tune.backend.trial_status import Trial
    from syne_tune.optimizer import baselines
    from syne_tune.optimizer.scheduler import SchedulerDecision

    logging.disable(logging.WARNING)
    schedulers: dict[int, Any] = {}
    trials: dict[tuple[int, int], Any] = {}
    last: dict[tuple[int, int], dict] = {}
    for line in sys.stdin:
        message = json.loads(line)
        op, key = message["op"], message["id"]
        try:
            if op == "new":
                space = {name: domain(d) for name, d in message["space"].items()}
                method = METHODS[message.get("method", "bohb")]
                schedulers[key] = getattr(baselines, method)(
                    space, metric="objective", resource_attr="epoch", mode=message["mode"],
                    max_t=message["max_t"], random_seed=message["seed"])
                reply: dict[str, Any] = {}
            elif op == "suggest":
                number = message["trial"]
                suggestion = schedulers[key].suggest(number)
                trial = Trial(trial_id=number, config=suggestion.config,
                              creation_time=datetime.datetime.now())
                trials[key, number] = trial
                schedulers[key].on_trial_add(trial)
                reply = {"config": suggestion.config}
            elif op == "result":
                result = {"objective": message["value"], "epoch": message["epoch"]}
                last[key, message["trial"]] = result
                decision = schedulers[key].on_trial_result(trials[key, message["trial"]],
                                                           result)
                reply = {"stop": decision == SchedulerDecision.STOP}
            elif op == "complete":
                number = message["trial"]
                schedulers[key].on_trial_complete(trials[key, number], last[key, number])
                reply = {}
            else:  # drop
                schedulers.pop(key, None)
                for k in [k for k in trials if k[0] == key]:
                    trials.pop(k)
                    last.pop(k, None)
                reply = {}
        except Exception as error:  # noqa: BLE001 - the other end says what failed
            reply = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(reply, default=float) + "\n")
        out.flush()


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve()
