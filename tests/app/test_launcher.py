"""`hpo run --workers`: the workers planned per host, the launcher's supervision (prefixed
lines, restarts, the worst code, signals passed on) with stand-in children, and real
workers on the demo's tiny models."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter

import optuna
import psutil
import pytest
import torch
from conftest import REPO
from optuna.trial import TrialState

from hpo import hardware
from hpo.app.launcher import (
    Launcher,
    LaunchError,
    WorkerSpec,
    _Child,
    exit_code,
    left_trials,
    plan,
    worst,
)
from hpo.cli import _worker_command, build_parser, main

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


def test_gpus_gives_each_worker_its_own_device_and_a_share_of_the_cores():
    specs = plan(None, ["0", "1", "2", "3"], cores=16, environ={})
    assert [s.name for s in specs] == ["w0", "w1", "w2", "w3"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2", "3"]
    assert {s.env["OMP_NUM_THREADS"] for s in specs} == {"4"}
    assert specs[2].place == "GPU 2 (CUDA_VISIBLE_DEVICES=2), 4 of 16 cores"


def test_gpus_k_puts_k_workers_on_each_gpu_each_told_its_share():
    specs = plan(None, ["0", "1"], cores=16, environ={}, per_gpu=2)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "0", "1", "1"]
    assert {s.env["HPO_WORKERS_PER_GPU"] for s in specs} == {"2"}
    assert {s.env["OMP_NUM_THREADS"] for s in specs} == {"4"}
    assert specs[3].place == "GPU 1 (CUDA_VISIBLE_DEVICES=1), 1/2 of its memory, 4 of 16 cores"
    # One worker per GPU is told nothing: it has the whole device.
    assert all("HPO_WORKERS_PER_GPU" not in s.env for s in plan(None, ["0"], 2, {}))


def test_a_count_takes_the_first_gpus_and_keeps_their_names():
    specs = plan(2, ["GPU-aa", "GPU-bb", "GPU-cc"], cores=8, environ={})
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["GPU-aa", "GPU-bb"]


def test_more_workers_than_gpus_is_refused():
    with pytest.raises(LaunchError, match=r"--workers 5: this host shows 4 GPU\(s\).* "
                                          r"--workers gpus:K for K workers per GPU"):
        plan(5, ["0", "1", "2", "3"], cores=8, environ={})


def test_gpus_without_a_gpu_says_how_to_run_cpu_workers():
    with pytest.raises(LaunchError, match="no GPU is visible.*--workers 2"):
        plan(None, [], cores=2, environ={})


def test_cpu_workers_divide_the_cores_unless_the_user_set_the_threads():
    specs = plan(3, [], cores=2, environ={})
    assert [dict(s.env) for s in specs] == [{"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}] * 3
    assert specs[0].place == "1 of 2 cores"
    kept = plan(2, [], cores=8, environ={"OMP_NUM_THREADS": "3"})
    assert dict(kept[0].env) == {"MKL_NUM_THREADS": "4"}


def test_the_worst_code_ranks_errors_over_signals_over_done():
    assert worst([0, 0]) == 0
    assert worst([0, 130]) == 130
    assert worst([130, 143]) == 143
    assert worst([143, 2, 130]) == 2
    assert worst([2, 1]) == 1
    assert worst([0, exit_code(-signal.SIGKILL)]) == 137
    assert worst([]) == 0


def test_the_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5")
    assert hardware.visible_gpus() == ["3", "5"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert hardware.visible_gpus() == ["0", "1"]
    monkeypatch.setenv("HPO_FAULT_GPUS", "4")
    assert hardware.visible_gpus() == ["0", "1", "2", "3"]


def test_a_worker_runs_the_same_study_budget_and_overrides_without_workers():
    args = build_parser().parse_args([
        "--debug", "run", "--study", "demo", "--storage", "sqlite:///x.db", "--n-trials", "4",
        "--timeout", "60", "--workers", "2", "--restarts", "1", "--set", "training.epochs=1",
        "--skip-check"])
    assert _worker_command(args, "run")[1:] == [
        "-m", "hpo.cli", "run", "--study", "demo", "--storage", "sqlite:///x.db",
        "--set", "training.epochs=1", "--skip-check", "--debug", "--n-trials", "4",
        "--timeout", "60.0"]
    assert _worker_command(args, "create")[3:] == [
        "create", "--study", "demo", "--storage", "sqlite:///x.db", "--set",
        "training.epochs=1", "--skip-check", "--debug"]


def test_bad_worker_counts_are_one_line_errors(capsys):
    for value, message in (
            ("0", "expected a number of workers (1 or more), 'gpus' or 'gpus:K', got 0"),
            ("abc", "expected a number of workers, 'gpus' or 'gpus:K', got 'abc'"),
            ("gpus:0", "expected gpus:K, K workers per GPU (1 or more), got 'gpus:0'"),
            ("gpus:x", "expected gpus:K, K workers per GPU (1 or more), got 'gpus:x'")):
        assert main(["run", "--study", "demo", "--n-trials", "2", "--workers", value]) == 2
        assert capsys.readouterr().err == f"hpo: error: run: argument --workers: {message}\n"


def test_gpus_on_a_host_without_one_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert main(["run", "--study", "demo", "--n-trials", "2", "--workers", "gpus"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no GPU is visible" in err and "--workers 2" in err


# Stand-in workers: each line says who printed it, and ROLE decides how it ends.
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    role, marks = os.environ["ROLE"], os.environ["MARKS"]
    with open(marks, "a") as f:
        f.write(role + "\\n")
    print(f"hello from {role}", flush=True)
    print(f"note from {role}", file=sys.stderr, flush=True)
    if role == "fail":
        sys.exit(1)
    if role == "bad":
        sys.exit(2)
    if role == "dies-once" and open(marks).read().count(role) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if role == "waits":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        signal.signal(signal.SIGINT, lambda *_: sys.exit(130))
        print("waiting", flush=True)
        time.sleep(60)
""")


