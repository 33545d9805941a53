"""benchmarks/replay.py: search policies replayed in simulated time on a table of learning
curves. Here on a made-up table whose curves and seconds are known, so every time and score
the simulation gives can be worked out by hand."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import replay  # noqa: E402

MINILM = "sentence-transformers/all-MiniLM-L6-v2"
TINY = "data/demo/models/tiny-bert"
RATES = [1.0e-5, 2.15e-5, 4.64e-5, 1.0e-4, 2.15e-4, 4.64e-4, 1.0e-3]
COLUMNS = ["model", "precision", "batch", "learning_rate", "weight_decay", "seed", "f1",
           "epoch_seconds", "setup_seconds", "tokenization_seconds", "batch_search_seconds",
           "batch_probes", "model_seconds"]
EPOCH_SECONDS = {MINILM: 10.0, TINY: 1.0}


def made_up_table(seeds: int = 2) -> dict:
    """Scores that peak at a rate of 2.15e-4, MiniLM above tiny-bert, seed s adding 0.01*s;
    each epoch costs EPOCH_SECONDS, each set-up 2 s, a seed's first trial of a model 5 s of
    tokenization, and its first of a model and batch 3 s of batch search."""
    rows = []
    for seed in range(seeds):
        for model in (MINILM, TINY):
            searched = set()
            for batch in (8, 16, 32):
                for wd in (0.0, 0.05, 0.1):
                    for rate in RATES:
                        top = (0.6 if model == MINILM else 0.4) - 0.05 * abs(
                            math.log10(rate / 2.15e-4)) + 0.01 * seed - wd * 0.1
                        f1 = [round(top * share, 4) for share in (0.7, 0.9, 1.0, 0.98)]
                        first = not rows or rows[-1][0] != model or rows[-1][5] != seed
                        probes = int((model, batch) not in searched)
                        searched.add((model, batch))
                        tokenize = 5.0 if first else 0.0
                        search = 3.0 * probes
                        rows.append([model, "none", batch, rate, wd, seed, f1,
                                     [EPOCH_SECONDS[model]] * 4, 2.0 + tokenize + search,
                                     tokenize, search, probes, 1.0])
    return {"format": 1, "study": "demo", "epochs": 4, "machine": "test CPU", "cores": 2,
            "versions": {}, "dates": ["2026-11-27"], "columns": COLUMNS, "train_size": 420,
            "rows": rows}


@pytest.fixture(scope="module")
def curves() -> replay.Curves:
    return replay.Curves(made_up_table())


def test_a_grid_point_reads_its_row_and_a_rate_between_two_is_interpolated_in_log(curves):
    at_grid = curves.lookup(MINILM, "none", 16, 2.15e-4, 0.0, world=0)
    top = at_grid.scores[2]  # seed 0's 0.6 or seed 1's 0.61, as the world draws
    assert top in (pytest.approx(0.6), pytest.approx(0.61))
    assert at_grid.scores == pytest.approx((0.7 * top, 0.9 * top, top, 0.98 * top), abs=2e-4)
    assert at_grid.seconds == (10.0,) * 4
    assert at_grid.setup == 2.0  # tokenization and batch search are charged apart
    between = curves.lookup(MINILM, "none", 16, math.sqrt(1e-4 * 2.15e-4), 0.0, world=0)
    low = curves.lookup(MINILM, "none", 16, 1e-4, 0.0, world=0)
    assert between.scores[2] == pytest.approx((low.scores[2] + at_grid.scores[2]) / 2)
    # The nearest weight decay of the grid; rates outside the grid are clipped to it.
    assert curves.lookup(MINILM, "none", 16, 2.15e-4, 0.04, 0) == curves.lookup(
        MINILM, "none", 16, 2.15e-4, 0.05, 0)
    assert curves.lookup(TINY, "none", 8, 1e-6, 0.0, 0) == curves.lookup(
        TINY, "none", 8, 1e-5, 0.0, 0)


def test_a_world_fixes_each_points_training_seed_and_worlds_differ(curves):
    draws = {w: curves.lookup(MINILM, "none", 32, 1e-4, 0.1, world=w).scores[2]
             for w in range(20)}
    assert curves.lookup(MINILM, "none", 32, 1e-4, 0.1, world=3).scores[2] == draws[3]
    assert len(set(draws.values())) == 2  # both recorded seeds are read


def test_first_tokenization_and_batch_search_costs_come_from_the_table(curves):
    assert curves.costs.tokenization == {MINILM: 5.0, TINY: 5.0}
    assert curves.costs.batch_search[(MINILM, "none", 8)] == 3.0


@dataclass
class Scripted:
    """A policy that runs the given configurations in turn and stops a trial at the epochs
    given; it notes how many epoch reports it had heard at each ask."""
    configs: list[replay.Config]
    stop_at: dict[int, int] = field(default_factory=dict)
    name: str = "scripted"
    startup: float = 1.0
    gap: float = 0.0
    heard: list[int] = field(default_factory=list)
    reports: int = 0
    told: list[tuple[int, bool]] = field(default_factory=list)

    def ask(self) -> Scripted.Run:
        self.heard.append(self.reports)
        return Scripted.Run(self, len(self.heard) - 1, self.configs[len(self.heard) - 1])

    def slowdown(self, model: str) -> float:
        return 1.0

    @dataclass
    class Run:
        policy: Scripted
        number: int
        config: replay.Config

        def report(self, epoch: int, score: float) -> bool:
            self.policy.reports += 1
            return self.policy.stop_at.get(self.number) == epoch

        def finish(self, scores: list[float], stopped: bool) -> None:
            self.policy.told.append((self.number, stopped))


def config(model: str, batch: int = 16) -> replay.Config:
    return replay.Config(model, "none", batch, 2.15e-4, 0.0)


def test_one_worker_runs_trials_back_to_back_paying_first_costs_once(curves):
    policy = Scripted([config(MINILM), config(MINILM), config(TINY)], stop_at={1: 2})
    trials = replay.simulate(policy, curves, 0, budget=3, workers=1, epochs=4,
                             searches_batches=True)
    # start-up 1; set-up 2 + tokenization 5 + batch search 3; 4 epochs of 10 s
    assert [(t.start, t.end, t.state) for t in trials] == [
        (1.0, 51.0, "COMPLETE"),
        (51.0, 73.0, "PRUNED"),  # set-up 2, pruned after 2 epochs: the search is cached
        (73.0, 87.0, "COMPLETE")]  # tiny-bert: 2 + 5 + 3 + 4 x 1
    assert policy.told == [(0, False), (1, True), (2, False)]
    assert trials[0].value == max(trials[0].scores) and trials[1].value is None
    assert replay.wall(trials, 3) == 87.0


def test_a_models_first_batch_search_covers_every_later_batch(curves):
    """As hpo does: the first search of a model and precision probes up to the physical
    limit, so a later trial at another effective batch pays no search."""
    policy = Scripted([config(TINY, batch=8), config(TINY, batch=32)])
    trials = replay.simulate(policy, curves, 0, budget=2, workers=1, epochs=4,
                             searches_batches=True)
    # start-up 1; 2 + 5 + 3 + 4 x 1 = 14; then 2 + 4 x 1 = 6, no search
    assert [(t.start, t.end) for t in trials] == [(1.0, 15.0), (15.0, 21.0)]


def test_asks_see_exactly_the_reports_made_before_them(curves):
    policy = Scripted([config(TINY), config(MINILM), config(TINY), config(TINY)])
    trials = replay.simulate(policy, curves, 0, budget=4, workers=2, epochs=4)
    # Both workers ask at the start-up. The tiny-bert trial reports at 9, 10, 11 and 12,
    # and its worker asks at 12 having heard those 4. The next tiny-bert trial reports at
    # 15, 16, 17 and 18, where MiniLM's first epoch ends too, and came first: 9 heard.
    assert policy.heard == [0, 0, 4, 9]
    assert [t.end for t in trials] == [12.0, 18.0, 24.0, 48.0]


def test_hpo_keeps_starting_trials_until_the_horizon(curves):
    policy = Scripted([config(TINY)] * 10)
    trials = replay.simulate(policy, curves, 0, budget=2, workers=1, epochs=2, horizon=30.0)
    # 1 + 7 + 2 x 1, then 2 + 2 x 1 each: ends 10, 14, 18, 22, 26 and 30 (started at 26)
    assert len(trials) == 6 and trials[-1].start < 30.0 <= trials[-1].end


def test_g1_counts_ties_apart_and_g2_is_infinite_where_hpo_never_gets_there():
    reps = [
        {"hpo": {"steps": [[10, 0.5], [30, 0.7]]}, "peer": {"wall": 40, "steps": [[40, 0.6]]}},
        {"hpo": {"steps": [[10, 0.6]]}, "peer": {"wall": 40, "steps": [[20, 0.6]]}},
        {"hpo": {"steps": [[10, 0.5]]}, "peer": {"wall": 40, "steps": [[20, 0.6]]}},
    ]
    figures = replay.versus(reps, "peer")
    assert figures["g1"] == pytest.approx(2 / 3, abs=1e-3)
    assert figures["ties"] == pytest.approx(1 / 3, abs=1e-3)
    assert figures["g1_strict"] == pytest.approx(1 / 3, abs=1e-3)
    assert figures["g2_median"] == pytest.approx(0.75)  # 30/40, 10/40, never
    assert figures["never"] == 1
    low, high = figures["g1_interval"]
    assert 0 < low < 2 / 3 < high < 1


def test_the_intervals_are_wilsons_for_g1_and_order_statistics_for_the_median_g2():
    # 67 of 100: Wilson's 95% interval is 0.573-0.754, short of a goal of 0.8.
    assert replay.share_interval(67, 100) == [0.573, 0.754]
    assert replay.share_interval(100, 100)[1] == 1.0
    # 100 values: the median lies between the 40th and 61st (binomial(100, 1/2) at 2.5%).
    values = [float(v) for v in range(1, 101)]
    assert replay.median_interval(values) == [40.0, 61.0]
    assert replay.median_interval([*values[:55], *[math.inf] * 45]) == [40.0, math.inf]
    # 5 values hold their median between the extremes only 94% of the time: no interval.
    assert replay.median_interval([0.1, 0.2, 0.3, 0.4, 0.5]) is None
    assert replay.median_interval([0.1, 0.2, 0.3, 0.4, 0.5, 0.6]) == [0.1, 0.6]


def test_hpo_policy_is_built_by_hpos_own_functions_and_searches_its_precisions(curves):
    from hpo import study_files

    study = study_files.load(study_files.study_path("demo"), ["training.epochs=4"])
    policy = replay.hpo_policy(study, curves, seed=3)
    assert isinstance(policy.study.pruner, optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(policy.study.sampler, optuna.samplers.TPESampler)
    trials = replay.simulate(policy, curves, 0, budget=8, workers=2, epochs=4,
                             searches_batches=True)
    assert len(trials) == 8 and {t.config.precision for t in trials} == {"none"}
    assert {t.config.model for t in trials} <= {MINILM, TINY}
    again = replay.simulate(replay.hpo_policy(study, curves, seed=3), curves, 0, budget=8,
                            workers=2, epochs=4, searches_batches=True)
    assert [t.config for t in again] == [t.config for t in trials]  # seeded: it repeats


def test_every_policy_runs_and_the_output_holds_g1_and_g2_per_peer(tmp_path):
    table = tmp_path / "table.json"
    made = made_up_table()
    made["machine"] = json.loads((REPO / "benchmarks" / "search_quality.json").read_text())[
        "runs"][0]["machine"]
    table.write_text(json.dumps(made))
    output = tmp_path / "out.json"
    names = [p for p in replay.PEERS if p != "ray"]
    replay.main(["--budget", "6", "--workers", "2", "--repetitions", "2", "--table",
                 str(table), "--output", str(output), "--policies", *names])
    result = json.loads(output.read_text())
    assert set(result["versus"]) == set(names)
    for figures in result["versus"].values():
        assert 0 <= figures["g1"] <= 1 and figures["g2_median"] >= 0
    assert result["measured"]["slowdowns"]["novice"]  # measured on that machine's runs
    assert len(result["repetitions_data"]) == 2


def test_even_costs_price_every_tool_as_hpo_and_its_batch_searches_as_free(tmp_path,
                                                                          monkeypatch):
    real = json.loads((REPO / "benchmarks" / "search_quality.json").read_text())
    made = made_up_table()
    made["machine"] = real["runs"][0]["machine"]
    facts = replay.measured(real, made["machine"])
    assert facts.startup["expert"] != facts.startup["hpo"] and facts.slowdowns["expert"]
    curves = replay.Curves(made)
    assert curves.costs.batch_search
    priced: list[tuple] = []

    def simulate(policy, table, *args, **kwargs):
        priced.append((policy.name, policy.startup, policy.gap,
                       policy.slowdown(table.models[0]), table.costs.batch_search))
        return real_simulate(policy, table, *args, **kwargs)

    real_simulate = replay.simulate
    monkeypatch.setattr(replay, "simulate", simulate)
    study = replay.study_files.load(replay.study_files.study_path("demo"))
    replay.repetition(["hpo", "expert", "novice"], study, curves, 0, budget=4, workers=1,
                      facts=replay.even(facts, curves))
    assert sorted(p[0] for p in priced) == ["expert", "hpo", "novice"]
    for policy in priced:
        assert policy[1:] == (facts.startup["hpo"], facts.gaps["hpo"], 1.0, {}), policy
    # The command line says so in its output.
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made))
    output = tmp_path / "out.json"
    replay.main(["--budget", "4", "--repetitions", "1", "--table", str(table), "--output",
                 str(output), "--policies", "expert", "--even-costs"])
    result = json.loads(output.read_text())
    assert result["even_costs"] and result["measured"]["slowdowns"] == {}
    assert set(result["measured"]["startup"].values()) == {facts.startup["hpo"]}


def test_ray_policy_drives_rays_own_asha_and_optuna_search(curves):
    pytest.importorskip("ray.tune", reason="Ray Tune comes with '.[bench]'")
    from hpo import study_files

    study = study_files.load(study_files.study_path("demo"), ["training.epochs=4"])
    policy = replay.RayPolicy("ray", study.search_space, "none", 0, 4, 6)
    trials = replay.simulate(policy, curves, 0, budget=12, workers=2, epochs=4)
    assert len(trials) == 12
    # ASHA (reduction factor 2) stops some trials at the first or second rung.
    assert any(t.state == "PRUNED" for t in trials)


def test_iqm_is_the_mean_of_the_middle_half():
    import numpy as np

    assert replay.iqm(np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 100.0])) == 3.5


def rendered_run(tmp_path) -> Path:
    out = tmp_path / "out.json"
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    replay.main(["--budget", "4", "--workers", "1", "--repetitions", "3", "--table",
                 str(table), "--output", str(out), "--policies", "random", "expert"])
    return out


def test_render_writes_a_row_per_setting_and_peer_and_the_regret_bands_hold_the_iqm(
        tmp_path):
    out = rendered_run(tmp_path)
    text = replay.render([out], None)
    assert "| 4 trials x 1 | random |" in text and "| 4 trials x 1 | expert |" in text
    _, curves = replay.regret_curves(json.loads(out.read_text()))
    mean, low, high = curves["expert"]
    assert (low <= mean + 1e-9).all() and (mean <= high + 1e-9).all()
    assert mean[-1] <= mean[0]  # the best so far only improves


def test_render_plots_the_regret_curves(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot's matplotlib comes with '.[bench]'")
    replay.render([rendered_run(tmp_path)], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_reality_replays_the_real_runs_of_the_tables_cpu_kind(tmp_path, capsys):
    real = json.loads((REPO / "benchmarks" / "search_quality.json").read_text())
    machine = next(r["machine"] for r in real["runs"] if r["seed"] == 3)
    real["runs"] = [r for r in real["runs"] if r["tool"] != "ray"]  # Ray: its own test
    (tmp_path / "real.json").write_text(json.dumps(real))
    table = made_up_table()
    table["machine"] = machine
    (tmp_path / "table.json").write_text(json.dumps(table))
    replay.main(["--reality", "--real", str(tmp_path / "real.json"), "--table",
                 str(tmp_path / "table.json")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 3 |")]
    assert [row.split(" | ")[1] for row in rows] == ["novice", "expert", "hpo"]


def test_a_variant_is_hpo_with_overrides_scored_as_a_peer(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    output = tmp_path / "out.json"
    replay.main(["--budget", "6", "--repetitions", "2", "--table", str(table), "--output",
                 str(output), "--policies", "--variant",
                 "hb2=study.pruner.name=hyperband;study.pruner.reduction_factor=2"])
    result = json.loads(output.read_text())
    assert list(result["versus"]) == ["hb2"]
    study = replay.study_files.load(replay.study_files.study_path("demo"))
    facts = replay.Measured({}, {}, 0)
    (policy, searches), = replay.policies(["hb2"], study, replay.Curves(made_up_table()), 0,
                                          facts, {"hb2": ["study.pruner.name=hyperband"]})
    assert isinstance(policy.study.pruner, optuna.pruners.HyperbandPruner) and searches


def test_hpo_set_changes_hpos_defaults_alone_and_the_output_names_them(tmp_path):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    output = tmp_path / "out.json"
    replay.main(["--budget", "6", "--repetitions", "2", "--table", str(table), "--output",
                 str(output), "--policies", "tpe-hyperband",
                 "--hpo-set", "study.pruner.name=median", "--hpo-set",
                 "study.sampler.multivariate=false"])
    result = json.loads(output.read_text())
    assert result["hpo_sets"] == ["study.pruner.name=median", "study.sampler.multivariate=false"]
    assert list(result["versus"]) == ["tpe-hyperband"]
    study = replay.study_files.load(replay.study_files.study_path("demo"))
    chosen = replay.policies(["hpo", "tpe-hyperband"], study, replay.Curves(made_up_table()), 0,
                             replay.Measured({}, {}, 0), {"hpo": result["hpo_sets"]})
    (ours, _), (peer, _) = chosen
    assert isinstance(ours.study.pruner, optuna.pruners.MedianPruner)
    assert isinstance(peer.study.pruner, optuna.pruners.HyperbandPruner)


def test_every_optuna_study_is_named_by_its_seed_so_hyperbands_brackets_repeat(tmp_path):
    # Optuna's HyperbandPruner hashes the study's name into a trial's bracket: a nameless
    # study would draw it anew in every run of the replay.
    study = replay.study_files.load(replay.study_files.study_path("demo"))
    chosen = replay.policies([p for p in replay.PEERS if p != "ray"], study,
                             replay.Curves(made_up_table()), 7, replay.Measured({}, {}, 0))
    names = {policy.study.study_name for policy, _ in chosen}
    assert names == {"replay-7"}
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    runs = []
    for run in ("a", "b"):
        replay.main(["--budget", "12", "--repetitions", "1", "--table", str(table),
                     "--output", str(tmp_path / f"{run}.json"), "--policies", "tpe-hyperband"])
        runs.append(json.loads((tmp_path / f"{run}.json").read_text())["repetitions_data"])
    assert runs[0] == runs[1]
