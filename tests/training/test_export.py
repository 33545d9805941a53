"""Writing the exported model: nothing that looks like a model is left by a run that did not
finish (the end-to-end exports are in test_final.py)."""

import json
from dataclasses import replace

import pytest
import yaml
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results

from hpo.errors import ConfigError
from hpo.training import export
from hpo.training.final_results import (
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
        export.write(tmp_path / "final" / "demo", None, REPORT)
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
        export.write(earlier, None, REPORT)
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]
    assert (earlier / export.REPORT).read_text() == "{}"


# As `hpo final` reports: an interval for both F1s.
SCORED = replace(REPORT, exported=replace(REPORT.exported, test_interval_95={
    "macro_f1": (0.4, 0.6), "micro_f1": (0.45, 0.65)}))


def card_written(tmp_path, monkeypatch, report):
    """The README.md `export.write` leaves, read back by huggingface_hub's own parser."""
    monkeypatch.setattr(export, "save_model", lambda directory, *args, **kwargs:
                        directory.mkdir())
    export.write(tmp_path / "model", None, report)
    return ModelCard.load(tmp_path / "model" / export.CARD)


def test_the_model_card_carries_the_hubs_model_index(tmp_path, monkeypatch):
    card = card_written(tmp_path, monkeypatch, SCORED)

    data = card.data
    assert (data.library_name, data.pipeline_tag, data.base_model) == (
        "transformers", "text-classification", "m")  # "m" is no local directory: a hub id
    assert data.tags == ["hpo", "multi-label-classification", "redsm5"]
    assert data.model_name == "demo trial 3 seed 42"
    results = data.eval_results
    # One task and one dataset: the local data directory's test split, no Hub dataset claimed.
    assert {(r.task_type, r.task_name, r.dataset_type, r.dataset_name, r.dataset_split)
            for r in results} == {("text-classification", "Multi-label text classification",
                                   "data", "ReDSM5-format posts in data", "test")}
    assert "datasets" not in data.to_dict()
    # The objective, then its interval's bounds; then the micro-F1 and its bounds.
    assert [(r.metric_type, r.metric_args["average"], r.metric_value) for r in results] == [
        ("f1", "macro", 0.5), ("f1", "macro", 0.4), ("f1", "macro", 0.6),
        ("f1", "micro", 0.55), ("f1", "micro", 0.45), ("f1", "micro", 0.65)]
    assert [r.metric_name for r in results[:3]] == [
        "Test macro-F1 (at config.decision_thresholds)",
        "Test macro-F1, 95% interval low (bootstrap over posts)",
        "Test macro-F1, 95% interval high (bootstrap over posts)"]
    assert all(r.verified is None for r in results)  # the Hub's to set, not ours

    # The header as the Hub reads it: model-index, parsed by huggingface_hub itself.
    text = (tmp_path / "model" / export.CARD).read_text()
    assert text.startswith("---\nlibrary_name: transformers\npipeline_tag: text-classification"
                           "\nbase_model: m\ntags:\n")
    header = yaml.safe_load(text.split("---\n")[1])
    assert model_index_to_eval_results(header["model-index"]) == (data.model_name, results)
    # The body as before: the heading, the usage snippet, the scores.
    assert card.text.startswith("\n# demo: trial 3, seed 42\n")
    assert ('classify = pipeline("text-classification", model="PATH", top_k=None, '
            'truncation=True)') in card.text
    assert "| macro-F1 | 0.5000 | 0.4000 to 0.6000 | 0.4500 | 0.2000 |" in card.text
    assert card.text.rstrip().endswith("must not be used as a clinical tool.")


def test_a_local_base_model_is_named_in_the_body_only(tmp_path, monkeypatch):
    local = tmp_path / "tiny-model"
    local.mkdir()
    report = replace(SCORED, objective="micro_f1",
                     params={**REPORT.params, "model_name": str(local)})
    card = card_written(tmp_path, monkeypatch, report)

    assert "base_model" not in card.data.to_dict()
    assert (tmp_path / "model" / export.CARD).read_text().startswith(
        "---\nlibrary_name: transformers\npipeline_tag: text-classification\ntags:\n")
    # The objective first.
    assert [(r.metric_args["average"], r.metric_value) for r in card.data.eval_results] == [
        ("micro", 0.55), ("micro", 0.45), ("micro", 0.65),
        ("macro", 0.5), ("macro", 0.4), ("macro", 0.6)]
    assert "```python\nfrom transformers import pipeline\n" in card.text
