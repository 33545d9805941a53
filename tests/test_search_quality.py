"""benchmarks/search_quality.py's report of hpo's variants alone (--no-default), on made-up
runs: each seed's variants against the first variant's run of that seed."""

from __future__ import annotations

import search_quality


def run(label: str, seed: int, wall: float, trials: list[tuple[str, float, float]]) -> dict:
    return {"tool": "hpo", "label": label, "seed": seed, "machine": "m", "walls": [wall],
            "trial_budget_wall": wall,
            "trials": [{"number": i, "state": state, "value": value, "start": end - 10,
                        "end": end} for i, (state, value, end) in enumerate(trials)]}


def test_variants_alone_are_compared_with_the_first(tmp_path):
    results = {"n_trials": 2, "machine": "m", "cores": 2, "runs": [
        run("a", 1, 100, [("COMPLETE", 0.5, 40), ("PRUNED", 0.2, 100)]),
        run("b", 1, 120, [("COMPLETE", 0.4, 30), ("COMPLETE", 0.6, 90)]),
        run("a", 2, 100, [("COMPLETE", 0.7, 50), ("COMPLETE", 0.1, 100)]),
        run("b", 2, 90, [("COMPLETE", 0.3, 45), ("PRUNED", 0.9, 90)]),
    ]}
    report = search_quality.render(results, tmp_path / "plot.png")
    rows = [line for line in report.splitlines() if line.startswith("| 1 ") or
            line.startswith("| 2 ")]
    # a's pruned compute counts as lost (10 of 20 s); b reaches a's 0.5 with its 0.6 at 90 s.
    assert rows[0] == "| 1 | m | 100 s, 0.5000, 50% | 120 s, 0.6000, 0% | 0.6000, 90 s (90%) |"
    # A pruned trial's value is no model: b never reaches a's 0.7.
    assert rows[1] == "| 2 | m | 100 s, 0.7000, 0% | 90 s, 0.3000, 50% | 0.3000, never |"
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_hpo_runs_on_several_workers_through_hpo_runs_own_launcher(tmp_path):
    assert "--workers=2" in search_quality.Run("hpo", 4, [], tmp_path, workers=2).command(20,
                                                                                          None)
    assert not any(part.startswith("--workers")
                   for part in search_quality.Run("hpo", 4, [], tmp_path).command(20, None))
    results = {"n_trials": 2, "workers": 2, "machine": "m", "cores": 2, "runs": [
        run("a", 1, 100, [("COMPLETE", 0.5, 40), ("PRUNED", 0.2, 100)])]}
    report = search_quality.render(results, tmp_path / "plot.png")
    assert report.startswith("hpo's variants, 2 trials each on 2 workers, against a (a):")
