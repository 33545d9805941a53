"""The search space: which precisions a device may search, pinning the space in the study,
and suggesting one trial's parameters."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import optuna

from hpo.config import (
    ADAPTER_KEYS,
    ADAPTER_RATE,
    BY_DEVICE,
    PRECISIONS,
    FloatRange,
    IntRange,
    SearchSpace,
    StudyConfig,
)
from hpo.errors import SpaceError
from hpo.hardware import Device, native_precisions, precision_name, precision_names

PIN_ATTR = "search_space"


@dataclass(frozen=True)
class Params:
    model_name: str
    fp_precision: str
    target_effective_batch_size: int
    learning_rate: float
    extras: dict[str, float | int] = field(default_factory=dict)


@dataclass(frozen=True)
class PinnedSpace:
    declared: dict[str, Any]  # the search_space section as the study file states it
    # What `declared` resolved to on the first device that ran trials; None until one has,
    # for `auto` in a study created on a host that runs none (`hpo create`, "anywhere").
    fp_precision: tuple[str, ...] | None
    # For `auto`: how its precisions were decided, once for the study (`by_cost`, or every
    # native one where nothing was timed or trials had sampled already); None until then.
    decided: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        precisions = None if self.fp_precision is None else list(self.fp_precision)
        return {"declared": self.declared, "fp_precision": precisions,
                **({"decided": self.decided} if self.decided is not None else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PinnedSpace:
        precisions = data["fp_precision"]
        return cls(data["declared"], None if precisions is None else tuple(precisions),
                   data.get("decided"))

    def describe_precisions(self) -> str:
        if self.fp_precision is None:
            return (f"{self.declared.get('fp_precision')} (resolved by the first worker that "
                    f"runs trials, on its device)")
        listed = precision_names(self.fp_precision)
        if self.declared.get("fp_precision") == "auto" and self.decided is None:
            return f"{listed} (auto: the check keeps the fast ones)"
        return listed


def resolve_precisions(declared: str | list[str], device: Device) -> tuple[str, ...]:
    """`auto` and `native` keep what the device runs natively (`auto` is narrowed further
    by cost, `by_cost`); an explicit list must be all native, since an emulated precision
    is slower than fp32 and not worth a trial."""
    native = native_precisions(device)
    if declared in BY_DEVICE:
        return native
    for precision in declared:
        if precision not in native:
            raise SpaceError(
                f"fp_precision: {precision} is not native on {device.describe()} "
                f"(native: {', '.join(native)}); remove it or use auto"
            )
    return tuple(declared)


def declare(space: SearchSpace, device: Device | None) -> PinnedSpace:
    """The space as `device` would search it; with no device (a host that creates the study
    but runs no trial), `auto` stays unresolved and an explicit list unchecked."""
    declared = space.model_dump(mode="json", exclude_none=True)
    if device is None:
        return PinnedSpace(declared, None if space.by_device else tuple(space.fp_precision))
    return PinnedSpace(declared, resolve_precisions(space.fp_precision, device))


@dataclass(frozen=True)
class StepCosts:
    """What the study's check measured: the seconds of a training step per sequence, per
    configuration and precision; how far their repeats strayed (relative, the same shape);
    the precisions it could not judge beside other processes. What `by_cost` weighs."""

    seconds: dict[str, dict[str, float]]
    spreads: dict[str, dict[str, float]] | None = None
    crowded: frozenset[str] = frozenset()


@dataclass(frozen=True)
class CostChoice:
    kept: tuple[str, ...]
    dropped: dict[str, str]  # precision -> why
    # precision -> why the decision on it is unsettled: its cost ratio lies within the timed
    # rounds' spread of the tolerance's edge, so another run may keep or drop it otherwise.
    unsettled: dict[str, str] = field(default_factory=dict)


# Why a precision the check could not judge on the device alone is kept (`by_cost`).
CROWDED = ("kept untimed: the check ran out of memory in it only while other processes held "
           "part of the device")


def by_cost(seconds: dict[str, dict[str, float]], candidates: tuple[str, ...],
            tolerance: float, spreads: dict[str, dict[str, float]] | None = None,
            crowded: frozenset[str] = frozenset()) -> CostChoice:
    """The candidate precisions worth searching, from the measured seconds of a training
    step (per sequence) per configuration (model) and precision. A precision no model could
    step in is dropped. Of the rest, a precision's cost is its seconds summed over the
    configurations measured in all of them, each as likely in a trial, so the models that
    dominate a search's time decide, not a tiny model's noisy milliseconds; it is kept
    within `tolerance` of the cheapest precision's. With no configuration measured in all,
    they are all kept: nothing speaks against any.

    `spreads` (the same shape, each a time's relative spread over repeats) mark a decision
    unsettled where a precision's cost ratio to the cheapest lies within the combined spread of
    the two costs from the tolerance's edge. A `crowded` precision no model stepped in (each
    ran out of memory beside other processes, `check.crowded`) was not judged: the study
    decides once for good, so it is kept, untimed, and its decision marked unsettled."""
    usable = tuple(p for p in candidates if any(p in steps for steps in seconds.values()))
    untimed = {p: CROWDED for p in candidates if p in crowded and p not in usable}
    if not usable:
        return CostChoice(candidates, {}, untimed)
    dropped = {p: "no model stepped in it (hpo check)" for p in candidates
               if p not in usable and p not in untimed}
    complete = {name: steps for name, steps in seconds.items()
                if all(p in steps for p in usable)}
    if not complete:
        return CostChoice(tuple(p for p in candidates if p in usable or p in untimed), dropped,
                          untimed)
    cost = {p: sum(steps[p] for steps in complete.values()) for p in usable}
    cheapest = min(cost.values())
    fastest = min(usable, key=cost.__getitem__)
    kept = tuple(p for p in PRECISIONS
                 if p in untimed or (p in cost and cost[p] <= (1 + tolerance) * cheapest))
    dropped |= {p: f"its step took {cost[p] / cheapest:.2f}x {precision_name(fastest)}'s, "
                   f"summed over {len(complete)} model(s)" for p in usable if p not in kept}
    spread = {p: _spread(complete, spreads or {}, p) / cost[p] for p in usable}
    edge = 1 + tolerance
    unsettled = dict(untimed)
    for p in usable:
        ratio, noise = cost[p] / cheapest, spread[p] + spread[fastest]
        if p != fastest and noise > 0 and abs(ratio - edge) <= noise * ratio:
            unsettled[p] = (f"its step took {ratio:.2f}x {precision_name(fastest)}'s, within the "
                        f"timed rounds' spread (+/-{noise:.0%}) of the tolerance's {edge:.2f}x:"
                        f" another run may {'drop' if p in kept else 'keep'} it")
    return CostChoice(kept, dropped, unsettled)


def _spread(complete: dict[str, dict[str, float]], spreads: dict[str, dict[str, float]],
            precision: str) -> float:
    """A precision's summed step time's spread in seconds: each model's time times its
    relative spread (none where its time was not repeated)."""
    return sum(steps[precision] * spreads.get(name, {}).get(precision, 0.0)
               for name, steps in complete.items())


def validate_device(config: StudyConfig, device: Device) -> PinnedSpace:
    """The study file against a device that runs its trials: every precision it searches,
    and a bf16 body (`training.base_dtype`), must run natively there."""
    pinned = declare(config.search_space, device)
    if config.training.base_dtype == "bfloat16" and not device.native_bf16:
        raise SpaceError(f"training.base_dtype bfloat16: {device.describe()} runs bf16 only "
                         f"by emulation; use float32")
    return pinned


def pin(study: optuna.Study, space: SearchSpace, device: Device | None) -> PinnedSpace:
    """The space this worker searches: the study's pinned one, pinned now if it is new, its
    precisions resolved now if no worker has run trials yet (`device` None: pin without).

    A worker refuses to join when its study file describes another space, or when its device
    cannot run natively a precision the study already searches.
    """
    mine = declare(space, device)
    stored = study.user_attrs.get(PIN_ATTR)
    if stored is None:
        study.set_user_attr(PIN_ATTR, mine.to_json())
        return mine
    pinned = PinnedSpace.from_json(stored)
    if pinned.fp_precision is None and pinned.declared == mine.declared and device is not None:
        study.set_user_attr(PIN_ATTR, mine.to_json())
        return mine
    if pinned.declared != mine.declared:
        key = _first_difference(pinned.declared, mine.declared)
        raise SpaceError(
            f"study '{study.study_name}' was created with a different search space "
            f"(search_space.{key}: pinned {json.dumps(pinned.declared.get(key))}, "
            f"this file {json.dumps(mine.declared.get(key))}); to start over, delete it "
            f"(hpo delete --study NAME or --config FILE) or give this file another study.name"
        )
    if device is None or pinned.fp_precision is None:
        return pinned
    native = native_precisions(device)
    missing = [p for p in pinned.fp_precision if p not in native]
    if missing:
        raise SpaceError(
            f"study '{study.study_name}' searches fp_precision {', '.join(pinned.fp_precision)}, "
            f"but {device.describe()} runs {', '.join(missing)} only by emulation"
        )
    return pinned


def _first_difference(a: dict[str, Any], b: dict[str, Any]) -> str:
    return next(k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k))


def suggest(trial: optuna.Trial, pinned: PinnedSpace) -> Params:
    """One trial's parameters. With `adapter_learning_rate` the extras, `peft` among them,
    are sampled before the rate, which then comes from the range of the trial's method;
    without it the order is the one earlier releases sampled in, so a seeded study repeats."""
    assert pinned.fp_precision is not None, "a worker resolves the precisions before trials"
    space = SearchSpace.model_validate(pinned.declared)
    model_name = trial.suggest_categorical("model_name", space.model_name)
    fp_precision = trial.suggest_categorical("fp_precision", list(pinned.fp_precision))
    batch = trial.suggest_categorical("target_effective_batch_size",
                                      space.target_effective_batch_size)
    if space.adapter_learning_rate is None:
        rate = _suggest(trial, "learning_rate", space.learning_rate)
        extras = _extras(trial, space)
    else:
        extras = _extras(trial, space)
        adapted = extras.get("peft", "none") != "none"
        rate = (_suggest(trial, ADAPTER_RATE, space.adapter_learning_rate) if adapted
                else _suggest(trial, "learning_rate", space.learning_rate))
    return Params(model_name, fp_precision, batch, rate, extras)


def _extras(trial: optuna.Trial, space: SearchSpace) -> dict[str, Any]:
    """The extra parameters; a trial without adapters samples no adapter setting (a
    conditional parameter, which TPE with `group` models apart)."""
    extras: dict[str, Any] = {}
    for name, dist in space.extras().items():
        if name in ADAPTER_KEYS and extras.get("peft", "none") == "none":
            continue
        extras[name] = _suggest(trial, name, dist)
    return extras


def _suggest(trial: optuna.Trial, name: str, dist: FloatRange | IntRange | list) -> Any:
    if isinstance(dist, list):
        return trial.suggest_categorical(name, dist)
    if isinstance(dist, IntRange):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, log=dist.log)
