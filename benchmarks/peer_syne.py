"""The model-based multi-fidelity peer: Syne Tune 0.13's schedulers, run by Syne Tune's own
code, driven asynchronously as its tuner drives them over the simulator backend: `suggest`
when a worker is free (a new trial, or a paused one it promotes), `on_trial_result` at every
epoch's end (its decision stops or pauses a trial, and a stopped or paused trial is then
removed with `on_trial_remove`), `on_trial_complete` at a trial's end.

The replay's `bohb` is BOHB (Falkner et al., 2018): asynchronous successive halving's
stopping rule with a kernel density model fitted at the highest rung with enough data. MOBSTER
and Hyper-Tune (Gaussian processes per rung) are here too, but fit at every decision and are
too slow for thousands of replayed worlds (benchmarks/README.md gives the figures). In
promotion form (`asha-promotion`, `bohb-promotion`) a scheduler pauses each trial at a rung
and resumes the ones it promotes (Li et al., 2020): the form issue 63 weighs for hpo. Every
setting is Syne Tune's default (grace period 1, reduction factor 3, the searcher's
defaults), given the table's epochs as `max_t` and the repetition's seed.

Syne Tune 0.13 pins numpy below 1.27, which hpo's environment cannot share, so the scheduler
runs in its own environment and process and this file is both ends of a pipe:

    python3 -m venv .venv-syne && .venv-syne/bin/pip install -r benchmarks/peers/syne.txt
    python benchmarks/replay.py ... --policies bohb ...   # finds .venv-syne/bin/python

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
            raise SystemExit(f"the Syne Tune peers need Syne Tune 0.13 at {PYTHON}: "
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
    """A Syne Tune scheduler in the server (METHODS names them): `space` maps names to
    Optuna distributions' JSON (`optuna.distributions.distribution_to_json`)."""

    def __init__(self, space: dict[str, str], max_t: int, seed: int, method: str = "bohb",
                 mode: str = "max") -> None:
        self.server = server()
        self.server.count += 1
        self.id = self.server.count
        self.server.ask({"op": "new", "id": self.id, "space": space, "max_t": max_t,
                         "seed": seed, "mode": mode, "method": method})

    def suggest(self, trial: int) -> tuple[dict[str, Any] | None, int | None]:
        """A new trial's config (numbered `trial`), or the number of a paused trial to
        resume: (config, None) or (None, number)."""
        reply = self.server.ask({"op": "suggest", "id": self.id, "trial": trial})
        return reply["config"], reply["resume"]

    def result(self, trial: int, epoch: int, value: float) -> str:
        """The scheduler's decision here: "continue", "stop" or "pause"."""
        return self.server.ask({"op": "result", "id": self.id, "trial": trial,
                                "epoch": epoch, "value": value})["decision"]

    def complete(self, trial: int) -> None:
        """A trial that ran to its end (a stopped one is not told again, as in Syne Tune's
        own loop)."""
        self.server.ask({"op": "complete", "id": self.id, "trial": trial})

    def close(self) -> None:
        self.server.ask({"op": "drop", "id": self.id})


# ---------------------------------------------------------------------------- Syne Tune's side


# The schedulers a replay may name: Syne Tune's own classes at their defaults, the form
# ("stopping" is Syne Tune's default) named where it is not.
METHODS: dict[str, tuple[str, dict[str, str]]] = {
    "bohb": ("BOHB", {}), "mobster": ("MOBSTER", {}), "hyper-tune": ("HyperTune", {}),
    "asha": ("ASHA", {}), "asha-promotion": ("ASHA", {"type": "promotion"}),
    "bohb-promotion": ("BOHB", {"type": "promotion"})}


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
                method, form = METHODS[message.get("method", "bohb")]
                schedulers[key] = getattr(baselines, method)(
                    space, metric="objective", resource_attr="epoch", mode=message["mode"],
                    max_t=message["max_t"], random_seed=message["seed"], **form)
                reply: dict[str, Any] = {}
            elif op == "suggest":
                number = message["trial"]
                suggestion = schedulers[key].suggest(number)
                if not suggestion.spawn_new_trial_id:  # a paused trial promoted
                    reply = {"config": None, "resume": suggestion.checkpoint_trial_id}
                else:
                    trial = Trial(trial_id=number, config=suggestion.config,
                                  creation_time=datetime.datetime.now())
                    trials[key, number] = trial
                    schedulers[key].on_trial_add(trial)
                    reply = {"config": suggestion.config, "resume": None}
            elif op == "result":
                result = {"objective": message["value"], "epoch": message["epoch"]}
                last[key, message["trial"]] = result
                trial = trials[key, message["trial"]]
                decision = schedulers[key].on_trial_result(trial, result)
                if decision in (SchedulerDecision.STOP, SchedulerDecision.PAUSE):
                    schedulers[key].on_trial_remove(trial)  # as Syne Tune's tuner does
                reply = {"decision": str(decision).lower()}
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