def spec(name: str, role: str, marks) -> WorkerSpec:
    return WorkerSpec(name, {"ROLE": role, "MARKS": str(marks)}, f"as {role}")


def launched(*roles: str, restarts: int, tmp_path,
             on_death=None) -> tuple[int, str, str, Counter]:
    out, err = io.StringIO(), io.StringIO()
    marks = tmp_path / "marks"
    launcher = Launcher([sys.executable, "-c", CHILD], restarts=restarts, out=out, err=err,
                        on_death=on_death)
    code = launcher.supervise([spec(f"w{i}", role, marks) for i, role in enumerate(roles)])
    return code, out.getvalue(), err.getvalue(), Counter(marks.read_text().split())


def test_lines_are_prefixed_by_worker_and_stream(tmp_path):
    code, out, err, _ = launched("ok", "ok", restarts=0, tmp_path=tmp_path)
    assert code == 0
    assert "[w0] hello from ok" in out.splitlines() and "[w1] hello from ok" in out.splitlines()
    assert re.search(r"^\[w1\] started: pid \d+, as ok$", out, re.M)
    assert sorted(err.splitlines()) == ["[w0] note from ok", "[w1] note from ok"]


def test_a_dead_worker_is_restarted(tmp_path):
    code, out, _, starts = launched("ok", "dies-once", restarts=1, tmp_path=tmp_path)
    assert code == 0 and starts == {"ok": 1, "dies-once": 2}
    assert re.search(r"^\[w1\] exited with code 137; restarted \(1 of 1\): pid \d+", out, re.M)


def test_a_killed_workers_trial_is_failed_at_once_and_said(tmp_path):
    deaths = []

    def on_death(pid: int, how: str) -> list[tuple[int, bool]]:
        deaths.append((pid, how))
        return [(7, True)]

    code, out, _, _ = launched("ok", "dies-once", restarts=1, tmp_path=tmp_path,
                               on_death=on_death)
    assert code == 0
    killed = int(re.search(r"^\[w1\] started: pid (\d+)", out, re.M)[1])
    assert deaths == [(killed, "killed by SIGKILL")]  # not the clean exits: they free theirs
    assert ("[w1] killed by SIGKILL; its trial 7 failed and re-queued for the next worker"
            in out.splitlines())


