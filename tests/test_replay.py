"""benchmarks/replay.py: search policies replayed in simulated time on a table of learning
curves. Here on a made-up table whose curves and seconds are known, so every time and score
the simulation gives can be worked out by hand."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import optuna
import pytest
import replay
import stored
from conftest import REPO, require

from hpo.search.paused_view import PausedAsPruned
from hpo.search.study import PerTrialSeeded

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


def test_a_worlds_seed_is_drawn_per_model_batch_and_rate_the_same_at_every_decay(curves):
    """Weight decay moves the best score by less than the seeds' noise: drawn per grid
    point, it would turn the decay into a noise dimension."""
    for world in range(10):
        # Seed s adds 0.01 s and decay d takes 0.1 d: the seed is what is left.
        seeds = {round((curves.lookup(MINILM, "none", 16, 1e-4, wd, world).scores[2]
                        - curves.lookup(MINILM, "none", 16, 1e-4, 0.0, 0).scores[2]
                        + 0.1 * wd) / 0.01) for wd in (0.0, 0.05, 0.1)}
        assert len(seeds) == 1


def test_a_seed_recorded_at_only_some_points_is_not_drawn():
    made = made_up_table(seeds=3)
    made["rows"] = [r for r in made["rows"] if r[5] < 2 or r[3] == 1e-5]
    assert replay.Curves(made).seeds == [0, 1]


def test_a_random_configurations_median_is_the_grids_last_epoch_median(curves):
    import statistics

    assert curves.random_median(0) == statistics.median(
        curves._row(point, 0)["f1"][-1] for point in curves.by_point)


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
    training_steps: int | None = None  # as hpo's under study.budget: trainings

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
    trials = replay.simulate(policy, curves, 0, 1, budget=3, searches_batches=True)
    # start-up 1; set-up 2 + tokenization 5 + batch search 3; 4 epochs of 10 s
    assert [(t.start, t.end, t.state) for t in trials] == [
        (1.0, 51.0, "COMPLETE"),
        (51.0, 73.0, "PRUNED"),  # set-up 2, pruned after 2 epochs: the search is cached
        (73.0, 87.0, "COMPLETE")]  # tiny-bert: 2 + 5 + 3 + 4 x 1
    assert policy.told == [(0, False), (1, True), (2, False)]
    assert trials[0].value == max(trials[0].scores) and trials[1].value is None
    assert replay.wall(trials) == 87.0


def test_a_models_first_batch_search_covers_every_later_batch(curves):
    """As hpo does: the first search of a model and precision probes up to the physical
    limit, so a later trial at another effective batch pays no search."""
    policy = Scripted([config(TINY, batch=8), config(TINY, batch=32)])
    trials = replay.simulate(policy, curves, 0, 1, budget=2, searches_batches=True)
    # start-up 1; 2 + 5 + 3 + 4 x 1 = 14; then 2 + 4 x 1 = 6, no search
    assert [(t.start, t.end) for t in trials] == [(1.0, 15.0), (15.0, 21.0)]


def test_asks_see_exactly_the_reports_made_before_them(curves):
    policy = Scripted([config(TINY), config(MINILM), config(TINY), config(TINY)])
    trials = replay.simulate(policy, curves, 0, 2, budget=4)
    # Both workers ask at the start-up. The tiny-bert trial reports at 9, 10, 11 and 12,
    # and its worker asks at 12 having heard those 4. The next tiny-bert trial reports at
    # 15, 16, 17 and 18, where MiniLM's first epoch ends too, and came first: 9 heard.
    assert policy.heard == [0, 0, 4, 9]
    assert [t.end for t in trials] == [12.0, 18.0, 24.0, 48.0]


def test_compute_mode_starts_trials_until_the_horizon_and_counts_those_done_by_then(curves):
    policy = Scripted([config(TINY)] * 10)
    trials = replay.simulate(policy, curves, 0, 1, horizon=29.0)
    # 1 + 2 + 5 + 4 x 1, then 2 + 4 x 1 each: ends 12, 18 and 24; the fourth, started at
    # 24 before the horizon, would end at 30 after it: not counted.
    assert [t.end for t in trials] == [12.0, 18.0, 24.0] and len(policy.heard) == 4


@dataclass
class Promoting:
    """Pauses trial 0 after its first epoch and promotes it once trial 1 has finished."""
    configs: list[replay.Config]
    name: str = "promoting"
    startup: float = 1.0
    gap: float = 0.0
    runs: list[Promoting.Run] = field(default_factory=list)
    promoted: list[Promoting.Run] = field(default_factory=list)

    def ask(self) -> Promoting.Run:
        if self.promoted:
            return self.promoted.pop()
        self.runs.append(Promoting.Run(self, len(self.runs), self.configs[len(self.runs)]))
        return self.runs[-1]

    def slowdown(self, model: str) -> float:
        return 1.0

    training_steps: int | None = None

    def resumable(self, fits=lambda _: True) -> Promoting.Run | None:
        return self.promoted.pop() if self.promoted and fits(self.promoted[-1]) else None

    @dataclass(eq=False)
    class Run:
        policy: Promoting
        number: int
        config: replay.Config
        epochs: list[int] = field(default_factory=list)

        def report(self, epoch: int, score: float) -> bool | str:
            self.epochs.append(epoch)
            return replay.PAUSE if (self.number, epoch) == (0, 1) else False

        def finish(self, scores: list[float], stopped: bool) -> None:
            if self.number == 1:
                self.policy.promoted.append(self.policy.runs[0])


def test_a_paused_trial_frees_its_worker_and_resumes_at_its_next_epoch(curves):
    policy = Promoting([config(TINY)] * 5)
    trials = replay.simulate(policy, curves, 0, 1, horizon=21.0)
    # Trial 0: start-up 1, set-up 2 + tokenization 5 + 1 epoch: paused at 9. Trial 1 runs
    # 9 to 15 (2 + 4 x 1). Trial 0 resumes at 15: set-up 2 again, epochs 2-4 end at 18, 19,
    # 20. Trial 2, started at 20, would end after the horizon.
    assert [(t.start, t.end, t.state, len(t.scores)) for t in trials] == [
        (9.0, 15.0, "COMPLETE", 4), (1.0, 20.0, "COMPLETE", 4)]
    assert policy.runs[0].epochs == [1, 2, 3, 4]  # no epoch twice
    short = Promoting([config(TINY)] * 5)
    never = replay.simulate(short, curves, 0, 1, horizon=12.0)
    assert [(t.end, t.state, t.value) for t in never] == [(9.0, "PAUSED", None)]


def test_past_the_trial_budget_a_promoted_paused_trial_still_resumes(curves):
    # As `hpo run --n-trials 2` under study.pruner.pause: trial 0 pauses, trial 1 takes the
    # second slot and, finishing, promotes trial 0, which resumes though the budget is spent.
    policy = Promoting([config(TINY)] * 5)
    trials = replay.simulate(policy, curves, 0, 1, budget=2)
    assert [(t.state, len(t.scores)) for t in trials] == [("COMPLETE", 4), ("COMPLETE", 4)]
    assert len(policy.runs) == 2 and policy.runs[0].epochs == [1, 2, 3, 4]


def test_a_paused_trial_that_frees_its_slot_lets_a_new_trial_start_past_the_budget(curves):
    # --n-trials 1: a paused trial that holds its slot ends the search there; one that gives
    # it back (frees_slot) lets trial 1 run, whose end promotes trial 0, but no slot is left.
    holding = replay.simulate(Promoting([config(TINY)] * 5), curves, 0, 1, budget=1)
    assert [t.state for t in holding] == ["PAUSED"]
    freeing = Promoting([config(TINY)] * 5)
    freeing.frees_slot = True
    trials = replay.simulate(freeing, curves, 0, 1, budget=1)
    assert [t.state for t in trials] == ["PAUSED", "COMPLETE"]
    assert [len(r.epochs) for r in freeing.runs] == [1, 4]


def test_a_study_of_fewer_epochs_reads_its_curves_cut_to_them():
    made = made_up_table()
    cut = replay.Curves(replay.cut(made, 2))
    whole = replay.Curves(made)
    two = cut.lookup(MINILM, "none", 16, 2.15e-4, 0.0, world=0)
    four = whole.lookup(MINILM, "none", 16, 2.15e-4, 0.0, world=0)
    assert two.scores == four.scores[:2] and two.seconds == four.seconds[:2]
    assert replay.cut(made, None) is made and replay.cut(made, 4) is made
    with pytest.raises(SystemExit, match="--epochs 5: the table's curves have 4"):
        replay.cut(made, 5)


def test_a_budget_of_trainings_counts_epochs_and_gives_back_what_a_stop_did_not_train(curves):
    # --n-trials 2 under study.budget: trainings: 8 epochs. Trial 0 stops after 1, trial 1
    # after 2, so trial 2 fits (3 + 4 <= 8) and trains its 4; then 1 epoch is left, too few
    # for a whole training, and nothing starts. Counted in trials, 2 would have run.
    stops = {0: 1, 1: 2}
    counted = Scripted([config(TINY)] * 5, stop_at=stops, training_steps=4)
    trials = replay.simulate(counted, curves, 0, 1, budget=2)
    assert [(t.state, len(t.scores)) for t in trials] == [
        ("PRUNED", 1), ("PRUNED", 2), ("COMPLETE", 4)]
    assert len(replay.simulate(Scripted([config(TINY)] * 5, stop_at=stops), curves, 0, 1,
                               budget=2)) == 2
    # Unpruned, a budget of trainings is a budget of trials.
    whole = replay.simulate(Scripted([config(TINY)] * 5, training_steps=4), curves, 0, 1,
                            budget=3)
    assert [len(t.scores) for t in whole] == [4, 4, 4]


def test_under_a_budget_of_trainings_a_running_trial_holds_all_it_may_train(curves):
    # Two workers, 8 epochs. Both trials stop after 1 epoch at 9 s. When trial 0 stops,
    # trial 1 may still train 4: 1 + 4 leaves 3, so worker 0 waits. Trial 1's stop leaves 6:
    # trial 2 starts on worker 1 and trains 4, after which 2 are left, and both workers end.
    policy = Scripted([config(TINY)] * 5, stop_at={0: 1, 1: 1}, training_steps=4)
    trials = replay.simulate(policy, curves, 0, 2, budget=2)
    assert [(t.state, len(t.scores)) for t in trials] == [
        ("PRUNED", 1), ("PRUNED", 1), ("COMPLETE", 4)]
    assert sum(len(t.scores) for t in trials) <= 8


def test_under_a_budget_of_trainings_a_promoted_trial_resumes_if_what_it_has_left_fits(curves):
    # 8 epochs: trial 0 pauses after 1, trial 1 trains 4, leaving 3: too few for a new
    # trial, enough for the 3 trial 0 has left, which resumes once trial 1 promotes it.
    policy = Promoting([config(TINY)] * 5)
    policy.training_steps = 4
    trials = replay.simulate(policy, curves, 0, 1, budget=2)
    assert [(t.state, len(t.scores)) for t in trials] == [("COMPLETE", 4), ("COMPLETE", 4)]
    assert policy.runs[0].epochs == [1, 2, 3, 4]


def demo_study(*sets: str):
    from hpo import study_files

    return study_files.load(study_files.study_path("demo"), ["training.epochs=4", *sets])


def test_hpo_policy_is_built_by_hpos_own_functions_and_searches_its_precisions(curves):
    ground = replay.Ground(demo_study(), curves)
    policy = replay.hpo_policy(ground.study, ground, 3, "hpo")
    assert isinstance(policy.study.pruner, optuna.pruners.SuccessiveHalvingPruner)
    assert isinstance(policy.study.sampler, PerTrialSeeded)  # as `hpo run` seeds it
    assert isinstance(policy.study.sampler.sampler_for(0), PausedAsPruned)  # as hpo's
    trials = replay.simulate(policy, curves, 0, 2, budget=8, searches_batches=True)
    # A budget of 8 trainings (hpo's default): the pruned trials give back what they did
    # not train, so more start, and all of them train at most 8 trainings' epochs.
    assert len(trials) > 8 and sum(len(t.scores) for t in trials) <= 8 * ground.epochs
    assert {t.config.precision for t in trials} == {"none"}
    assert {t.config.model for t in trials} <= {MINILM, TINY}
    again = replay.simulate(replay.hpo_policy(ground.study, ground, 3, "hpo"), curves, 0, 2,
                            budget=8, searches_batches=True)
    assert [t.config for t in again] == [t.config for t in trials]  # seeded: it repeats


def test_the_peers_settings_are_stated_and_hpo_as_expert_is_set_as_the_expert(curves):
    ground = replay.Ground(demo_study(), curves)
    built = {p.name: p for p, _ in replay.policies(
        ["novice", "expert", "expert-copy", "hpo-as-expert"], ground, 5)}
    startup = ground.study.study.sampler.n_startup_trials
    for name in ("novice", "expert", "expert-copy", "hpo-as-expert"):
        sampler = built[name].study.sampler
        if isinstance(sampler, PerTrialSeeded):
            sampler = sampler.sampler_for(0)
        assert isinstance(sampler, optuna.samplers.TPESampler)
        assert sampler._n_startup_trials == startup, name  # Optuna's private name
    as_expert = replay.as_expert(ground.study)
    assert (as_expert.study.pruner.name, as_expert.study.pruner.n_startup_trials,
            as_expert.study.pruner.n_warmup_steps) == ("median", 4, 1)
    pruner = built["expert"].study.pruner
    assert isinstance(pruner, optuna.pruners.MedianPruner)
    # The expert reports its last epoch and tells its best (peer_trainer.py); the novice
    # tells its last.
    assert built["expert"].report_value([0.5, 0.4]) == 0.4
    assert built["expert"].tell_value([0.5, 0.4]) == 0.5
    assert built["hpo-as-expert"].tell_value([0.5, 0.4]) == 0.5
    assert built["hpo-as-expert"].report_value([0.5, 0.4]) == 0.4
    assert built["novice"].tell_value([0.5, 0.4]) == 0.4


def shipped() -> replay.Ground:
    table = replay.tables.read(REPO / "benchmarks" / "tables" / "demo.jsonl")
    return replay.Ground(replay.table_study(table), table)


def test_on_a_table_hpo_runs_its_schemas_defaults_and_every_policy_its_spaces_values():
    ground = shipped()
    assert ground.study.study.sampler == replay.config_module.SamplerConfig()
    assert ground.study.study.pruner == replay.config_module.PrunerConfig()
    assert ground.epochs == 4
    names = ["hpo", "novice", "expert", "expert-copy", "hpo-as-expert", "random",
             "tpe-hyperband"]
    for policy, searches in replay.policies(names, ground, 0):
        trials = replay.simulate(policy, ground.table, 0, 2, budget=6)
        assert not searches
        if policy.name == "hpo":  # 6 trainings: more trials, none training past the budget
            assert len(trials) > 6 and sum(len(t.scores) for t in trials) <= 6 * 4
        else:  # the peers count trials, as Optuna's `n_trials`
            assert len(trials) == 6
        assert all(set(t.config.as_dict()) == set(ground.table.space) for t in trials)


def first_draws(ground: replay.Ground, names: list[str], seed: int, own_draws: bool = False
                ) -> dict[str, list[dict]]:
    startup = ground.study.study.sampler.n_startup_trials
    drawn = {}
    for policy, _ in replay.policies(names, ground, seed, own_draws=own_draws):
        trials = replay.simulate(policy, ground.table, seed, 1, budget=startup + 2)
        started = [t.config for t in sorted(trials, key=lambda t: t.start)]
        # A paused trial's resumption reads the configuration it started with.
        drawn[policy.name] = [c.as_dict() for c in dict.fromkeys(started)][:startup]
    return drawn


def test_every_optuna_search_draws_hpos_start_up_in_a_world_and_other_worlds_differ():
    ground = shipped()
    names = ["hpo", "novice", "expert", "random", "tpe-hyperband", "hpo-as-expert"]
    drawn = first_draws(ground, names, 3)
    for name in names:
        assert drawn[name] == drawn["hpo"], name  # common random numbers
    assert first_draws(ground, ["hpo"], 4)["hpo"] != drawn["hpo"]
    # The null check's copy draws from other seeds; before 2026-12-06 every peer did.
    assert first_draws(ground, ["expert-copy"], 3)["expert-copy"] != drawn["hpo"]
    assert first_draws(ground, ["novice"], 3, own_draws=True)["novice"] != drawn["hpo"]


def test_a_policy_against_a_copy_of_itself_with_other_seeds_comes_out_level():
    ground = shipped()
    setting = replay.Setting("trials", 8, 2, ("expert", "expert-copy", "hpo-as-expert"))
    reps = [replay.race(replay.policies(list(setting.names), ground, w), ground.table, w,
                        setting, math.inf) for w in range(32)]
    for a, b in replay.NULLS:
        assert replay.yardstick.level(replay.yardstick.compare(reps, a, b)), (a, b)


def test_a_policy_better_by_construction_comes_out_ahead():
    """The same random search at a third of the seconds: at equal compute it finds at least
    as much, sooner."""
    ground = shipped()
    setting = replay.Setting("compute", 8, 1, ("fast", "slow"))
    reps = []
    for world in range(12):
        chosen = []
        for name, factor in (("fast", 1.0), ("slow", 3.0)):
            study = replay.new_study(world, optuna.samplers.RandomSampler(seed=world),
                                     optuna.pruners.NopPruner())
            chosen.append((replay.OptunaPolicy(
                name, study, replay.sampling(ground.table.space, replay.table_config),
                slowdowns={"table": factor}), False))
        reps.append(replay.race(chosen, ground.table, world, setting, 300.0))
    found = replay.yardstick.compare(reps, "fast", "slow")
    assert found["auc_ratio_interval"][1] < 1.0 and found["g1_strict"] > 0.5


def main_run(tmp_path, *args: str) -> dict:
    output = tmp_path / "out.json"
    replay.main(["--output", str(output), *args])
    return json.loads(output.read_text())


def test_chunks_of_worlds_at_the_whole_runs_horizons_merge_into_the_whole_run(tmp_path):
    table = str(REPO / "benchmarks" / "tables" / "demo.jsonl")
    common = ["--mode", "compute", "--budget", "4", "--table", table, "--policies", "novice",
              "random", "expert", "expert-copy"]
    whole = main_run(tmp_path, *common, "--repetitions", "4")
    (tmp_path / "whole.json").write_text(json.dumps(whole))
    chunks = []
    for first in ("2", "0"):
        chunk = main_run(tmp_path, *common, "--repetitions", "2", "--first-seed", first,
                         "--horizons-from", str(tmp_path / "whole.json"))
        chunks.append(tmp_path / f"chunk{first}.json")
        chunks[-1].write_text(json.dumps(chunk))
    replay.main(["--merge", *map(str, chunks), "--output", str(tmp_path / "merged.json")])
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["repetitions_data"] == whole["repetitions_data"]
    assert (merged["versus"], merged["nulls"]) == (whole["versus"], whole["nulls"])
    assert (merged["repetitions"], merged["first_seed"]) == (4, 0)
    with pytest.raises(SystemExit, match="a world is in two outputs"):
        replay.merge([whole, json.loads(chunks[0].read_text())])
    other = main_run(tmp_path, *common, "--repetitions", "1", "--first-seed", "9")
    with pytest.raises(SystemExit, match="differ in horizons"):
        replay.merge([whole, other])
    # Worlds 0-1 of the whole run and the chunk of worlds 2-3: the whole run again.
    replay.main(["--merge", str(tmp_path / "whole.json"), str(chunks[0]), "--worlds", "0-1",
                 "--worlds", "0,1", "--output", str(tmp_path / "kept.json")])
    kept = json.loads((tmp_path / "kept.json").read_text())
    assert kept["repetitions_data"] == whole["repetitions_data"][:2]
    elsewhere = {**json.loads(chunks[0].read_text()), "machine": "another CPU"}
    again = replay.merge([kept, elsewhere])
    assert again["repetitions_data"] == whole["repetitions_data"]
    assert again["machines"] == sorted([whole["machine"], "another CPU"])
    with pytest.raises(SystemExit, match="a world is in two outputs"):
        # worlds 2-3 in both: --worlds must leave each world to one output
        replay.merge([whole, json.loads(chunks[0].read_text())], frozenset({0, 1, 2, 3}))
    assert replay.merge([json.loads(chunks[1].read_text()), json.loads(chunks[0].read_text())],
                        frozenset({3, 0}))["repetitions_data"] == [
        whole["repetitions_data"][0], whole["repetitions_data"][3]]
    with pytest.raises(SystemExit, match="none of the worlds kept"):
        replay.merge([whole], frozenset({7}))
    assert replay.world_set("1-3, 7,9-9") == {1, 2, 3, 7, 9}
    for bad in ("3-1", "x", "-2", "1-"):
        with pytest.raises(argparse.ArgumentTypeError):
            replay.world_set(bad)


def test_runs_of_the_same_worlds_with_other_policies_join_into_the_whole_run(tmp_path):
    # Trials mode: each world's end is the last wall of all its policies, so the join must
    # take it (and the best found by then) over every output.
    table = str(REPO / "benchmarks" / "tables" / "demo.jsonl")
    common = ["--mode", "trials", "--budget", "4", "--table", table, "--repetitions", "3"]
    whole = main_run(tmp_path, *common, "--policies", "novice", "random", "expert",
                     "expert-copy")
    part = main_run(tmp_path, *common, "--policies", "random", "expert", "expert-copy")
    other = main_run(tmp_path, *common, "--policies", "novice", "random")
    parts = [tmp_path / "part.json", tmp_path / "other.json"]
    for path, found in zip(parts, (part, other), strict=True):
        path.write_text(json.dumps(found))
    replay.main(["--join", *map(str, parts), "--output", str(tmp_path / "joined.json")])
    joined = json.loads((tmp_path / "joined.json").read_text())
    assert joined["repetitions_data"] == whole["repetitions_data"]
    assert (joined["versus"], joined["nulls"]) == (whole["versus"], whole["nulls"])
    assert set(joined["policies"]) == set(whole["policies"])
    # Renamed, a candidate becomes the subject: here the novice takes hpo's place.
    renamed = replay.join([part, other], {"novice": "hpo", "hpo": "hpo-before"})
    assert renamed["versus"]["hpo-before"] == replay.yardstick.compare(
        whole["repetitions_data"], "novice", "hpo")
    with pytest.raises(SystemExit, match="two policies would share a name"):
        replay.join([part, other], {"novice": "random"})
    # An output made before a figure or a setting was recorded joins on what both hold.
    older = json.loads(json.dumps(other))
    del older["answers"]
    for rep in older["repetitions_data"]:
        del rep["random"]["distinct"]
    assert replay.join([part, older], {})["repetitions_data"] == whole["repetitions_data"]
    other["repetitions_data"][1]["random"]["steps"][0][1] += 0.01
    with pytest.raises(SystemExit, match="random searched otherwise in world 1"):
        replay.join([part, other], {})
    older["answers"] = "the surrogate at the point"
    with pytest.raises(SystemExit, match="differ in answers"):
        replay.join([part, older], {})
    # Before 2026-12-06 each peer's TPE drew its own start-up: not joined with shared draws.
    assert part["draws"] == replay.SHARED
    own = json.loads(json.dumps(other))
    del own["draws"]
    with pytest.raises(SystemExit, match="differ in draws"):
        replay.join([part, own], {})
    fewer = main_run(tmp_path, *common[:-1], "2", "--policies", "novice")
    with pytest.raises(SystemExit, match="the outputs hold different worlds"):
        replay.join([part, fewer], {})


def test_every_policy_runs_and_the_output_holds_the_yardsticks_figures(tmp_path):
    table = tmp_path / "table.json"
    made = made_up_table()
    real = REPO / "benchmarks" / "results" / "search_quality.json"
    made["machine"] = stored.read(real)["runs"][0]["machine"]
    made["parts"] = [{"seed": 1, "machine": "another CPU", "as": "a tagged noise draw"}]
    table.write_text(json.dumps(made))
    names = [p for p in replay.PEERS if p not in ("ray", "ray-rf2", "bohb")]
    result = main_run(tmp_path, "--budget", "6", "--workers", "2", "--repetitions", "2",
                      "--table", str(table), "--policies", *names, "expert-copy",
                      "hpo-as-expert")
    assert set(result["versus"]) == set(names)
    for figures in result["versus"].values():
        for key in ("auc_ratio", "auc_ratio_interval", "final_regret_diff",
                    "final_regret_diff_interval", "g1_strict", "g1_interval", "g2_median"):
            assert key in figures
    assert set(result["nulls"]) == {"expert-copy vs expert", "hpo-as-expert vs expert"}
    assert all("level" in f for f in result["nulls"].values())
    assert result["mode"] == "compute" and len(result["horizons"]) == 1
    assert result["machine"] and result["versions"]["optuna"] == optuna.__version__
    assert result["measured"]["slowdowns"]["novice"]  # measured on that machine's runs
    assert len(result["repetitions_data"]) == 2
    assert result["tables"][0]["parts"] == made["parts"]  # a seed's provenance travels


def test_compute_modes_horizon_is_the_median_wall_of_the_novices_trials(tmp_path):
    table = str(REPO / "benchmarks" / "tables" / "demo.jsonl")
    trials = main_run(tmp_path, "--mode", "trials", "--budget", "5", "--repetitions", "3",
                      "--table", table, "--policies", "novice")
    walls = [rep["novice"]["wall"] for rep in trials["repetitions_data"]]
    computed = main_run(tmp_path, "--mode", "compute", "--budget", "5", "--repetitions", "3",
                        "--table", table, "--policies", "novice", "random")
    assert computed["horizons"] == [sorted(walls)[1]]
    for rep in computed["repetitions_data"]:
        assert rep["world"]["horizon"] == sorted(walls)[1]
        assert all(step[0] <= sorted(walls)[1] for step in rep["random"]["steps"])
    given = main_run(tmp_path, "--mode", "compute", "--horizon", "50", "--repetitions", "1",
                     "--table", table, "--policies", "random")
    assert given["horizons"] == [50.0]
    fewer = main_run(tmp_path, "--mode", "compute", "--budget", "5", "--repetitions", "1",
                     "--table", table, table, "--policies", "novice")
    assert fewer["horizons"] == [walls[0], None]  # a table no world searched


def test_even_costs_price_every_tool_as_hpo_and_its_batch_searches_as_free(tmp_path):
    real = stored.read(REPO / "benchmarks" / "results" / "search_quality.json")
    made = made_up_table()
    made["machine"] = real["runs"][0]["machine"]
    facts = replay.measured(real, made["machine"])
    assert facts.startup["expert"] != facts.startup["hpo"] and facts.slowdowns["expert"]
    curves = replay.Curves(made)
    assert curves.costs.batch_search
    ground = replay.Ground(demo_study(), curves, replay.even(facts, curves))
    assert curves.costs.batch_search == {}
    for policy, _ in replay.policies(["hpo", "expert", "novice"], ground, 0):
        assert (policy.startup, policy.gap, policy.slowdown(MINILM)) == (
            facts.startup["hpo"], facts.gaps["hpo"], 1.0), policy.name
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made))
    result = main_run(tmp_path, "--budget", "4", "--repetitions", "1", "--table", str(table),
                      "--policies", "expert", "--even-costs")
    assert result["even_costs"] == list(replay.EVEN_PARTS)
    assert result["measured"]["slowdowns"] == {}
    assert set(result["measured"]["startup"].values()) == {facts.startup["hpo"]}


def test_even_costs_parts_even_only_what_they_name():
    real = stored.read(REPO / "benchmarks" / "results" / "search_quality.json")
    made = made_up_table()
    made["machine"] = real["runs"][0]["machine"]
    facts = replay.measured(real, made["machine"])
    curves = replay.Curves(made)
    searches = curves.costs.batch_search
    started = replay.even(facts, curves, ("startup",))
    assert set(started.startup.values()) == {facts.startup["hpo"]}
    assert (started.slowdowns, started.gaps, curves.costs.batch_search) == (
        facts.slowdowns, facts.gaps, searches)
    slowed = replay.even(facts, curves, ("slowdowns",))
    assert (slowed.slowdowns, slowed.startup) == ({}, facts.startup)
    replay.even(facts, curves, ("searches",))
    assert curves.costs.batch_search == {}
    assert replay.even_parts(None) == () and replay.even_parts([]) == replay.EVEN_PARTS
    assert replay.even_parts(["searches", "startup"]) == ("startup", "searches")
    # An output written when --even-costs was a switch merges with one that names its parts.
    assert replay.recorded({"even_costs": True}, "even_costs") == list(replay.EVEN_PARTS)
    assert replay.recorded({"even_costs": False}, "even_costs") == []


def test_ray_policy_drives_rays_own_asha_and_optuna_search(curves):
    pytest.importorskip("ray.tune", reason="Ray Tune comes with '.[bench]'")
    ground = shipped()
    drawn = first_draws(ground, ["hpo", "ray"], 3)
    assert drawn["ray"] == drawn["hpo"]  # Ray's OptunaSearch draws hpo's start-up too
    space = replay.plain_space(demo_study().search_space)
    for factor in (4, 2):
        policy = replay.RayPolicy("ray", space, replay.demo_config("none"), 0, 4, 6, factor)
        assert policy.scheduler._reduction_factor == factor  # Ray's private name
        trials = replay.simulate(policy, curves, 0, 2, budget=12)
        assert len(trials) == 12
        assert any(t.state == "PRUNED" for t in trials)  # stopped at a rung


def test_bohb_is_syne_tunes_own_scheduler_in_its_environment():
    require(replay.peer_syne.available(), "Syne Tune's environment: python3 -m venv "
            ".venv-syne && .venv-syne/bin/pip install -r benchmarks/peers/syne.txt")
    ground = shipped()
    (policy, _), = replay.policies(["bohb"], ground, 0)
    trials = replay.simulate(policy, ground.table, 0, 2, budget=20)
    policy.close()
    replay.peer_syne.shutdown()
    assert len(trials) == 20 and any(t.state == "PRUNED" for t in trials)
    assert all(set(t.config.as_dict()) == set(ground.table.space) for t in trials)


def test_syne_tunes_promotion_asha_pauses_trials_and_resumes_those_it_promotes():
    require(replay.peer_syne.available(), "Syne Tune's environment: python3 -m venv "
            ".venv-syne && .venv-syne/bin/pip install -r benchmarks/peers/syne.txt")
    ground = shipped()
    (policy, _), = replay.policies(["asha-promotion"], ground, 0)
    suggest, resumed = policy.scheduler.suggest, []

    def counting(trial: int):
        config, number = suggest(trial)
        if number is not None:
            resumed.append(number)
        return config, number

    policy.scheduler.suggest = counting
    trials = replay.simulate(policy, ground.table, 0, 2, horizon=3000.0)
    policy.close()
    replay.peer_syne.shutdown()
    states = {t.state for t in trials}
    assert resumed and {"PAUSED", "COMPLETE"} <= states and "PRUNED" not in states
    # A trial resumed runs on from its pause: each record holds each epoch once.
    assert all(len(t.scores) <= ground.table.epochs for t in trials)
    # One record per trial, however often it paused; the two running at the horizon, none.
    assert policy.asked - len(trials) in (0, 1, 2)


def test_hpos_promotion_form_pauses_at_its_rungs_and_promotes_a_rungs_top_third():
    ground = shipped()  # hpo's schema defaults on 4 epochs: rungs at 1 and 3
    (policy, _), = replay.policies(["hpo-promotion"], ground, 0)
    assert (policy.steps, policy.reduction_factor) == ((1, 3), 3)
    first, second, third = (policy.ask() for _ in range(3))
    assert [r.trial.number for r in (first, second, third)] == [0, 1, 2]
    for run, score in ((first, 0.5), (second, 0.9)):
        assert run.report(1, score) == replay.PAUSE
    # Two trials at rung 0: none is in a top third yet, so a new trial starts.
    assert policy.ask() is not first and policy.waiting[0] == [first, second]
    assert third.report(1, 0.1) == replay.PAUSE
    # Three: the best (second) is promoted, and runs on to its next rung.
    assert policy.ask() is second and policy.waiting[0] == [first, third]
    assert [second.report(e, 0.9) for e in (2, 3)] == [False, replay.PAUSE]
    assert second.rung == 2 and policy.ask().trial.number == 4
    # Paused trials stay RUNNING to the sampler; a finished one is told its best epoch.
    second.finish([0.9] * 4, False)
    states = {t.number: t.state for t in policy.base.study.trials}
    assert states[1] == optuna.trial.TrialState.COMPLETE
    assert states[0] == optuna.trial.TrialState.RUNNING
    trials = replay.simulate(replay.policies(["hpo-promotion"], ground, 1)[0][0],
                             ground.table, 1, 2, horizon=20000.0)
    assert {"PAUSED", "COMPLETE"} <= {t.state for t in trials}
    assert all(len(t.scores) <= ground.table.epochs for t in trials)


def test_hpos_pause_form_pauses_only_what_stopping_would_stop_and_resumes_it_later():
    ground = shipped()
    (policy, _), = replay.policies(["hpo-pause"], ground, 0)
    assert policy.eager and policy.steps == (1, 3)
    runs = [policy.ask() for _ in range(6)]
    # The first goes on (the best of one); the next, each worse, would be stopped: paused.
    verdicts = [run.report(1, score) for run, score in
                zip(runs, (0.5, 0.3, 0.2, 0.1, 0.05, 0.04), strict=True)]
    assert verdicts == [False] + [replay.PAUSE] * 5
    # Paused as hpo's workers mark a paused trial, which its sampler may read.
    marks = {t.number: t.user_attrs.get("paused_at") for t in policy.base.study.trials}
    assert marks == {0: None, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    # Each rung recorded on its trial as hpo's pruner records it, the one gone on included.
    rungs = [t.system_attrs.get("completed_rung_0") for t in policy.base.study.trials]
    assert rungs == [0.5, 0.3, 0.2, 0.1, 0.05, 0.04]
    # Six at the rung: its top third is two, so the second is resumed before anything new.
    assert policy.ask() is runs[1]
    assert policy.base.study.trials[1].user_attrs["paused_at"] is None
    assert policy.ask().trial.number == 6


def test_past_max_checkpoints_the_paused_trial_ranked_lowest_gives_its_checkpoint_up():
    ground = shipped()
    sets = ["study.pruner.pause=true", "study.pruner.max_checkpoints=2"]
    (policy, _), = replay.policies(["bounded"], ground, 0, {"bounded": sets})
    assert policy.max_checkpoints == 2
    runs = [policy.ask() for _ in range(5)]
    verdicts = [run.report(1, score) for run, score in
                zip(runs, (0.5, 0.3, 0.2, 0.1, 0.25), strict=True)]
    # Every trial its rung would stop pauses. The third to pause (0.1) ranks lowest of the
    # three with checkpoints and gives its own up; then 0.25 pauses, and 0.2 gives its up.
    assert verdicts == [False] + [replay.PAUSE] * 4
    assert [r.lost for r in runs] == [False, False, True, True, False]
    assert policy.waiting[0] == runs[1:]  # all still paused, ranked by what they reported


def test_a_promoted_trial_without_its_checkpoint_trains_again_and_pays_for_it():
    ground = shipped()
    sets = ["study.pruner.pause=true", "study.budget=trainings",
            "study.pruner.max_checkpoints=0"]
    (policy, _), = replay.policies(["none-kept"], ground, 0, {"none-kept": sets})
    trials = replay.simulate(policy, ground.table, 0, 2, budget=10)
    epochs = ground.table.epochs
    again = list({id(r): r for rung in policy.values.values() for _, r in rung
                  if r.again}.values())
    assert again, "no trial was promoted: the test tests nothing"
    for run in again:  # each epoch reported once, the first time
        assert len(run.scores) <= epochs
    # What they trained twice is counted: all trained stays within 10 trainings.
    trained = sum(len(t.scores) for t in trials) + sum(r.again for r in again)
    assert trained <= 10 * epochs


def test_a_pause_told_as_pruned_resumes_as_a_new_trial_of_the_same_parameters():
    ground = shipped()
    (policy, _), = replay.policies(["hpo-pause-pruned"], ground, 0)
    runs = [policy.ask() for _ in range(6)]
    for run, score in zip(runs, (0.5, 0.3, 0.2, 0.1, 0.05, 0.04), strict=True):
        run.report(1, score)
    study = policy.base.study
    assert [t.state.name for t in study.trials] == ["RUNNING"] + ["PRUNED"] * 5
    paused = runs[1].trial
    assert policy.ask() is runs[1] and runs[1].trial.number == 6
    assert runs[1].trial.params == paused.params
    runs[1].report(2, 0.3)
    runs[1].finish([0.3, 0.3, 0.3, 0.3], False)
    assert study.trials[6].state.name == "COMPLETE" and study.trials[1].state.name == "PRUNED"


def test_without_syne_tunes_environment_bohb_is_refused_in_one_line(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(replay.peer_syne, "PYTHON", tmp_path / "none")
    with pytest.raises(SystemExit) as ended:
        replay.main(["--policies", "bohb"])
    assert ended.value.code == 2 and "benchmarks/peers/syne.txt" in capsys.readouterr().err


def test_a_malformed_table_is_refused_in_one_line_naming_it(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"table": "t", "space": {}}\n')
    with pytest.raises(SystemExit) as ended:
        replay.main(["--table", str(bad), "--policies", "random"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and str(bad) in err and "direction" in err


def test_a_surrogate_folder_without_lcbenchs_model_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        replay.main(["--surrogate", str(tmp_path), "--policies", "random"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert ended.value.code == 2 and "lcbench/model.onnx" in err and str(tmp_path) in err


def test_with_a_surrogate_lcbenchs_tables_answer_at_each_point_and_others_stay(tmp_path,
                                                                                 monkeypatch):
    """`--surrogate`: a table replay_lcbench.py wrote is answered by the surrogate at each
    suggested point; another table (the demo's) by its nearest recorded run, as before; the
    output says which."""
    import replay_lcbench
    from test_replay_lcbench import made_up

    replay_lcbench.main(["--output", str(tmp_path), "--configurations", "20"], made_up,
                        ["3945"])
    monkeypatch.setattr(replay_lcbench, "onnx_surrogate", lambda data: made_up)
    (tmp_path / "lcbench").mkdir()
    (tmp_path / "lcbench" / "model.onnx").write_text("a stand-in")
    paths = (str(tmp_path / "lcbench-3945.jsonl"),
             str(REPO / "benchmarks" / "tables" / "demo.jsonl"))
    lcbench, demo = replay.grounds(paths, str(replay.REAL), False, None, str(tmp_path))
    assert lcbench.table.answer is not None and demo.table.answer is None
    assert replay.grounds(paths, str(replay.REAL), False, None)[0].table.answer is None
    out = tmp_path / "out.json"
    replay.main(["--table", paths[0], "--surrogate", str(tmp_path), "--mode", "trials",
                 "--budget", "6", "--repetitions", "2", "--policies", "random", "novice",
                 "--output", str(out)])
    result = json.loads(out.read_text())
    assert result["answers"] == "the surrogate at the point"
    assert replay.where(result) == "lcbench-3945 (surrogate)"
    finals = [max(v for _, v in result["repetitions_data"][0]["random"]["steps"])]
    recorded = {r.values[-1] for r in lcbench.table.runs}
    assert not set(finals) & recorded  # random points between the 20 recorded ones
    for world in result["repetitions_data"]:  # every trial met a curve of its own
        assert world["random"]["distinct"] == world["random"]["trials"] == 6
    nearest = tmp_path / "nearest.json"
    replay.main(["--table", paths[0], "--mode", "trials", "--budget", "40", "--repetitions",
                 "1", "--policies", "random", "--output", str(nearest)])
    met = json.loads(nearest.read_text())["repetitions_data"][0]["random"]
    assert met["distinct"] <= 20 < met["trials"]  # 40 trials, 20 recorded runs


def rendered_run(tmp_path) -> Path:
    out = tmp_path / "out.json"
    replay.main(["--budget", "4", "--workers", "1", "--repetitions", "3", "--table",
                 str(REPO / "benchmarks" / "tables" / "demo.jsonl"), "--output", str(out),
                 "--policies", "random", "expert", "expert-copy"])
    return out


def test_render_writes_a_row_per_peer_and_null_check(tmp_path):
    text = replay.render([rendered_run(tmp_path)], None)
    assert "| demo | compute | 4 x 1 | random |" in text
    assert "| null: expert-copy vs expert (level) |" in text or "(NOT level)" in text


def test_render_blocks_gives_each_null_check_per_run_of_worlds_and_over_all(tmp_path, capsys):
    out = rendered_run(tmp_path)
    capsys.readouterr()
    replay.main(["--render", str(out), "--blocks", "2"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split(" | ")[4] for line in lines[2:]]
    assert rows == ["0-1", "2-2", "all 3"]  # hpo-as-expert was not run: no rows of it
    assert all(line.startswith("| demo | compute | 4 x 1 | expert-copy vs expert |")
               and line.endswith((" yes |", " NO |")) for line in lines[2:])
    with pytest.raises(SystemExit):
        replay.main(["--render", str(out), "--blocks", "0"])


def test_render_plots_regret_and_rank_over_time(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot's matplotlib comes with '.[bench]'")
    replay.render([rendered_run(tmp_path)], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_reality_replays_the_real_runs_of_the_tables_cpu_kind(tmp_path, capsys):
    real = stored.read(REPO / "benchmarks" / "results" / "search_quality.json")
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


def test_a_variant_is_hpo_with_overrides_scored_as_a_peer(tmp_path, curves):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    result = main_run(tmp_path, "--budget", "6", "--repetitions", "2", "--table", str(table),
                      "--policies", "--variant",
                      "hb2=study.pruner.name=hyperband;study.pruner.reduction_factor=2")
    assert list(result["versus"]) == ["hb2"]
    # Named in --policies as well, it runs once.
    again = main_run(tmp_path, "--budget", "6", "--repetitions", "2", "--table", str(table),
                     "--policies", "hb2", "--variant", "hb2=study.pruner.name=hyperband")
    assert again["policies"] == ["hpo", "hb2"]
    (policy, searches), = replay.policies(["hb2"], replay.Ground(demo_study(), curves), 0,
                                          {"hb2": ["study.pruner.name=hyperband"]})
    assert isinstance(policy.study.pruner, optuna.pruners.HyperbandPruner) and searches


def test_hpo_set_changes_hpos_defaults_alone_and_the_output_names_them(tmp_path, curves):
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    result = main_run(tmp_path, "--budget", "6", "--repetitions", "2", "--table", str(table),
                      "--policies", "tpe-hyperband", "--hpo-set", "study.pruner.name=median",
                      "--hpo-set", "study.sampler.multivariate=false")
    assert result["hpo_sets"] == ["study.pruner.name=median", "study.sampler.multivariate=false"]
    assert list(result["versus"]) == ["tpe-hyperband"]
    chosen = replay.policies(["hpo", "tpe-hyperband"], replay.Ground(demo_study(), curves), 0,
                             {"hpo": result["hpo_sets"]})
    (ours, _), (peer, _) = chosen
    assert isinstance(ours.study.pruner, optuna.pruners.MedianPruner)
    assert isinstance(peer.study.pruner, optuna.pruners.HyperbandPruner)


def test_every_optuna_study_is_named_by_its_seed_so_hyperbands_brackets_repeat(tmp_path,
                                                                            curves):
    # Optuna's HyperbandPruner hashes the study's name into a trial's bracket: a nameless
    # study would draw it anew in every run of the replay.
    names = [p for p in replay.PEERS if p not in ("ray", "ray-rf2", "bohb")]
    chosen = replay.policies(names, replay.Ground(demo_study(), curves), 7)
    assert {policy.study.study_name for policy, _ in chosen} == {"replay-7"}
    table = tmp_path / "table.json"
    table.write_text(json.dumps(made_up_table()))
    runs = [main_run(tmp_path, "--budget", "12", "--repetitions", "1", "--table", str(table),
                     "--policies", "tpe-hyperband")["repetitions_data"] for _ in range(2)]
    assert runs[0] == runs[1]
