"""The release a study records, and workers of other releases joining it (issue 30: a worker
from an older release failed inside a trial on what a newer one had stored)."""

import optuna
import pytest

from hpo.cli import main
from hpo.search import release


def test_a_new_study_records_the_release_that_created_it(tiny_study, any_storage, capsys):
    assert main(["create", "--config", str(tiny_study), "--storage", any_storage,
                 "--skip-check"]) == 0
    study = optuna.load_study(study_name="tiny", storage=any_storage)
    assert study.user_attrs[release.ATTR] == {"created_by": release.version(),
                                             "format": release.STORE_FORMAT}
    assert release.version() not in ("", "unknown")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"hpo {release.version()}"


def test_a_worker_refuses_a_study_of_a_newer_store_format_in_one_line(tiny_study, tmp_path,
                                                                        capsys):
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    newer = {"created_by": "9.0.0", "format": release.STORE_FORMAT + 1}
    study.set_user_attr(release.ATTR, newer)
    capsys.readouterr()
    assert main(["run", "--config", str(tiny_study), "--storage", storage,
                 "--n-trials", "1", "--skip-check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("hpo: error: study 'tiny' was written by hpo 9.0.0 in store format")
    assert "upgrade hpo" in err[0]
    assert optuna.load_study(study_name="tiny", storage=storage).trials == []
    assert study.user_attrs[release.ATTR] == newer  # left as the newer release wrote it


@pytest.mark.parametrize("found", [{"created_by": "0.0.1", "format": 1}, None])
def test_a_newer_worker_joins_an_older_study(tiny_study, tmp_path, found):
    """An older release's record is kept; a study from before records existed gets one that
    says so."""
    storage = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="tiny", storage=storage, direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=0.1))
    if found is not None:
        study.set_user_attr(release.ATTR, found)
    assert main(["create", "--config", str(tiny_study), "--storage", storage,
                 "--skip-check"]) == 0
    recorded = optuna.load_study(study_name="tiny", storage=storage).user_attrs[release.ATTR]
    assert recorded == (found or {"created_by": f"before {release.version()}", "format": 1})


@pytest.mark.parametrize("found", ["0.1.0", {"created_by": "x"}, {"format": True}])
def test_a_record_hpo_did_not_write_is_named(found):
    with pytest.raises(release.StudyFormatError, match="study 'x' holds an unreadable"):
        release.validate("x", found)
