"""Best checkpoints during the search: the models of the study's best `keep_best` COMPLETE
trials in an Optuna artifact store, the rest removed; a store that cannot be written is bad
input. Real training of the tiny model; the S3 store against moto's in-process S3."""

import json
import zipfile

import optuna
import pytest
import yaml
from conftest import run_in_process, study_dict
from optuna.trial import TrialState
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hpo.cli import main
from hpo.data.batching import encode
from hpo.data.redsm5 import label_names, read_redsm5
from hpo.data.splits import split_posts
from hpo.data.tasks import build_examples
from hpo.hardware import detect
from hpo.search.artifacts import KEPT, kept, location
from hpo.study_files import load
from hpo.training import metrics
from hpo.training.train import predict


@pytest.fixture
def study_file(tmp_path, tiny_model, small_data):
    config = study_dict([tiny_model], small_data, epochs=2)
    config["study"]["objective_epoch"] = "best"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(study_file, storage, n, *extra) -> int:
    return run_in_process(study_file, storage, n, "--set", "study.sampler.name=random", *extra)


def validation_score(model_dir, study_file) -> float:
    """The kept model's macro-F1 on the study's validation split, computed afresh."""
    config = load(study_file)
    data = config.data
    splits = split_posts(read_redsm5(data.dir), validation=data.validation_fraction,
                         test=data.test_fraction, seed=data.split_seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = encode(tokenizer, build_examples(splits.validation, "multilabel"), data.max_length)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir)
    probabilities = predict(model, encoded, 16, detect("cpu"), "none", tokenizer.pad_token_id)
    names = label_names(False)
    return metrics.f1_scores(probabilities > 0.5, encoded.labels.bool(), names).macro_f1


def test_the_best_trials_models_are_kept_and_the_others_removed(study_file, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run(study_file, storage, 5, "--set", "study.keep_best=2") == 0
    study = optuna.load_study(study_name="tiny", storage=storage)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    ranked = sorted(complete, key=lambda t: (-t.value, t.number))
    models = kept(study)
    assert sorted(models) == sorted(t.number for t in ranked[:2])

    store = tmp_path / "hpo-artifacts"  # beside the SQLite file
    assert location(None, storage) == str(store)
    assert sorted(p.name for p in store.iterdir()) == sorted(
        m["artifact_id"] for m in models.values())
    best = ranked[0]
    meta = optuna.artifacts.get_all_artifact_meta(best, storage=study._storage)
    assert models[best.number]["artifact_id"] in [m.artifact_id for m in meta]
    assert meta[-1].filename == f"trial-{best.number}.zip"

    archive = tmp_path / "best.zip"
    optuna.artifacts.download_artifact(
        artifact_store=optuna.artifacts.FileSystemArtifactStore(store),
        file_path=str(archive), artifact_id=models[best.number]["artifact_id"])
    with zipfile.ZipFile(archive) as opened:
        opened.extractall(tmp_path / "best")
    settings = json.loads((tmp_path / "best" / "hpo-trial.json").read_text())
    assert settings["trial"] == best.number and settings["value"] == best.value
    assert settings["value_epoch"] == best.user_attrs["value_epoch"]
    # The weights are those of the epoch the trial's value came from, not the last epoch's.
    assert validation_score(tmp_path / "best", study_file) == pytest.approx(best.value,
                                                                            abs=1e-6)
    capsys.readouterr()
    assert main(["best", "--config", str(study_file), "--storage", storage,
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["kept_model"] == models[best.number]


def test_keep_best_zero_keeps_nothing(study_file, tmp_path):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run(study_file, storage, 1, "--set", "study.keep_best=0") == 0
    assert not (tmp_path / "hpo-artifacts").exists()
    assert KEPT not in optuna.load_study(study_name="tiny", storage=storage).user_attrs


def test_a_server_storage_keeps_nothing_unless_a_store_is_named(study_file, pg_url, capsys):
    assert location(None, pg_url) is None
    assert run(study_file, pg_url, 1) == 0
    assert "no trial's model is kept: a server storage has no artifact store" in (
        capsys.readouterr().out)
    assert KEPT not in optuna.load_study(study_name="tiny", storage=pg_url).user_attrs


def test_an_artifact_store_that_cannot_be_written_is_refused(study_file, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run(study_file, storage, 1, "--set", f"study.artifacts={blocker / 'store'}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"study.artifacts {blocker / 'store'}: cannot create" in err[0]


def test_a_failed_upload_never_fails_the_trial(study_file, tmp_path, monkeypatch, capsys):
    def broken(**_kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(optuna.artifacts, "upload_artifact", broken)
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run(study_file, storage, 1) == 0
    (trial,) = optuna.load_study(study_name="tiny", storage=storage).trials
    assert trial.state == TrialState.COMPLETE
    assert "No space left on device" in trial.user_attrs["checkpoint_error"]
    assert "its model could not be kept" in capsys.readouterr().err


def test_an_s3_store_keeps_the_best_model(study_file, tmp_path, monkeypatch):
    boto3 = pytest.importorskip("boto3")
    moto = pytest.importorskip("moto")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    with moto.mock_aws():
        boto3.client("s3").create_bucket(Bucket="models")
        monkeypatch.setenv("HPO_ARTIFACTS", "s3://models")
        assert run(study_file, storage, 2) == 0
        study = optuna.load_study(study_name="tiny", storage=storage)
        (entry,) = kept(study).values()
        listed = boto3.client("s3").list_objects_v2(Bucket="models")
        assert [o["Key"] for o in listed["Contents"]] == [entry["artifact_id"]]
    assert not (tmp_path / "hpo-artifacts").exists()



def test_deleting_the_study_removes_its_kept_models(study_file, tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    assert run(study_file, storage, 2, "--set", "study.keep_best=2") == 0
    store = tmp_path / "hpo-artifacts"
    assert any(store.iterdir())
    assert main(["delete", "--config", str(study_file), "--storage", storage, "--yes"]) == 0
    assert "kept model(s) in" in capsys.readouterr().out
    assert not any(store.iterdir())


def test_ranking_keeps_the_best_k_whatever_the_order_of_finishing(tmp_path):
    from hpo.search.artifacts import Keeper, keep, open_store, ranks

    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    keeper = Keeper(open_store(str(tmp_path / "store")), str(tmp_path / "store"), 2)

    ids = {}
    for value in (0.5, 0.7, 0.6, 0.4, 0.7):
        trial = study.ask()
        if ranks(trial, value, keeper):  # as records.keep saves only a model that ranks
            saved = tmp_path / f"trial-{trial.number}"
            saved.mkdir()
            (saved / "weights").write_text("w")
            ids[trial.number] = keep(trial, value, keeper, saved)
        else:
            ids[trial.number] = None
        study.tell(trial, value)
    # 0.4 ranks below two others and is not uploaded; the later 0.7 ties the first and wins
    # second place over 0.6, whose model is removed.
    assert ids[3] is None
    assert sorted(kept(study)) == [1, 4]
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == sorted(
        [ids[1], ids[4]])