def test_a_storage_error_in_failing_a_dead_workers_trial_leaves_it_to_the_reaper(tmp_path):
    def on_death(pid: int, how: str) -> list[tuple[int, bool]]:
        raise RuntimeError("the database is down")

    code, out, _, starts = launched("fail", "bad", restarts=1, tmp_path=tmp_path,
                                    on_death=on_death)
    assert code == 1 and starts == {"fail": 2, "bad": 1}  # the launcher went on
    assert out.count("[w0] exited with code 1; its running trial, if any, is left to the "
                     "heartbeat reaper (after the grace period): RuntimeError: the database "
                     "is down\n") == 2
    assert "[w1] exited with code 2; its running trial" in out


def test_only_a_worker_that_did_not_free_its_trial_has_it_failed():
    assert [code for code in (0, 1, 2, 130, 137, 139, 143) if left_trials(code)] == [
        1, 2, 137, 139]


def test_the_launchers_reaper_uses_the_workers_study_and_its_pinned_retries(tmp_path):
    from hpo.app.commands import dead_worker_trials
    from hpo.app.preflight import StudyRef
    from hpo.search.liveness import worker_on_this_host

    url = f"sqlite:///{tmp_path / 'hpo.db'}"
    study = optuna.create_study(study_name="demo", storage=url)
    study.set_user_attr("liveness", {"heartbeat_interval": 30, "grace_period": 120,
                                     "max_retry": 1})
    for _ in range(2):
        study.ask().set_user_attr("worker", worker_on_this_host(99))
    on_death = dead_worker_trials(StudyRef(study="demo", storage=url))
    assert on_death(99, "killed by SIGKILL") == [(0, True), (1, True)]
    copy = study.ask()  # the next worker claims the copy, and dies in turn
    assert copy.number == 2
    copy.set_user_attr("worker", worker_on_this_host(100))
    assert on_death(100, "killed by SIGKILL") == [(2, False)]  # max_retry 1: used up
    assert study.get_trials()[0].user_attrs["error"] == (
        f"its worker {worker_on_this_host(99)} killed by SIGKILL")


def test_restarts_are_bounded_and_the_worst_code_is_returned(tmp_path):
    code, out, _, starts = launched("ok", "fail", restarts=2, tmp_path=tmp_path)
    assert code == 1 and starts == {"ok": 1, "fail": 3}
    assert "[w1] exited with code 1; not restarted: it has been restarted 2 time(s)" in out


