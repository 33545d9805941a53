"""Optuna's TPE sampler, its Gaussian tail masses computed by one numpy call instead of one
Python call per number: the same sampler, hours of replay shorter at 100 x 4 and 200 x 8.

Optuna 5's `_truncnorm._log_ndtr` maps a pure-Python `_log_ndtr_single` over its array
(`np.frompyfunc`), and the truncated-normal masses of every kernel at every candidate go
through it: at hundreds of trials it is most of a replayed world's time. SciPy's
`special.log_ndtr` computes the same function, vectorised, to within a few units in the last
place. `install()` swaps it in for the replay only (never in hpo itself); replay.py's
`--exact-tpe` leaves Optuna's as it is, and benchmarks/README.md shows the replay's figures
are the same either way.
"""

from __future__ import annotations

import numpy as np
from optuna.samplers._tpe import _truncnorm
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
