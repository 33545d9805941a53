"""The centre of the search space, tried first (`study.sampler.centre_first`).

The rule. A study whose file enqueues nothing (no `study.enqueue`, no `warm_start_from`)
runs one trial at the centre of its space before the random start-up: each range at its
midpoint (the geometric one where the range is log, on its step grid), each list of numbers
at its middle entry, each list of names at its first, in the order the study file gives
them. Parameters the device decides (`fp_precision: auto`) are left to the sampler. Syne
Tune's searchers start the same way (their `points_to_evaluate` default: the space's
mid-point, a categorical's first entry), and so does its BOHB in benchmarks/replay.py; a
fine-tuning space's centre is a plain configuration of the model the user lists first, at
the rate in the middle of their range, where a random first draw is as likely to be a toy
model at an extreme rate. Why it is hpo's default: benchmarks/README.md, "The centre of the
space first".
"""

from __future__ import annotations

import math
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from hpo.config import ADAPTER_KEYS, ADAPTER_RATE, FloatRange, IntRange, SearchSpace


def centre(dist: BaseDistribution) -> Any:
    """The centre of one parameter's distribution, a value the distribution contains."""
    if isinstance(dist, CategoricalDistribution):
        numbers = all(isinstance(c, int | float) and not isinstance(c, bool)
                      for c in dist.choices)
        if numbers:
            ordered = sorted(dist.choices)
            return ordered[(len(ordered) - 1) // 2]
        return dist.choices[0]
    if isinstance(dist, FloatDistribution | IntDistribution):
        low, high = dist.low, dist.high
        middle = (math.sqrt(low * high) if dist.log else (low + high) / 2)
        if dist.step is not None:
            middle = low + round((middle - low) / dist.step) * dist.step
        if isinstance(dist, IntDistribution):
            return int(min(max(round(middle), low), high))
        return float(min(max(middle, low), high))
    raise TypeError(f"no centre for {type(dist).__name__}")


def of_distributions(space: dict[str, BaseDistribution]) -> dict[str, Any]:
    """The centre of a space given as Optuna distributions (a table's, in the replay)."""
    return {name: centre(dist) for name, dist in space.items()}


def distribution(span: FloatRange | IntRange | list) -> BaseDistribution:
    """A study file's range or list as the distribution `hpo.space` samples it from."""
    if isinstance(span, list):
        return CategoricalDistribution(span)
    if isinstance(span, IntRange):
        return IntDistribution(span.low, span.high, log=span.log, step=span.step)
    return FloatDistribution(span.low, span.high, log=span.log)


def of_space(space: SearchSpace) -> dict[str, Any]:
    """The centre of a study file's search space, as a set `study.enqueue` would give: the
    adapter settings only where the centre's `peft` trains adapters, and the learning rate
    from the range that method samples it from; no precision (the device decides it)."""
    point: dict[str, Any] = {
        "model_name": centre(distribution(space.model_name)),
        "target_effective_batch_size": centre(distribution(space.target_effective_batch_size)),
    }
    extras = space.extras()
    adapted = "peft" in extras and centre(distribution(extras["peft"])) != "none"
    for name, span in extras.items():
        if name in ADAPTER_KEYS and not adapted:
            continue
        point[name] = centre(distribution(span))
    if adapted and space.adapter_learning_rate is not None:
        point[ADAPTER_RATE] = centre(distribution(space.adapter_learning_rate))
    else:
        point["learning_rate"] = centre(distribution(space.learning_rate))
    return point
