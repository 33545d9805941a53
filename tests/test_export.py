"""Writing the exported model: nothing that looks like a model is left by a run that did not
finish (the end-to-end exports are in test_final.py)."""

import json

import pytest

from hpo import export
from hpo.errors import ConfigError
from hpo.final_report import (
    F1,
    BatchPlan,
    DataUsed,
    Exported,
    FinalReport,
    SeedRun,
    Spread,
    SymptomScore,
)

REPORT = FinalReport(
    study="demo", trial=3, objective="macro_f1", search_validation=0.61,
    params={"model_name": "m", "fp_precision": "bf16"}, training={"epochs": 2},
    plan=BatchPlan(8, 2, 16, 2, 0), device="cpu", refit=False, thresholds="0.5",
    data=DataUsed("data", "multilabel", 0, 64, {"train": 8, "validation": 2, "test": 2},
                  ["p1", "p2"]),
    runs=(SeedRun(42, 2, 2, 0.6, F1(0.5, 0.55), F1(0.45, 0.5)),),
    test_spread=Spread(0.5, 0.0, 0.5, 0.5), test_spread_at_half=Spread(0.45, 0.0, 0.45, 0.45),
    exported=Exported(42, "validation score", F1(0.5, 0.55), {"macro_f1": (0.4, 0.6)},
                      F1(0.45, 0.5), {"a": SymptomScore(0.5, 0.5, 0.5, 1, 0.5)}, {"a": 0.5}),
    baseline=F1(0.2, 0.25), optimism=0.16)


def test_the_report_json_layout():
    written = json.loads(json.dumps(REPORT.to_json()))
    assert list(written) == [
        "study", "trial", "objective", "search_validation", "params", "training", "plan",
        "device", "refit", "thresholds", "data", "runs", "seed_spread", "exported",
        "baseline", "optimism"]
    assert written["runs"] == [{"seed": 42, "epoch": 2, "epochs": 2, "validation": 0.6,
                                "test": {"macro_f1": 0.5, "micro_f1": 0.55},
                                "test_at_0.5": {"macro_f1": 0.45, "micro_f1": 0.5}}]
    assert written["seed_spread"] == {
        "test_macro_f1": {"mean": 0.5, "std": 0.0, "min": 0.5, "max": 0.5},
        "test_at_0.5_macro_f1": {"mean": 0.45, "std": 0.0, "min": 0.45, "max": 0.45}}
    assert written["exported"]["test_interval_95"] == {"macro_f1": [0.4, 0.6]}
    assert written["exported"]["per_symptom"]["a"]["threshold"] == 0.5
    assert written["baseline"] == {"name": "all_positive", "macro_f1": 0.2, "micro_f1": 0.25}
    assert written["plan"]["batch_probes"] == 0 and written["data"]["test_post_ids"] == ["p1",
                                                                                        "p2"]


def test_checking_the_output_creates_nothing(tmp_path):
    output = tmp_path / "final" / "demo"
    export.validate_output(output)
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--output .*file/demo: cannot write there"):
        export.validate_output(tmp_path / "file" / "demo")


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
def test_an_interrupted_export_leaves_no_partial_model_nor_directory(tmp_path, monkeypatch,
                                                                    interrupt):
    def save_then_stop(directory, *args, **kwargs):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"half")
        raise interrupt()

    monkeypatch.setattr(export, "save_model", save_then_stop)
    with pytest.raises(interrupt):
        export.write(tmp_path / "final" / "demo", None, REPORT, ("a",))
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_export_keeps_the_earlier_one(tmp_path, monkeypatch):
    earlier = tmp_path / "demo"
    earlier.mkdir()
    (earlier / export.REPORT).write_text("{}")

    def stop(directory, *args, **kwargs):
        directory.mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "save_model", stop)
    with pytest.raises(KeyboardInterrupt):
        export.write(earlier, None, REPORT, ("a",))
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]
    assert (earlier / export.REPORT).read_text() == "{}"
