"""The fleet as shipped, for real: docker/Dockerfile built and docker-compose.yml run with
docker-compose.cpu.yml on this machine's Docker engine, on local stand-ins for the base and
PostgreSQL images (docker/standin-images.sh: no registry here). The demo study on its tiny
model, two workers; a worker stopped mid-trial, another's process SIGKILLed; the dashboard in
Chromium; `hpo final` in a container, its export loaded on the host; `down -v` leaves nothing.

test_deploy.py checks the same files statically (and the GPU reservations, which an engine
without an NVIDIA runtime cannot start)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import REPO, free_port, rendered_text, require, require_command
from optuna.trial import TrialState
from postgres import study_trials
from test_deploy import dockerfile_base_default

from hpo.search import budget, pausing

pytestmark = pytest.mark.slow

STUDY = "demo"
# Full trainings of about 3 s each: enough that worker-0, alone once worker-1 is stopped,
# cannot spend them all while a loaded machine's docker-compose calls take their time before
# the kill. (Twice it did, at 24 and at 48: the test waited for the re-queued copy to finish,
# and a copy paused at a rung finishes only when the budget is spent. It waits for the copy
# to finish or pause now.)
BUDGET = 36
# The tiny model, trials of a few seconds: long enough to stop a worker inside one.
SETTINGS = ["--set", "search_space.model_name=[data/demo/models/tiny-bert]",
            "--set", "training.epochs=4", "--set", "study.keep_best=2"]
PASSWORD = "fleet-test-password"


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def require_engine() -> None:
    require(shutil.which("docker") is not None and docker("info").returncode == 0,
            "no Docker engine answers: apt-get install -y docker.io, then start dockerd "
            "(.ci/run does both)")


def wait_for(what: str, ready: Callable[[], object], timeout: float,
             interval: float = 0.5) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)


@dataclass(frozen=True)
class Fleet:
    project: str
    env: dict[str, str]
    files: list[Path]
    env_file: Path
    postgres_port: int
    dashboard_port: int
    base_image: str
    image: str

    def compose(self, *args: str, timeout: float = 600, check: bool = True):
        command = ["docker-compose", "--project-name", self.project,
                   "--project-directory", str(REPO), "--env-file", str(self.env_file)]
        for file in self.files:
            command += ["--file", str(file)]
        done = subprocess.run([*command, *args], cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        if check:
            assert done.returncode == 0, f"docker-compose {' '.join(args)}:\n{done.stderr}"
        return done

    def container(self, service: str) -> dict:
        cid = self.compose("ps", "-q", service).stdout.strip()
        assert cid, f"no container for {service}"
        return json.loads(docker("inspect", cid).stdout)[0]

    def trials(self) -> list[optuna.trial.FrozenTrial]:
        return study_trials(
            f"postgresql+psycopg2://hpo:{PASSWORD}@127.0.0.1:{self.postgres_port}/hpo", STUDY)


def standin_images() -> dict[str, str]:
    """HPO_BASE_IMAGE and HPO_POSTGRES_IMAGE, built by the script unless already here."""
    done = subprocess.run(["bash", str(REPO / "docker" / "standin-images.sh")],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split("=", 1) for line in done.stdout.split())


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    require_command("docker-compose", "docker-compose")
    require_command("mmdebstrap", "mmdebstrap")
    require_command("chromium", "chromium")
    require_engine()
    images = standin_images()
    here = tmp_path_factory.mktemp("fleet")
    (here / "empty.env").write_text("")  # a developer's own .env must not decide the outcome
    run = ["run", "--study", STUDY, "--n-trials", str(BUDGET), *SETTINGS]
    override = here / "test.yml"
    override.write_text(yaml.safe_dump({"services": {
        "init": {"command": ["create", "--study", STUDY, *SETTINGS]},
        "worker-0": {"command": run},
        "worker-1": {"command": run},
    }}))
    image = "hpo-test/hpo:fleet"  # kept, like the stand-ins: the next build reuses its layers
    postgres_port, dashboard_port = free_port(), free_port()
    fleet = Fleet(
        project=f"hpotest{os.getpid()}",
        env={**{k: v for k, v in os.environ.items()
                if not k.startswith(("COMPOSE_", "HPO_", "POSTGRES_"))},
             **images, "HPO_IMAGE": image, "POSTGRES_PASSWORD": PASSWORD,
             "HPO_POSTGRES_PORT": str(postgres_port), "HPO_DASHBOARD_PORT": str(dashboard_port),
             # Scaled down from 30 s and 120 s, as in the soak, so a kill is noticed quickly.
             "HPO_HEARTBEAT_INTERVAL": "2", "HPO_GRACE_PERIOD": "8"},
        files=[REPO / "docker-compose.yml", REPO / "docker-compose.cpu.yml", override],
        env_file=here / "empty.env", postgres_port=postgres_port, dashboard_port=dashboard_port,
        base_image=images["HPO_BASE_IMAGE"], image=image)
    try:
        fleet.compose("build", timeout=1800)
        yield fleet
    finally:
        fleet.compose("down", "--volumes", "--remove-orphans", check=False)


def test_the_image_runs_as_uid_10001_keeps_the_base_torch_and_answers_help(fleet):
    assert docker("run", "--rm", "--entrypoint", "id", fleet.image, "-u").stdout.strip() == "10001"
    version = ["python", "-c", "import torch; print(torch.__version__)"]
    base = docker("run", "--rm", fleet.base_image, *version)
    ours = docker("run", "--rm", "--entrypoint", version[0], fleet.image, *version[1:])
    assert base.returncode == ours.returncode == 0, base.stderr + ours.stderr
    assert ours.stdout.split() == base.stdout.split()
    shown = docker("run", "--rm", fleet.image, "--help")
    assert shown.returncode == 0 and "final" in shown.stdout


def test_the_fleet_runs_the_study_to_its_budget_through_a_stop_and_a_kill(fleet, tmp_path):
    fleet.compose("up", "--detach", "--no-build")
    began = time.monotonic()
    assert fleet.container("init")["State"]["ExitCode"] == 0

    # `stop` (SIGTERM) in the middle of a trial: the worker fails it and re-queues it at once,
    # and the other worker runs the copy.
    host = fleet.container("worker-1")["Config"]["Hostname"]
    for _attempt in range(3):
        failed = stop_in_a_trial(fleet, "worker-1", host)
        if failed is not None:
            break
        fleet.compose("start", "worker-1")  # the trial ended before the stop: again
    assert failed is not None, "worker-1 finished its trial before every stop"
    assert failed.user_attrs["error"] == "interrupted by SIGTERM"
    copies = [t for t in fleet.trials() if t.system_attrs.get("failed_trial") == failed.number]
    assert len(copies) == 1, "the interrupted trial was not re-queued once"
    # Re-queued by the worker as it stopped (`executor.free` says so only when it queued the
    # copy itself), not by the reaper a grace period later. Told by what the worker printed,
    # not by how long the stop took: that is the machine's to decide.
    logs = docker("logs", fleet.container("worker-1")["Id"])
    printed = " ".join((logs.stdout + logs.stderr).split())  # Rich wraps at 80 columns
    said = f"trial {failed.number} failed (interrupted by SIGTERM) and re-queued for the next"
    assert said in printed, printed[-3000:]

    other = fleet.container("worker-0")["Config"]["Hostname"]
    # Finished or paused at a rung: a paused copy stays RUNNING until a rung promotes it or
    # the budget is spent, and waiting for that would spend it before the kill below.
    copy = wait_for("the re-queued copy to finish or pause", lambda: next(
        (t for t in fleet.trials() if t.number == copies[0].number
         and (t.state.is_finished() or pausing.is_paused(t))), None), timeout=300)
    assert copy.params == failed.params
    assert copy.user_attrs["worker"].startswith(f"{other}:")
    assert copy.user_attrs["retry_of"] == failed.number

    # A worker SIGKILLed as the kernel's OOM killer would (its process, from the host): the
    # restart policy (on-failure) brings it back and it rejoins; with worker-1 down, a trial
    # numbered after the kill is worker-0's after its restart. Not `docker-compose kill`: the
    # engine counts that as a manual stop and restarts nothing (Docker 20.10 here).
    before = fleet.trials()
    last = max(t.number for t in before)
    resumed = {t.number: len(t.user_attrs.get("resumes", [])) for t in before}
    spent = budget.Trainings(BUDGET, 4).spent(budget.trained_of(before))
    # Less than two trainings left: the restarted worker might find nothing to claim.
    assert spent < BUDGET - 2, (
        f"{spent:.1f} of {BUDGET} trainings spent before the kill, "
        f"{time.monotonic() - began:.0f} s after `up`: raise BUDGET; {timeline(before)}")
    os.kill(fleet.container("worker-0")["State"]["Pid"], signal.SIGKILL)
    restarted = wait_for("worker-0 to be restarted", lambda: (
        c := fleet.container("worker-0"))["RestartCount"] >= 1 and c["State"]["Running"] and c,
        timeout=120)
    assert restarted["Config"]["Hostname"] == other
    # A claim is a new trial or a paused one resumed (a free worker resumes what a rung
    # promotes before it starts anything new; `pausing.claim` names it the worker's).
    try:
        wait_for("worker-0 to claim a trial after its restart", lambda: [
            t for t in fleet.trials()
            if (t.number > last or len(t.user_attrs.get("resumes", [])) > resumed.get(t.number, 0))
            and str(t.user_attrs.get("worker", "")).startswith(f"{other}:")], timeout=300)
    except AssertionError as timed_out:
        # It has timed out now and then in CI (never alone so far): say what the fleet did.
        logs = docker("logs", fleet.container("worker-0")["Id"])
        raise AssertionError(f"{timed_out}; last {last}; copy {copy.number}; "
                             f"{timeline(fleet.trials())}; worker-0 printed: "
                             f"{(logs.stdout + logs.stderr)[-4000:]}") from None

    # Chromium shows the study through the published loopback port.
    page = rendered_text(f"http://127.0.0.1:{fleet.dashboard_port}/dashboard", tmp_path / "p")
    assert STUDY in page, page[:2000]

    # The study ends with exactly its budget; the worker that finished it exits 0.
    state = wait_for("worker-0 to exit", lambda: not (
        s := fleet.container("worker-0")["State"])["Running"] and not s["Restarting"] and s,
        timeout=600, interval=2)
    assert state["ExitCode"] == 0, fleet.compose("logs", "--tail", "40", "worker-0").stdout
    trials = fleet.trials()
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    # The default budget: BUDGET full trainings of 4 epochs, short by less than one; the
    # trials a rung stopped or paused gave back what they did not train, so more ran.
    assert len(finished) >= BUDGET
    spent = budget.Trainings(BUDGET, 4).spent(budget.trained_of(trials))
    assert BUDGET - 1 < spent <= BUDGET, spent
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def timeline(trials: list[optuna.trial.FrozenTrial]) -> str:
    """Each trial's number, state, worker, resumes and start and end in seconds from the
    first start: what a failure of the fleet test needs to say when it happened."""
    first = min((t.datetime_start for t in trials if t.datetime_start), default=None)

    def at(moment) -> str:
        return "-" if moment is None or first is None else f"{(moment - first).total_seconds():.0f}"

    return "trials " + ", ".join(
        f"{t.number} {t.state.name} {t.user_attrs.get('worker')} "
        f"r{len(t.user_attrs.get('resumes', []))} {at(t.datetime_start)}-{at(t.datetime_complete)}"
        for t in trials)


def stop_in_a_trial(fleet: Fleet, service: str, host: str) -> optuna.trial.FrozenTrial | None:
    """`docker-compose stop` of `service` while it runs a trial that has reported no epoch yet
    (at least two epochs left, pruned or not); that trial as it ended if the stop failed it."""
    running = wait_for(f"a starting trial of {service} ({host})", lambda: [
        t for t in fleet.trials() if t.state == TrialState.RUNNING and not t.intermediate_values
        and str(t.user_attrs.get("worker", "")).startswith(f"{host}:")], timeout=300,
        interval=0.2)
    fleet.compose("stop", service)
    # 143, not 137: the worker ended by itself within Docker's stop timeout, not killed.
    assert fleet.container(service)["State"]["ExitCode"] == 143
    by_number = {t.number: t for t in fleet.trials()}
    failed = [by_number[t.number] for t in running if by_number[t.number].state == TrialState.FAIL]
    return failed[0] if failed else None


def test_final_in_a_container_exports_a_model_the_host_loads(fleet, tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    export.chmod(0o777)  # written by the image's user, uid 10001
    fleet.compose("run", "--rm", "--no-deps", "--volume", f"{export}:/export", "worker-0",
                  "final", "--study", STUDY, *SETTINGS, "--seeds", "1", "--output",
                  "/export/model", timeout=900)
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(export / "model"), top_k=None)
    (scores,) = classify(["I can't sleep and nothing feels worth doing anymore."])
    assert {s["label"] for s in scores} >= {"DEPRESSED_MOOD", "SLEEP_ISSUES"}


def test_down_leaves_no_container_volume_or_network(fleet):
    fleet.compose("down", "--volumes")
    label = f"label=com.docker.compose.project={fleet.project}"
    for kind in ("container", "volume", "network"):
        listed = docker(kind, "ls", *(["--all"] if kind == "container" else []), "--quiet",
                        "--filter", label)
        assert listed.returncode == 0 and listed.stdout.strip() == "", (kind, listed.stdout)


def test_on_a_gpu_host_the_image_builds_on_the_real_base_and_sees_the_gpu():
    """What this machine cannot show; runs where an engine has the NVIDIA runtime and can pull
    the real base image."""
    require_engine()
    if "nvidia" not in docker("info", "--format", "{{json .Runtimes}}").stdout:
        pytest.skip("this Docker engine has no NVIDIA runtime: the GPU reservations "
                    "(docker-compose.override.yml) are checked statically only, in "
                    "test_deploy.py; the fleet ran on the CPU with docker-compose.cpu.yml")
    base = dockerfile_base_default()
    if docker("pull", base, timeout=1800).returncode != 0:
        pytest.skip(f"no registry reachable: {base} cannot be pulled; the image was built on "
                    f"docker/standin-images.sh's stand-in")
    image = f"hpo-test/hpo:gpu{os.getpid()}"
    built = subprocess.run(["docker", "build", "-f", "docker/Dockerfile", "-t", image, "."],
                           cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stderr[-3000:]
    try:
        shown = docker("run", "--rm", "--gpus", "device=0", image, "hardware", timeout=600)
        assert shown.returncode == 0 and "cuda" in shown.stdout.lower(), shown.stdout
    finally:
        docker("image", "rm", image)

