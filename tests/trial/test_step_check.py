"""`hpo check`: one real training step per model x precision before the search, kept in the
study per kind of device; a combination found unusable is pruned without training, and a
study with nothing usable stops at once. Real tiny models; the non-finite loss is injected
(HPO_FAULT_NAN_LOSS)."""

import gc
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import optuna
import pytest
import torch
from conftest import A100, REPO, T4, freeze_counts
from optuna.trial import TrialState

from hpo.app.preflight import StudyRef, prepare
from hpo.cli import main
from hpo.hardware import detect
from hpo.space import PinnedSpace
from hpo.trial import step_check
from hpo.trial.resources import load_resources


def verdicts(storage: str) -> list[step_check.Verdict]:
    return step_check.stored(optuna.load_study(study_name="tiny", storage=storage), detect("cpu"))


def test_check_prints_a_table_and_keeps_the_verdicts_in_the_study(tiny_study, storage,
                                                                   capsys, monkeypatch):
    frozen_during = freeze_counts(monkeypatch, step_check, "check_one")
    assert main(["check", "--config", str(tiny_study), "--storage", storage]) == 0
    # As in a worker, what the process held was out of the collector's sight during the
    # check (its collections between combinations stay short), and is back once it is done.
    assert frozen_during and all(n > 0 for n in frozen_during)
    assert gc.get_freeze_count() == 0
    out = capsys.readouterr().out
    assert "model" in out and "s/step" in out and "attention" in out
    kept = verdicts(storage)
    assert {(v.model.rsplit("/", 1)[1], v.precision) for v in kept} == {
        ("tiny-bert", "none"), ("tiny-bert-b", "none")}
    for verdict in kept:
        assert verdict.usable and verdict.why is None and verdict.step_seconds > 0
        # Timed after the first step, at its batch of two sequences.
        assert verdict.step_batch == step_check.BATCH
        assert verdict.attention == "sdpa" and verdict.peak_mib is None  # a CPU reports none
        assert re.search(rf"{re.escape(verdict.model)}\s+fp32\s+[\d.]+\s+"
                         rf"{step_check.BATCH}\s+-\s+sdpa\s+ok", out)
    assert "2 of 2 model x precision combinations usable" in out


def test_a_non_finite_loss_is_unusable_and_its_trials_are_pruned_without_training(
        tiny_study, storage, monkeypatch, capsys):
    monkeypatch.setenv("HPO_FAULT_NAN_LOSS", "tiny-bert-b|none")
    assert main(["check", "--config", str(tiny_study), "--storage", storage]) == 0
    assert "unusable: loss nan after one step" in capsys.readouterr().out
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "6"]) == 0
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    pruned = [t for t in trials if t.params["model_name"].endswith("tiny-bert-b")]
    assert pruned, "no trial sampled the unusable model"
    for trial in pruned:
        assert trial.state == TrialState.PRUNED
        assert trial.user_attrs["prune_reason"] == "unusable"
        assert "loss nan after one step (hpo check)" in trial.user_attrs["error"]
        # Nothing was probed or trained for it.
        assert "batch_probes" not in trial.user_attrs and not trial.intermediate_values
    assert all(t.state == TrialState.COMPLETE for t in trials if t not in pruned)


def test_run_checks_once_per_device_kind_and_skip_check_skips(tiny_study, storage, capsys):
    assert main(["run", "--config", str(tiny_study), "--storage", storage, "--n-trials", "1",
                 "--skip-check"]) == 0
    assert verdicts(storage) is None
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "2"]) == 0
    assert "checking 2 model x precision combinations" in capsys.readouterr().out
    assert len(verdicts(storage)) == 2
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "3"]) == 0
    assert "checking" not in capsys.readouterr().out  # kept for this kind of device
    # A combination no worker has judged yet (an adapter method) is checked, and only it.
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "4", "--set", "training.peft=lora"]) == 0
    assert "checking 2 model x precision x peft method combinations" in (
        capsys.readouterr().out)
    assert sorted(v.peft for v in verdicts(storage)) == ["lora", "lora", "none", "none"]


