"""The README's main job, the demo study, run as a new user runs it: hpo installed from a
wheel into a fresh virtual environment and run from an empty directory, with no repository
around it. 8 trials, not the README's 20: the 6 random startup trials, then TPE's and the
pruner's first verdicts; the search has reached all-MiniLM by trial 4 on every machine
measured, and on an AVX2-only CPU (fp32) the 20 take 7.5 minutes, a third of the CI run.
`benchmarks/demo_study.py` runs all 20."""

import subprocess
import sys
import venv
from pathlib import Path

import optuna
import pytest
from conftest import REPO
from optuna.trial import TrialState

from hpo.search import budget


def enclosing_site_packages() -> list[str]:
    """The site-packages directories this interpreter imports from: a virtual environment's
    own and, where it was made with system site packages, its base interpreter's."""
    return [path for path in sys.path if Path(path).name in ("site-packages", "dist-packages")
            and Path(path).is_dir()]


def nested_venv(where: Path) -> Path:
    """A virtual environment that sees this interpreter's packages (torch, transformers: no
    download) but imports its own first. `system_site_packages` would show the *base*
    interpreter's packages, not an enclosing virtual environment's, so a `.pth` file names
    them instead. Plain path lines: the enclosing directories' own `.pth` files (an editable
    hpo's finder among them) are not run. Returns its bin directory."""
    venv.create(where, with_pip=True)
    (own,) = where.glob("lib/python*/site-packages")
    (own / "enclosing.pth").write_text("\n".join(enclosing_site_packages()) + "\n")
    return where / "bin"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The bin directory of a virtual environment holding hpo's wheel. It sees this
    interpreter's packages, but hpo only from the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(root / "dist"), str(REPO)], check=True, timeout=600)
    (wheel,) = (root / "dist").glob("hpo-*.whl")
    bin_dir = nested_venv(root / "env")
    subprocess.run([bin_dir / "python", "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=600)
    return bin_dir


def test_the_wheel_holds_the_demo_and_hpo_comes_from_it(installed, tmp_path):
    where = subprocess.run(
        [installed / "python", "-c", "import hpo, pathlib; print(pathlib.Path(hpo.__file__))"],
        cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    package = Path(where).parent
    assert package.is_relative_to(installed.parent), where
    assert (package / "studies" / "demo.yaml").is_file()
    assert (package / "demo" / "redsm5_posts.csv").is_file()
    assert (package / "demo" / "models" / "tiny-bert" / "model.safetensors").is_file()


def test_the_nested_environment_imports_this_ones_packages(installed, tmp_path):
    # Inside a virtual environment, a nested one made with system_site_packages imported
    # neither optuna nor torch: it saw the base interpreter's packages.
    where = subprocess.run(
        [installed / "python", "-c", "import optuna; print(optuna.__file__)"],
        cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()
    assert where == optuna.__file__


def test_a_study_whose_data_is_missing_names_what_is_missing(installed, tmp_path):
    result = subprocess.run([installed / "hpo", "run", "--study", "redsm5", "--n-trials", "1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "data/redsm5: data directory not found" in lines[0]
    assert "redsm5_posts.csv" in lines[0] and "Traceback" not in result.stderr


@pytest.mark.slow
def test_demo_study_from_an_empty_directory_beats_the_trivial_baseline(installed, tmp_path):
    work = tmp_path / "empty"  # beside the tokenization cache the fixture puts in tmp_path
    work.mkdir()
    result = subprocess.run([installed / "hpo", "run", "--study", "demo", "--n-trials", "8"],
                            cwd=work, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-2000:]
    study = optuna.load_study(study_name="demo", storage=f"sqlite:///{work / 'hpo.db'}")
    finished = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(finished) == len(study.trials) >= 8  # none left running, paused or failed
    # The default budget: 8 full trainings of the demo's 2 epochs, short by less than one;
    # the trials a rung paused or stopped gave back what they did not train.
    assert 7 < budget.Trainings(8, 2).spent(budget.trained_of(study.trials)) <= 8
    assert not list((work / "hpo-artifacts").glob("checkpoint-*"))  # none left paused
    # Both models loaded from the package: the MiniLM's and the demo's tiny BERT.
    assert {t.params["model_name"] for t in finished} == {
        "sentence-transformers/all-MiniLM-L6-v2", "data/demo/models/tiny-bert"}
    for trial in finished:
        assert trial.user_attrs["effective_batch_size"] == (
            trial.params["target_effective_batch_size"])
    baseline = study.user_attrs["baseline"]["macro_f1"]
    # A model that learned nothing scores below the baseline (tiny-bert: 0.07-0.15 here).
    assert study.best_value > baseline + 0.15, (study.best_value, baseline)
    assert "best trial" in result.stdout and "trivial baseline" in result.stdout
    # What a run leaves in the working directory: the storage, its lock, the kept models.
    assert sorted(p.name for p in work.iterdir()) == ["hpo-artifacts", "hpo.db", "hpo.hpo-lock"]
