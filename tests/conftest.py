"""Shared fixtures: a tiny BERT built from the demo corpus, a small ReDSM5-format data set,
a tiny study file, mocked device capabilities, the outside services some tests need (skipped
with the reason when absent, failed instead under HPO_TESTS_REQUIRE_SERVICES=1 as in CI), and
a guard that no test leaves a process running."""

from __future__ import annotations

import csv
import functools
import gc
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import optuna
import psutil
import pytest
import yaml
from postgres import free_port  # noqa: F401  (one home; tests import it from here)

from hpo.hardware import Device

REPO = Path(__file__).resolve().parents[1]
DEMO_DATA = REPO / "data" / "demo"

T4 = Device("cuda", "Tesla T4", 16 * 2**30, compute_capability=(7, 5), index=0)
A100 = Device("cuda", "NVIDIA A100-SXM4-40GB", 40 * 2**30, compute_capability=(8, 0), index=0)
H100 = Device("cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30, compute_capability=(9, 0), index=0)
CPU_AVX2 = Device("cpu", "x86 AVX2", 8 * 2**30, cpu_flags=frozenset({"avx", "avx2", "fma"}))
CPU_AVX512_BF16 = Device(
    "cpu", "x86 AVX512-BF16", 8 * 2**30, cpu_flags=frozenset({"avx2", "avx512f", "avx512_bf16"})
)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): one test process per core this process may run on."""
    from hpo.app.launcher import cores

    return cores()


def pytest_configure(config) -> None:
    """Tests run side by side (pytest-xdist) share the cores as hpo's launcher shares them
    between its workers (`launcher.plan`): each test process, and every process it starts,
    gets an equal share of torch threads, so that no two of them oversubscribe a core."""
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not count:
        return
    import torch

    from hpo.app.launcher import cores, plan

    # A CPU host's plan: every worker gets the same environment, threads as set where set.
    os.environ.update(plan(int(count), [], cores(), os.environ)[0].env)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def require(available: bool, missing: str) -> None:
    """Skip a test whose outside service is missing, saying what to install or start; where
    HPO_TESTS_REQUIRE_SERVICES=1 (CI), fail instead, so nothing is skipped unnoticed."""
    if available:
        return
    if os.environ.get("HPO_TESTS_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{missing} (HPO_TESTS_REQUIRE_SERVICES=1)")
    pytest.skip(missing)


@functools.cache
def _postgres_up() -> bool:
    from postgres import server_available

    return server_available()


def require_postgres() -> None:
    require(_postgres_up(), "PostgreSQL is not reachable at 127.0.0.1:5432: start it, with "
            "trust auth for local connections (docs/testing.md)")


def require_command(name: str, package: str) -> str:
    path = shutil.which(name)
    require(path is not None, f"`{name}` is not installed: apt-get install -y {package}")
    return path


def rendered_text(url: str, profile) -> str:
    """The page's text after its scripts ran, as headless Chromium renders it."""
    dom = subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", f"--user-data-dir={profile}", "--virtual-time-budget=20000",
         "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    ).stdout
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))


PROCESS_MARKER = "HPO_TESTS_PROCESS_MARKER"
_RESOURCE_TRACKER = "multiprocessing.resource_tracker"


@pytest.fixture(autouse=True)
def no_leaked_process(monkeypatch):
    """Every process a test starts inherits a marker in its environment; any still running
    when the test ends (orphans whose parent died included) is killed and fails the test."""
    marker = os.urandom(8).hex()
    monkeypatch.setenv(PROCESS_MARKER, marker)
    yield
    marked = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            # multiprocessing's resource tracker serves this test process until it exits.
            if (process.pid != os.getpid() and process.environ().get(PROCESS_MARKER) == marker
                    and _RESOURCE_TRACKER not in " ".join(process.info["cmdline"] or ())):
                marked.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    # A process on its way out (a browser's crash handler, say) gets a moment to finish.
    _, leaked = psutil.wait_procs(marked, timeout=5)
    for process in leaked:
        process.kill()
    psutil.wait_procs(leaked, timeout=10)
    assert not leaked, "the test left processes running: " + "; ".join(
        " ".join(process.info.get("cmdline") or [str(process.pid)])[:200] for process in leaked)


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def token_cache_dir(tmp_path, monkeypatch) -> Path:
    """Each test's own tokenization cache (inherited by the workers it starts), so no test
    reads another's entries or writes to the home directory."""
    directory = tmp_path / "hpo-cache"
    monkeypatch.setenv("HPO_CACHE_DIR", str(directory))
    return directory / "tokens"


