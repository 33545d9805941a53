"""How far a reader travels to follow one trial from its claim to its tell, measured on a real
trial (a tiny model, one epoch, on the CPU) rather than read off the code by hand.

The path is the calls, between the worker's `_run_claimed` and its return, of hpo functions
that receive the trial's own state (its context, its run, its plan, its live trial or the
Optuna trial, as an argument or held by one, such as a listener holding the run), and of
every function of hpo called from a module its own module imports (directly or not): a call
back, control running up against the imports, which a reader must follow too. Each function
counts once, at its first call, however often a loop repeats it; a property read or a
dataclass's generated method is attribute access, not a call to follow. A *stay* is a run of
consecutive calls of the path in one module: the reader opens one file and reads on. A
*climb* is a stay entered by a call back. docs/internals.md states the bounds this test
keeps.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, fields, is_dataclass

import grimp
import optuna
from conftest import run_in_process

from hpo.search.liveness import LiveTrial
from hpo.trial.context import TrialContext
from hpo.trial.planning import PlannedTrial
from hpo.trial.run import TrialRun

MAX_STAYS = 20
MAX_CLIMBS = 5
START = "_run_claimed"
STATE = (TrialContext, TrialRun, PlannedTrial, LiveTrial, optuna.Trial)


@dataclass(frozen=True)
class Call:
    module: str
    function: str
    climb: bool


def _carries(value: object) -> bool:
    if isinstance(value, STATE):
        return True
    if is_dataclass(value) and not isinstance(value, type):
        return any(isinstance(getattr(value, f.name, None), STATE) for f in fields(value))
    return False


def _read_as_attribute(frame: types.FrameType) -> bool:
    """A property read or a dataclass's generated method: attribute access to a reader."""
    code = frame.f_code
    if code.co_filename.startswith("<"):
        return True
    owner = frame.f_locals.get("self")
    return owner is not None and isinstance(getattr(type(owner), code.co_name, None),
                                            property)


def _receives_state(frame: types.FrameType) -> bool:
    code = frame.f_code
    count = code.co_argcount + code.co_kwonlyargcount
    return any(_carries(frame.f_locals.get(name)) for name in code.co_varnames[:count])


def _hpo_module(frame: types.FrameType | None) -> str | None:
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name if name == "hpo" or name.startswith("hpo.") else None


def _caller_module(frame: types.FrameType) -> str | None:
    """The module of the nearest function of hpo up the stack."""
    caller = frame.f_back
    while caller is not None:
        module = _hpo_module(caller)
        if module is not None:
            return module
        caller = caller.f_back
    return None


def trace_one_trial(tiny_study, storage) -> list[Call]:
    graph = grimp.build_graph("hpo")
    imports: dict[str, set[str]] = {}
    seen: set[object] = set()
    path: list[Call] = []
    depth = [0]

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event not in ("call", "return"):
            return
        module = _hpo_module(frame)
        if module is None:
            return
        if frame.f_code.co_name == START and module == "hpo.app.worker":
            depth[0] += 1 if event == "call" else -1
            return
        if event != "call" or not depth[0] or frame.f_code in seen:
            return
        if _read_as_attribute(frame):
            return
        upstream = imports.setdefault(module, graph.find_upstream_modules(module))
        climb = _caller_module(frame) in upstream
        if climb or _receives_state(frame):
            seen.add(frame.f_code)
            path.append(Call(module, frame.f_code.co_qualname, climb))

    sys.setprofile(profile)
    try:
        assert run_in_process(tiny_study, storage, 1, "--skip-check") == 0
    finally:
        sys.setprofile(None)
    return path


def climbs(path: list[Call]) -> list[list[Call]]:
    """The stays entered by a climb: the moves back up a reader makes."""
    return [stay for stay in stays(path) if stay[0].climb]


def stays(path: list[Call]) -> list[list[Call]]:
    runs: list[list[Call]] = []
    for call in path:
        if runs and runs[-1][-1].module == call.module:
            runs[-1].append(call)
        else:
            runs.append([call])
    return runs


def shown(path: list[Call]) -> str:
    return "\n".join(f"{'^' if c.climb else ' '} {c.module}.{c.function}" for c in path)


def test_a_trial_from_its_claim_to_its_tell_is_a_short_read(tiny_study, storage):
    path = trace_one_trial(tiny_study, storage)
    assert path, "the trace saw no call of the trial's path"
    modules = {c.module for c in path}
    # The path runs through the trial core, not around it.
    assert {"hpo.trial.executor", "hpo.trial.planning", "hpo.trial.drivers",
            "hpo.trial.records"} <= modules
    callbacks = [c for c in path if c.climb]
    print(f"{len(stays(path))} stays in {len(modules)} modules, {len(climbs(path))} climbs "
          f"({len(callbacks)} functions called back):\n{shown(path)}")
    assert len(stays(path)) <= MAX_STAYS, shown(path)
    assert len(climbs(path)) <= MAX_CLIMBS, shown(path)