def test_a_study_with_nothing_usable_stops_with_one_line(one_model_study, storage):
    result = subprocess.run(
        [sys.executable, "-m", "hpo.cli", "run", "--config", str(one_model_study),
         "--storage", storage, "--n-trials", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HPO_FAULT_NAN_LOSS": "tiny-bert|none"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("hpo: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "no model x precision of study 'tiny' is usable" in lines[0]
    assert "loss nan after one step" in lines[0]
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert trials == []


def test_verdicts_belong_to_a_kind_of_device():
    study = optuna.create_study()
    study.set_user_attr(step_check.key(A100), [
        {"model": "m", "precision": "fp16", "usable": False, "why": "loss inf after one step"}])
    assert step_check.unusable(study, A100, "m", "fp16") == "loss inf after one step"
    assert step_check.unusable(study, A100, "m", "bf16") is None
    assert step_check.stored(study, T4) is None
    assert step_check.unusable(study, T4, "m", "fp16") is None


def test_verdicts_with_keys_of_a_newer_release_are_read_and_timed_ones_give_step_seconds():
    study = optuna.create_study()
    study.set_user_attr(step_check.key(A100), [
        {"model": "m", "precision": "bf16", "usable": True, "step_seconds": 0.5,
         "step_batch": 8, "a_later_key": 1},
        {"model": "m", "precision": "none", "usable": True, "step_seconds": 0.8,
         "step_batch": 2},
        {"model": "m", "precision": "fp16", "usable": False, "why": "loss nan"},
        {"model": "m", "precision": "bf16", "usable": True, "step_seconds": 0.6,
         "step_batch": 4, "peft": "lora"},
        {"model": "old", "precision": "bf16", "usable": True, "step_seconds": 0.1}])
    stored = step_check.stored(study, A100)
    assert [v.precision for v in stored] == ["bf16", "none", "fp16", "bf16", "bf16"]
    # Per sequence; an older release's verdicts (no step_batch) and unusable ones not counted.
    assert step_check.step_seconds(stored) == {"m": {"bf16": 0.5 / 8, "none": 0.8 / 2},
                                          "m (lora)": {"bf16": 0.6 / 4}}
    assert step_check.step_seconds([]) is None
    assert step_check.step_seconds(stored[-1:]) is None


def test_check_on_the_demo_study(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hpo.cli", "check", "--study", "demo", "--storage",
         f"sqlite:///{tmp_path / 'demo.db'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "sentence-transformers/all-MiniLM-L6-v2" in result.stdout
    assert "unusable" not in result.stdout


def _resources(study_file, storage: str, precisions: tuple[str, ...],
               declared_precision: str | list[str] = "auto"):
    prepared = prepare(StudyRef(config=study_file, storage=storage), runs_trials=False)
    declared = {"model_name": [str(m) for m in prepared.config.search_space.model_name],
                "fp_precision": declared_precision}
    return load_resources(prepared.config, PinnedSpace(declared, precisions),
                          prepared.device, prepared.splits)


@pytest.mark.parametrize(("precisions", "declared"), [
    (("bf16", "none"), "auto"), (("none",), "auto"), (("bf16", "none"), ["bf16", "none"])])
def test_precisions_are_timed_at_a_trials_batch_in_rounds_and_a_burst_does_not_decide(
        tiny_study, storage, monkeypatch, precisions, declared):
    """A burst of load on a shared host during one combination's steps once made bf16 look
    slower than fp32 where it is 1.5x faster, and `auto` dropped it. A burst is faked here
    as a pause in one round of bf16's steps on the first model. A pinned list decides
    nothing by step times, so only the check's own steps time it."""
    resources = _resources(tiny_study, storage, precisions, declared)
    calls: list[tuple[str, str, int]] = []
    first_model = resources.pinned.declared["model_name"][0]
    real_step = step_check.probe_step
    per_round = 1 + step_check.TIMED_STEPS  # an untimed step on a fresh model, then the timed

    def step(model, plan, device, batch, *args):
        combination = (model.config.name_or_path, plan.precision)
        calls.append((*combination, batch))
        in_second_round = 2 * per_round < sum(c[:2] == combination for c in calls) <= (
            3 * per_round)
        if combination == (first_model, "bf16") and in_second_round:
            time.sleep(0.5)
        return real_step(model, plan, device, batch, *args)

    monkeypatch.setattr(step_check, "probe_step", step)
    # Every round runs: whether two already settle it depends on this host's real step times
    # (test_rounds_stop_at_two_where_they_settle_it times them by hand).
    monkeypatch.setattr(step_check, "settled", lambda *_: False)
    verdicts = {(v.model, v.precision): v for v in step_check.check_all(resources, precisions)}
    assert all(v.usable for v in verdicts.values())
    in_rounds = declared == "auto" and len(precisions) > 1
    # The check's own steps at two sequences, then, to compare, ROUNDS more at the space's
    # smallest effective batch (8: the memory these tiny models need is far below the
    # host's free memory).
    for combination, verdict in verdicts.items():
        batches = [b for *c, b in calls if tuple(c) == combination]
        assert batches[:per_round] == [step_check.BATCH] * per_round
        assert batches[per_round:] == ([8] * step_check.ROUNDS * per_round if in_rounds else [])
        assert verdict.step_batch == (8 if in_rounds else step_check.BATCH)
        assert (verdict.step_spread is not None) == in_rounds
    if in_rounds:
        assert verdicts[(first_model, "bf16")].step_seconds < 0.5  # the median round's
        # In turn: the second round runs the combinations in reverse order.
        second = calls[(1 + 1) * per_round * len(verdicts)]
        assert second[:2] == list(verdicts)[-1]


def test_a_trials_batch_is_timed_as_far_as_its_memory_is_sure():
    # Unknown memory: the check's own batch; a target below it: the target.
    assert step_check.timing_batch(16, 2, None, 1000.0) == 2
    assert step_check.timing_batch(16, 2, 100.0, None) == 2
    assert step_check.timing_batch(1, 2, 100.0, 1000.0) == 1
    # 50 MiB a sequence, 1000 MiB free: at most half of it, 10 sequences.
    assert step_check.timing_batch(16, 2, 100.0, 1000.0) == 10
    assert step_check.timing_batch(8, 2, 100.0, 1000.0) == 8
    # Never below the batch the check already ran.
    assert step_check.timing_batch(16, 2, 100.0, 10.0) == 2


def test_the_median_round_is_kept_with_the_rounds_spread_and_an_oom_keeps_the_checks(
        monkeypatch):

    resources = _namespace([32, 16])
    first = step_check.Verdict("a", "bf16", True, step_seconds=0.5, step_batch=2, step_mib=1.0)
    verdicts = {("a", "bf16", "none"): first,
                ("a", "none", "none"): replace(first, precision="none"),
                ("b", "none", "none"): replace(first, model="b", precision="none")}
    times = {("a", "bf16"): [0.3, 0.1, 0.2], ("a", "none"): [0.4, 0.4, 0.4],
             ("b", "none"): [1.0, torch.OutOfMemoryError("out of memory"), 1.0]}
    batches = []

    def time_steps(_resources, model, precision, _peft, batch):
        batches.append(batch)
        value = times[model, precision].pop(0)
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(step_check, "time_steps", time_steps)
    compared = step_check.compare(resources, verdicts, settle=False)
    assert set(batches) == {16}
    assert compared["a", "bf16", "none"] == replace(
        first, step_seconds=0.2, step_batch=16, step_spread=0.5)
    assert compared["a", "none", "none"].step_spread == 0.0
    assert compared["b", "none", "none"] == verdicts["b", "none", "none"]


def _namespace(targets: list[int], tolerance: float = 0.1):
    """What `compare` reads of a worker's resources."""
    from types import SimpleNamespace

    return SimpleNamespace(
        device=detect("cpu"),
        config=SimpleNamespace(
            search_space=SimpleNamespace(target_effective_batch_size=targets),
            training=SimpleNamespace(max_physical_batch_size=64),
            study=SimpleNamespace(precision_tolerance=tolerance)))


def _rounds(ends: dict[tuple[str, str], tuple[float, float]]):
    """`settled`'s arguments for combinations timed at a batch of 1 in two rounds."""
    verdicts = {(m, p, "none"): step_check.Verdict(m, p, True, step_seconds=1.0, step_batch=2)
                for m, p in ends}
    return verdicts, {(m, p, "none"): list(e) for (m, p), e in ends.items()}, {
        (m, "none"): 1 for m, _ in ends}


def test_two_rounds_settle_it_only_where_both_extremes_decide_alike():
    # fp32 far out, bf16 in: kept and dropped alike whatever a third round times.
    assert step_check.settled(*_rounds({("a", "bf16"): (0.10, 0.12),
                                        ("a", "none"): (0.20, 0.22)}), 0.1)
    # A burst in one of bf16's rounds: fp32 is kept against its slow round, not its fast one.
    assert not step_check.settled(*_rounds({("a", "bf16"): (0.10, 0.50),
                                            ("a", "none"): (0.20, 0.21)}), 0.1)
    # Near the tolerance's edge: fp16 at 1.12x bf16 at one extreme, 1.07x at the other.
    edge = {("a", "bf16"): (0.100, 0.101), ("a", "fp16"): (0.108, 0.112)}
    assert not step_check.settled(*_rounds(edge), 0.1)
    assert step_check.settled(*_rounds(edge), 0.15)
    # Summed over the models: a model whose rounds ran out of memory counts with the check's
    # own timing (1.0 / 2 a sequence for both), which drowns model a's spread.
    verdicts, rounds, batches = _rounds({**edge, ("b", "bf16"): (1.0, 1.0),
                                         ("b", "fp16"): (1.0, 1.0)})
    rounds["b", "fp16", "none"][1] = float("inf")
    assert step_check.settled(verdicts, rounds, batches, 0.1)


def test_rounds_stop_at_two_where_they_settle_it(monkeypatch):
    first = step_check.Verdict("a", "bf16", True, step_seconds=0.5, step_batch=2, step_mib=1.0)
    verdicts = {("a", "bf16", "none"): first,
                ("a", "none", "none"): replace(first, precision="none")}
    calls = []

    def timed(times):
        def time_steps(_resources, model, precision, _peft, _batch):
            calls.append((model, precision))
            return times[model, precision].pop(0)
        return time_steps

    for bf16, settle, rounds, median in (
            ([0.10, 0.11, 0.9], True, 2, 0.105),  # settled: the third is never timed
            ([0.10, 0.50, 0.11], True, 3, 0.11),  # a burst in the second: a third round
            ([0.10, 0.11, 0.12], False, 3, 0.11)):  # a partial check's rounds: all three
        calls.clear()
        times = {("a", "bf16"): list(bf16), ("a", "none"): [0.20, 0.21, 0.20]}
        monkeypatch.setattr(step_check, "time_steps", timed(times))
        compared = step_check.compare(_namespace([16]), verdicts, settle=settle)
        assert len(calls) == 2 * rounds
        assert compared["a", "bf16", "none"].step_seconds == pytest.approx(median)


def test_an_oom_beside_other_processes_is_judged_when_it_happens(monkeypatch):
    from types import SimpleNamespace

    from hpo.hardware import Device

    resources = SimpleNamespace(device=Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30))
    held = [41 * 2**30]
    monkeypatch.setattr(step_check.memory, "foreign_bytes", lambda _device: held[0])

    def stepper(*_args):
        raise raised[0]

    monkeypatch.setattr(step_check, "_stepper", stepper)
    raised = [torch.OutOfMemoryError("CUDA out of memory")]
    assert step_check.check_one(resources, "b", "bf16").shared_oom
    held[0] = 0  # the device to itself: an OOM is a verdict on the device
    verdict = step_check.check_one(resources, "b", "bf16")
    assert not verdict.usable and not verdict.shared_oom
    held[0], raised[0] = 41 * 2**30, RuntimeError("unsupported dtype")
    assert not step_check.check_one(resources, "b", "bf16").shared_oom


def test_an_oom_beside_other_processes_stays_out_of_the_studys_verdicts(monkeypatch):
    from types import SimpleNamespace

    from conftest import Quiet

    from hpo.hardware import Device

    device = Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30)
    resources = SimpleNamespace(
        device=device, pinned=SimpleNamespace(declared={"model_name": ["a", "b"]}),
        config=SimpleNamespace(training=SimpleNamespace(peft="none")))
    fine = step_check.Verdict("a", "bf16", True, step_seconds=0.5, step_batch=2)
    short = step_check.Verdict("b", "bf16", False, "CUDA out of memory", shared_oom=True)
    broken = step_check.Verdict("b", "fp16", False, "loss nan after one step")
    monkeypatch.setattr(step_check, "check_all", lambda *_args: iter([fine, short, broken]))
    study = optuna.create_study()
    report = Quiet()
    assert step_check.ensure(study, resources, ("bf16", "fp16"), report) == [fine, short, broken]
    assert step_check.stored(study, device) == [fine, broken]
    assert step_check.unusable(study, device, "b", "bf16") is None
    assert any("b bf16: out of memory in the check while other processes" in m
               for m in report.messages), report.messages

    # The next worker checks it again; with the device to itself, its OOM is a verdict.
    alone = replace(short, shared_oom=False)
    monkeypatch.setattr(step_check, "check_all", lambda *_args: iter([alone]))
    step_check.ensure(study, resources, ("bf16", "fp16"), Quiet())
    assert step_check.stored(study, device) == [fine, broken, alone]
    assert step_check.unusable(study, device, "b", "bf16") == "CUDA out of memory"


def test_a_precision_only_shared_memory_kept_from_stepping_is_crowded():
    def verdict(model, precision, usable, shared_oom=False):
        return step_check.Verdict(model, precision, usable, None if usable else "out of memory",
                             shared_oom=shared_oom)

    assert step_check.crowded([verdict("a", "bf16", True), verdict("a", "none", False, True),
                          verdict("b", "none", False, True)]) == {"none"}
    # Usable in one model: judged, and timed there.
    assert step_check.crowded([verdict("a", "none", True),
                               verdict("b", "none", False, True)]) == set()
    # Out of memory on the device alone, or not finite: judged unusable.
    assert step_check.crowded([verdict("a", "none", False), verdict("a", "fp16", False)]) == set()
    assert step_check.crowded(None) == set()


def test_nothing_usable_beside_other_processes_says_so(monkeypatch):
    from types import SimpleNamespace

    from conftest import Quiet

    from hpo.errors import CheckError
    from hpo.hardware import Device

    resources = SimpleNamespace(
        device=Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30),
        pinned=SimpleNamespace(declared={"model_name": ["b"]}),
        config=SimpleNamespace(training=SimpleNamespace(peft="none")))
    short = step_check.Verdict("b", "bf16", False, "CUDA out of memory", shared_oom=True)
    monkeypatch.setattr(step_check, "check_all", lambda *_args: iter([short]))
    with pytest.raises(CheckError, match="other processes held part of the device"):
        step_check.ensure(optuna.create_study(), resources, ("bf16",), Quiet())