def test_bad_input_is_not_restarted(tmp_path):
    code, _, _, starts = launched("bad", "ok", restarts=3, tmp_path=tmp_path)
    assert code == 2 and starts == {"bad": 1, "ok": 1}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_reaches_every_worker_once_and_none_is_restarted(tmp_path, signum):
    marks = tmp_path / "marks"
    script = textwrap.dedent(f"""
        import sys
        from hpo.app.launcher import Launcher, WorkerSpec
        child = {CHILD!r}
        specs = [WorkerSpec(f"w{{i}}", {{"ROLE": "waits", "MARKS": {str(marks)!r}}}, "here")
                 for i in range(2)]
        sys.exit(Launcher([sys.executable, "-c", child], restarts=3).supervise(specs))
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    seen: list[str] = []
    for line in parent.stdout:
        seen.append(line)
        if sum("waiting" in s for s in seen) == 2:
            break
    parent.send_signal(signum)
    rest, _ = parent.communicate(timeout=30)
    assert parent.returncode == 128 + signum
    assert f"{signal.Signals(signum).name}: stopping every worker" in rest
    assert "restarted" not in rest
    assert marks.read_text().split() == ["waits", "waits"]


# Real workers: the demo study, on its tiny BERT alone so that trials take seconds, its
# trials counted (`study.budget: trials`) so that a study ends with exactly `n` of them.
TINY_DEMO = ("--set", "search_space.model_name=[data/demo/models/tiny-bert]",
             "--set", "study.budget=trials")


def start_launcher(storage: str, n: int, *extra: str, env: dict | None = None):
    return subprocess.Popen(
        [sys.executable, "-m", "hpo.cli", "run", "--study", "demo", "--storage", storage,
         "--n-trials", str(n), *TINY_DEMO, *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def read_until(process: subprocess.Popen, pattern: str, lines: list[str]) -> re.Match:
    for line in process.stdout:
        lines.append(line)
        found = re.search(pattern, line)
        if found:
            return found
    raise AssertionError(f"no line matched {pattern!r}:\n{''.join(lines)[-3000:]}")


def wait_for(condition, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)


def demo(storage) -> optuna.Study:
    return optuna.load_study(study_name="demo", storage=storage)


def running_on(storage: optuna.storages.RDBStorage, pid: int) -> bool:
    try:
        study = demo(storage)
    except KeyError:
        return False
    return any(t.user_attrs.get("worker", "").endswith(f":{pid}")
               for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)))


def finish(parent: subprocess.Popen, lines: list[str], timeout: float) -> tuple[str, str]:
    try:
        out, err = parent.communicate(timeout=timeout)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    return "".join(lines) + out, err


@pytest.mark.slow
def test_two_workers_keep_the_budget_exact_and_a_killed_one_is_restarted_and_retried(pg_url):
    storage = optuna.storages.RDBStorage(pg_url)
    # A grace period longer than the test: the launcher, not the reaper, frees the slot.
    env = {"HPO_HEARTBEAT_INTERVAL": "1", "HPO_GRACE_PERIOD": "900"}
    parent = start_launcher(pg_url, 6, "--workers", "2", "--set", "training.epochs=6",
                            env=env)
    lines: list[str] = []
    try:
        victim = int(read_until(parent, r"^\[w1\] started: pid (\d+)", lines)[1])
        wait_for(lambda: running_on(storage, victim) or parent.poll() is not None)
        os.kill(victim, signal.SIGKILL)
    finally:
        out, err = finish(parent, lines, 600)
    assert parent.returncode == 0, err[-3000:]
    assert re.search(r"^\[w1\] exited with code 137; restarted \(1 of 3\)", out, re.M), out
    freed = re.search(r"^\[w1\] killed by SIGKILL; its trial (\d+) failed and re-queued for "
                      r"the next worker$", out, re.M)
    assert freed, out
    study = demo(storage)
    counts = Counter(t.state for t in study.trials)
    assert counts[TrialState.COMPLETE] + counts[TrialState.PRUNED] == 6
    assert counts[TrialState.RUNNING] == counts[TrialState.WAITING] == 0
    killed = [t for t in study.trials if t.state == TrialState.FAIL]
    assert len(killed) == 1 and killed[0].user_attrs["worker"].endswith(f":{victim}")
    assert killed[0].number == int(freed[1])
    assert killed[0].user_attrs["error"].endswith(f":{victim} killed by SIGKILL")
    retry = [t for t in study.trials if t.user_attrs.get("retry_of") == killed[0].number]
    assert len(retry) == 1 and retry[0].state in FINISHED
    storage.engine.dispose()


def test_a_signal_is_passed_on_without_waiting_for_the_output_lock():
    """The handler runs in the main thread, perhaps inside say() with the lock held, or while
    a reader holds it blocked on a full pipe (a paused terminal): it must not take the lock,
    or Ctrl-C waits forever. The main loop passes the signal on and announces it once."""
    out = io.StringIO()
    launcher = Launcher([], restarts=0, out=out, err=io.StringIO())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    launcher._children = [_Child(WorkerSpec("w0", {}, "here"), child)]
    try:
        with launcher._lock:
            handler = threading.Thread(target=launcher._forward, args=(signal.SIGTERM, None))
            handler.start()
            handler.join(timeout=10)
            assert not handler.is_alive()
        launcher._pass_on()
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()
    launcher._pass_on()
    assert out.getvalue().count("SIGTERM: stopping every worker") == 1


COUNTS_SIGTERMS = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
print("ready", flush=True)
end = time.monotonic() + 1.5
while time.monotonic() < end:
    time.sleep(0.05)
print(len(got), flush=True)
"""


def test_a_signal_that_comes_while_a_child_starts_reaches_it_once():
    # The handler may run between a child's start and its listing (CI: a worker never
    # signalled slept on); the main loop's pass sends it then, and never twice.
    launcher = Launcher([], restarts=0, out=io.StringIO(), err=io.StringIO())
    launcher._forward(signal.SIGTERM, None)  # before the child is listed
    child = subprocess.Popen([sys.executable, "-c", COUNTS_SIGTERMS], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        launcher._children = [_Child(WorkerSpec("w0", {}, "here"), child)]
        for _ in range(3):
            launcher._pass_on()
        out, _ = child.communicate(timeout=10)
    finally:
        child.kill()
        child.wait()
    assert out.split() == ["1"]


@pytest.mark.slow
def test_ctrl_c_of_the_launcher_frees_every_running_trial(storage):
    rdb = optuna.storages.RDBStorage(storage)
    parent = start_launcher(storage, 50, "--workers", "2", "--set", "training.epochs=100")
    lines: list[str] = []
    try:
        pids = [int(read_until(parent, rf"^\[w{i}\] started: pid (\d+)", lines)[1])
                for i in range(2)]
        wait_for(lambda: all(running_on(rdb, pid) for pid in pids) or parent.poll() is not None)
        parent.send_signal(signal.SIGINT)
    finally:
        out, err = finish(parent, lines, 120)
    assert parent.returncode == 130, err[-3000:]
    assert "SIGINT: stopping every worker" in out
    states = Counter(t.state for t in demo(rdb).trials)
    assert states[TrialState.RUNNING] == 0 and states[TrialState.FAIL] == 2
    assert states[TrialState.WAITING] == 2  # both re-queued for a retry
    rdb.engine.dispose()


def environment_of(pid: int) -> dict[str, str]:
    """The child's own environment, as the kernel holds it once the child has exec'd (until
    then it is the launcher's, without the launcher's mark)."""
    found: dict[str, str] = {}

    def execd() -> bool:
        found.clear()
        found.update(psutil.Process(pid).environ())
        return "HPO_LAUNCHER_PID" in found

    wait_for(execd, seconds=30)
    return found


@pytest.mark.slow
def test_four_mocked_gpus_get_four_workers_each_pinned_to_its_own(storage):
    parent = start_launcher(storage, 4, "--workers", "gpus", env={"HPO_FAULT_GPUS": "4"})
    lines: list[str] = []
    pinned = {}
    try:
        for index in range(4):
            pid = int(read_until(parent, rf"^\[w{index}\] started: pid (\d+), GPU {index} "
                                         rf"\(CUDA_VISIBLE_DEVICES={index}\)", lines)[1])
            pinned[index] = environment_of(pid).get("CUDA_VISIBLE_DEVICES")
    finally:
        out, err = finish(parent, lines, 600)
    assert parent.returncode == 0, err[-3000:]
    assert pinned == {i: str(i) for i in range(4)}
    states = Counter(t.state for t in demo(storage).trials)
    assert states[TrialState.COMPLETE] + states[TrialState.PRUNED] == 4


@pytest.mark.slow
def test_two_workers_share_one_mocked_gpu_each_sized_for_its_half(storage):
    """`--workers gpus:2` on one GPU (mocked: it holds micro-batches of 8, so a half holds 4):
    both workers on GPU 0, each trial sized for and recording its half, and the study's
    batch cache holding the half's limit under the half's key, never the whole card's."""
    parent = start_launcher(storage, 3, "--workers", "gpus:2", "--set",
                            "search_space.target_effective_batch_size=[8]",
                            env={"HPO_FAULT_GPUS": "1", "HPO_FAULT_OOM_ABOVE_BATCH": "8"})
    lines: list[str] = []
    try:
        for index in range(2):
            read_until(parent, rf"^\[w{index}\] started: pid \d+, GPU 0 "
                               rf"\(CUDA_VISIBLE_DEVICES=0\), 1/2 of its memory", lines)
    finally:
        out, err = finish(parent, lines, 600)
    assert parent.returncode == 0, err[-3000:]
    study = demo(storage)
    finished = [t for t in study.trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 3
    assert {t.user_attrs["gpu_share"] for t in finished} == {"1/2"}
    assert {t.user_attrs["physical_batch_size"] for t in finished} <= {1, 2, 3, 4}
    limits = {k: v for k, v in study.user_attrs.items() if k.startswith("batch_limit:")}
    assert limits and all(key.endswith(" 1/2") for key in limits)
    assert {v["largest_ok"] for v in limits.values()} == {4}

