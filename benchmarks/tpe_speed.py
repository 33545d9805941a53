"""Optuna's TPE sampler, its Gaussian tail masses computed by one numpy call instead of one
Python call per number: the same sampler, hours of replay shorter at 100 x 4 and 200 x 8.

Optuna 5's `_truncnorm._log_ndtr` maps a pure-Python `_log_ndtr_single` over its array
(`np.frompyfunc`), and the truncated-normal masses of every kernel at every candidate go
through it: at hundreds of trials it is most of a replayed world's time. SciPy's
`special.log_ndtr` computes the same function, vectorised, to within a few units in the last
place. `install()` swaps it in for the replay only (never in hpo itself); replay.py's
`--exact-tpe` leaves Optuna's as it is, and benchmarks/README.md shows the replay's figures
are the same either way.

`one_search_space` gives every per-trial TPE of one study (`PerTrialSeeded`: a sampler made
for each trial) the one incremental intersection search space a TPE seeded once keeps: made
afresh each trial it reads the whole history again, which at the thousands of trials an
equal-compute replay starts was a quarter of a world's time. The answer is the same (Optuna
caches it so), and so is every draw.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import optuna
from optuna.samplers._tpe import _truncnorm
from optuna.search_space import IntersectionSearchSpace
from scipy.special import log_ndtr

# Private to Optuna: the name, and that `_log_gauss_mass` looks it up at call time, are
# checked by tests/test_tpe_speed.py, which fails when Optuna changes them.
OPTUNAS = _truncnorm._log_ndtr


def vectorised(a: np.ndarray) -> np.ndarray:
    """log(Phi(a)) of every element, as Optuna's `_log_ndtr` returns it (float)."""
    return log_ndtr(np.asarray(a, dtype=float))


def install() -> None:
    _truncnorm._log_ndtr = vectorised


def uninstall() -> None:
    _truncnorm._log_ndtr = OPTUNAS


def one_search_space(make: Callable[[int], optuna.samplers.TPESampler]
                     ) -> Callable[[int], optuna.samplers.TPESampler]:
    """`make`, its samplers sharing one study's intersection search space (one study each:
    Optuna's cache is per study). Private to Optuna: `TPESampler._search_space`, checked by
    tests/test_tpe_speed.py, which fails when Optuna renames or stops using it."""
    space = IntersectionSearchSpace(include_pruned=True)

    def made(number: int) -> optuna.samplers.TPESampler:
        sampler = make(number)
        sampler._search_space = space
        return sampler

    return made
