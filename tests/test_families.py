"""Every model family of the shipped study files trains offline: a tiny replica of each (BERT,
RoBERTa, ELECTRA, DeBERTa-v3), with the files its hub repository ships in their formats, runs
one trial per precision this machine runs natively through `hpo run`, and the training facts
are asserted: GradScaler only for fp16, fused AdamW where torch has it, gradients clipped,
gradients set to None, and the attention each family gets."""

import math
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from conftest import REPO, study_dict
from optuna.trial import TrialState

from hpo.cli import main
from hpo.hardware import detect, native_precisions

# The hub models of the shipped studies and the family each belongs to; the demo study's
# models are the packaged MiniLM and the tiny BERT, which every other test trains.
FAMILY_OF = {
    "google-bert/bert-base-uncased": "bert",
    "FacebookAI/roberta-base": "roberta",
    "google/electra-base-discriminator": "electra",
    "microsoft/deberta-v3-base": "deberta-v3",
}
TRAINED_ELSEWHERE = {"sentence-transformers/all-MiniLM-L6-v2", "data/demo/models/tiny-bert"}
# transformers 5 has PyTorch's scaled-dot-product attention for these; DeBERTa's
# disentangled attention has only its own.
ATTENTION = {"bert": "sdpa", "roberta": "sdpa", "electra": "sdpa", "deberta-v3": "eager"}
HUB_FILES = {
    "bert": {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json",
             "tokenizer_config.json"},
    "roberta": {"config.json", "model.safetensors", "vocab.json", "merges.txt",
                "tokenizer.json"},
    "electra": {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json",
                "tokenizer_config.json"},
    "deberta-v3": {"config.json", "pytorch_model.bin", "spm.model", "tokenizer_config.json"},
}


def test_every_model_of_the_shipped_studies_has_a_replica_here():
    for path in sorted((REPO / "configs" / "studies").glob("*.yaml")):
        for name in yaml.safe_load(path.read_text())["search_space"]["model_name"]:
            assert name in FAMILY_OF or name in TRAINED_ELSEWHERE, (
                f"{path.name}: {name} has no tiny replica in the tests")


@pytest.mark.parametrize("family", sorted(ATTENTION))
def test_a_replica_has_the_files_of_its_hub_repository(replica, family):
    assert {p.name for p in replica(family).iterdir()} == HUB_FILES[family]


class Spies:
    """What the training loop asked of torch, recorded through torch's public classes."""

    def __init__(self, monkeypatch) -> None:
        self.scalers: list[bool] = []
        self.fused: list[bool | None] = []
        self.clipped: list[float] = []
        self.zero_grads: list[bool] = []
        spies = self

        class Scaler(torch.amp.GradScaler):
            def __init__(self, *args, enabled=True, **kwargs):
                spies.scalers.append(enabled)
                super().__init__(*args, enabled=enabled, **kwargs)

        class AdamW(torch.optim.AdamW):
            def __init__(self, *args, fused=None, **kwargs):
                spies.fused.append(fused)
                super().__init__(*args, fused=fused, **kwargs)

            def zero_grad(self, set_to_none=True):
                spies.zero_grads.append(set_to_none)
                super().zero_grad(set_to_none=set_to_none)

        clip = torch.nn.utils.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
            spies.clipped.append(max_norm)
            return clip(parameters, max_norm, *args, **kwargs)

        monkeypatch.setattr(torch.amp, "GradScaler", Scaler)
        monkeypatch.setattr(torch.optim, "AdamW", AdamW)
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_grad_norm_)


@pytest.mark.parametrize("family", sorted(ATTENTION))
def test_each_family_trains_a_trial_per_native_precision(family, replica, small_data, tmp_path,
                                                         monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    precisions = native_precisions(detect("cpu"))
    for precision in precisions:
        spies = Spies(monkeypatch)  # each precision's run on its own
        spec = study_dict([replica(family)], small_data)
        spec["search_space"].update(fp_precision=[precision], target_effective_batch_size=[8])
        spec["study"]["name"] = "tiny"
        study_file = tmp_path / f"{precision}.yaml"
        study_file.write_text(yaml.safe_dump(spec))
        storage = f"sqlite:///{tmp_path / f'{precision}.db'}"
        assert main(["run", "--config", str(study_file), "--storage", storage,
                     "--n-trials", "1"]) == 0
        (trial,) = optuna.load_study(study_name="tiny", storage=storage).trials
        assert trial.state == TrialState.COMPLETE, trial.user_attrs.get("error")
        assert math.isfinite(trial.value)
        assert trial.params["fp_precision"] == precision
        assert trial.user_attrs["attention_implementation"] == ATTENTION[family]
        assert trial.user_attrs["fused_adamw"] is True  # torch has fused AdamW for CPUs
        steps = trial.user_attrs["epochs_completed"] * (60 // 8)  # 60 train posts, batch 8
        # Every optimizer step clipped: the check's, the probe's and the training's.
        assert len(spies.clipped) >= steps + 2 and set(spies.clipped) == {1.0}
        assert set(spies.fused) == {True}
        assert len(spies.zero_grads) >= steps and all(spies.zero_grads)
        # One scaler per check, probe and training run, enabled for fp16 only (this CPU runs
        # no fp16 natively; tests/training/test_train.py shows the scaler on for an fp16 run).
        assert spies.scalers and all(e == (precision == "fp16") for e in spies.scalers)


def test_the_optimizer_falls_back_where_torch_has_no_fused_kernels():
    from hpo.hardware import fused_adamw
    from hpo.training.train import Plan, make_optimizer

    assert fused_adamw("cpu") and not fused_adamw("meta")
    plan = Plan(precision="none", effective_batch=8, physical_batch=8, eval_batch=8,
                learning_rate=1e-4, weight_decay=0.0, warmup_ratio=0.0, max_grad_norm=1.0,
                epochs=1, seed=0)

    class OnMeta:
        type = "meta"

    model = torch.nn.Linear(4, 2, device="meta")
    assert make_optimizer(model, plan, OnMeta()).defaults["fused"] is None
    assert make_optimizer(torch.nn.Linear(4, 2), plan, detect("cpu")).defaults["fused"] is True


def test_a_missing_sentencepiece_is_named_in_one_line(replica, small_data, tmp_path):
    # An environment without sentencepiece: the import system does not find it, as if it had
    # never been installed.
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.machinery\n"
        "_find = importlib.machinery.PathFinder.find_spec\n"
        "def _find_spec(cls, name, path=None, target=None):\n"
        "    if name.split('.')[0] == 'sentencepiece':\n"
        "        return None\n"
        "    return _find(name, path, target)\n"
        "importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)\n")
    study_file = tmp_path / "deberta.yaml"
    study_file.write_text(yaml.safe_dump(study_dict([replica("deberta-v3")], small_data)))
    result = subprocess.run(
        [sys.executable, "-m", "hpo.cli", "run", "--config", str(study_file), "--storage",
         f"sqlite:///{tmp_path / 'd.db'}", "--n-trials", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1",
             "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("hpo: error")]
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "needs sentencepiece" in lines[0] and "pip install sentencepiece" in lines[0]
    assert Path(replica("deberta-v3")).name in lines[0]