@pytest.fixture(autouse=True)
def kernel_cache_variables(monkeypatch) -> None:
    """Each test starts without the kernel-cache variables a CPU worker sets in its process
    (an in-process `hpo run` sets them), and the workers it starts set their own."""
    from hpo.hardware import CPU_KERNEL_CACHES

    for name in CPU_KERNEL_CACHES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer BERT of hidden size 32 with a WordPiece vocabulary from the demo posts."""
    make = _load_script("make_tiny_model")
    out = tmp_path_factory.mktemp("models") / "tiny-bert"
    return make.make_tiny_bert(
        make.read_posts(DEMO_DATA), out, vocab_size=800, hidden=32, layers=2, heads=2
    )


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> Path:
    make = _load_script("make_tiny_model")
    out = tmp_path_factory.mktemp("models") / "tiny-bert-b"
    return make.make_tiny_bert(
        make.read_posts(DEMO_DATA), out, vocab_size=600, hidden=16, layers=1, heads=2, seed=1
    )


@pytest.fixture(scope="session")
def replica(tmp_path_factory):
    """A tiny offline replica of a model family of the shipped studies, by family name
    (scripts/make_tiny_model.py FAMILIES), with the files its hub repository ships."""
    make = _load_script("make_tiny_model")
    texts = make.read_posts(DEMO_DATA)
    built: dict[str, Path] = {}

    def build(family: str) -> Path:
        if family not in built:
            out = tmp_path_factory.mktemp("replicas") / f"tiny-{family}"
            built[family] = make.make_replica(family, texts, out, vocab_size=600, hidden=32,
                                              layers=2, heads=2)
        return built[family]

    return build


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """The first 80 demo posts and their annotations, in ReDSM5 format."""
    out = tmp_path_factory.mktemp("data")
    with (DEMO_DATA / "redsm5_posts.csv").open(encoding="utf-8", newline="") as handle:
        posts = list(csv.DictReader(handle))[:80]
    keep = {row["post_id"] for row in posts}
    with (DEMO_DATA / "redsm5_annotations.csv").open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        fields = reader.fieldnames
        notes = [row for row in reader if row["post_id"] in keep]
    for name, rows, header in (
        ("redsm5_posts.csv", posts, ["post_id", "text"]),
        ("redsm5_annotations.csv", notes, fields),
    ):
        with (out / name).open("w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)
    return out


def study_dict(models: list[Path | str], data: Path, **training) -> dict:
    return {
        "study": {"sampler": {"name": "random", "seed": 0}, "pruner": {"name": "none"}},
        "data": {"dir": str(data), "max_length": 32, "validation_fraction": 0.25,
                 "test_fraction": 0.0},
        "search_space": {
            "model_name": [str(m) for m in models],
            "fp_precision": ["none"],
            "target_effective_batch_size": [8, 16],
            "learning_rate": {"low": 1.0e-4, "high": 1.0e-3, "log": True},
        },
        "training": {"epochs": 1, "max_physical_batch_size": 16, "device": "cpu", **training},
    }


@pytest.fixture
def tiny_study(tmp_path, tiny_model, tiny_model_b, small_data) -> Path:
    """A study file over the two tiny models and the small data set, fast on a CPU."""
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(study_dict([tiny_model, tiny_model_b], small_data)))
    return path


def _database_of_its_own() -> Iterator[str]:
    """A fresh database on the shared PostgreSQL server, dropped afterwards; a connection the
    test left open to it fails the test (the server's `max_connections` is shared by all)."""
    from postgres import drop_database, fresh_database, open_connections

    require_postgres()
    url = fresh_database()
    yield url
    left = open_connections(url)
    drop_database(url)
    assert not left, f"the test left {len(left)} database connection(s) open: {left}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    yield from _database_of_its_own()


@pytest.fixture(params=["sqlite", "postgresql"])
def any_storage(request, tmp_path) -> Iterator[str]:
    """Each storage backend in turn: the contract tests run against both."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'hpo.db'}"
        return
    yield from _database_of_its_own()


@pytest.fixture
def one_model_study(tmp_path, tiny_model, small_data) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(study_dict([tiny_model], small_data)))
    return path


def start_worker(study_file: Path, storage: str, n: int, *extra: str,
                 env: dict | None = None) -> subprocess.Popen:
    """`hpo run` in a process of its own, as a user (or compose) starts a worker."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpo.cli", "run", "--config", str(study_file),
         "--storage", storage, "--n-trials", str(n), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def trial_states(storage: str, name: str = "tiny") -> Counter:
    study = optuna.load_study(study_name=name, storage=storage)
    return Counter(t.state for t in study.trials)


def run_in_process(study_file: Path, storage: str, n: int, *extra: str) -> int:
    """`hpo run` in this process: its exit code."""
    from hpo.cli import main

    return main(["run", "--config", str(study_file), "--storage", storage,
                 "--n-trials", str(n), *extra])


class Quiet:
    """A worker's display (its loop's and its trials') that keeps what it was told instead of
    printing it: messages and warnings, and each epoch as (trial number, epoch, score)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.epochs: list[tuple[int, int, float]] = []

    def message(self, text: str) -> None:
        self.messages.append(text)

    def warning(self, text: str) -> None:
        self.messages.append(text)

    def trial_finished(self, trial, outcome) -> None: ...

    def interrupted(self, text: str) -> None:
        self.messages.append(text)

    def trial_started(self, number, params, plan, probes) -> None: ...

    def step(self, number, progress, epochs) -> None: ...

    def epoch(self, number, epoch, epochs, score) -> None:
        self.epochs.append((number, epoch, score))


def write_study(tmp_path: Path, data) -> Path:
    """A study file in `tmp_path` holding `data`: a mapping dumped as YAML, or the text."""
    path = tmp_path / "study.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def load(storage: str, name: str = "tiny") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=storage)


def freeze_counts(monkeypatch, owner, name: str) -> list[int]:
    """Wraps `owner.name`: the list gets, at each call, how many objects were frozen out of
    the garbage collector's sight (`memory.long_lived_frozen`)."""
    counts: list[int] = []
    wrapped = getattr(owner, name)

    def counted(*args, **kwargs):
        counts.append(gc.get_freeze_count())
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return counts


def trials_of(storage: str, name: str = "tiny") -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=name, storage=storage)
    return sorted(study.trials, key=lambda t: t.number)


@pytest.fixture
def storage(tmp_path) -> str:
    """A SQLite storage of the test's own."""
    return f"sqlite:///{tmp_path / 'hpo.db'}"
