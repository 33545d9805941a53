"""`hpo run --workers N|gpus|gpus:K`: one command that starts N workers on this host, or one
per visible GPU, or K per GPU, each an ordinary `hpo run` process that joins the study.

The rule: the launcher supervises and never trains. It creates the study once, check
included, in a child of its own; then it starts the workers, each pinned to its own GPU
(`CUDA_VISIBLE_DEVICES`) or, on a CPU, given an equal share of the cores. It prefixes every
line a worker prints with the worker's name. It passes Ctrl-C and SIGTERM on to every worker
once, and each frees its running trial for a retry as a lone worker does. It starts a worker
that died again, up to `restarts` times per worker, but not one that exited 0 (the study
has its budget) or 2 (bad input, which a restart would repeat). A worker that died without
freeing its trial (killed, an error) has it failed and re-queued at once (`on_death`), not
after the heartbeat grace period. It exits with the workers' worst code (`worst`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from hpo.errors import one_line, process_end

# Set in each worker's environment: the worker follows the launcher's death (cli.main).
PARENT_VARIABLE = "HPO_LAUNCHER_PID"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_PR_SET_PDEATHSIG = 1
_POLL_SECONDS = 0.2

# Fails the running trials of a worker that died, given its pid and how it ended ("killed by
# SIGKILL"), and queues their retries: each trial's number and whether its retry was queued.
# Built where the storage is known (commands.dead_worker_trials); it raises what that raised.
OnDeath = Callable[[int, str], Sequence[tuple[int, bool]]]


class LaunchError(ValueError):
    """A worker count this host cannot run; the message says what to run instead."""


@dataclass(frozen=True)
class WorkerSpec:
    name: str  # the prefix of its lines: w0, w1, ...
    env: Mapping[str, str]  # the variables set for it on top of the launcher's own
    place: str  # where it runs, in words: "GPU 3 (CUDA_VISIBLE_DEVICES=3)", "1 of 2 cores"


def plan(count: int | None, gpus: Sequence[str], cores: int,
         environ: Mapping[str, str], *, per_gpu: int = 1) -> list[WorkerSpec]:
    """The workers to start: `count` of them, or `per_gpu` per GPU where `count` is None
    (`--workers gpus` or `gpus:K`). `gpus` are the visible GPUs as CUDA_VISIBLE_DEVICES
    names them. Workers sharing a GPU are told so (HPO_WORKERS_PER_GPU): each sizes its
    batches for its share of the memory, and its allocator is capped there."""
    from hpo.hardware import WORKERS_PER_GPU

    if count is None:
        if not gpus:
            raise LaunchError(f"--workers {_gpus_words(per_gpu)}: no GPU is visible on this "
                              f"host; to run workers on the CPU, give their number: "
                              f"--workers 2")
        count = len(gpus) * per_gpu
    if gpus and count > len(gpus) * per_gpu:
        raise LaunchError(f"--workers {count}: this host shows {len(gpus)} GPU(s), and a "
                          f"worker needs a GPU of its own (its batch search measures the "
                          f"whole device); use --workers gpus or at most {len(gpus)}, or "
                          f"--workers gpus:K for K workers per GPU, each with 1/K of its "
                          f"memory")
    # Each worker's torch threads get an equal share of the cores, unless the user set them.
    threads = str(max(1, cores // count))
    shared = {name: threads for name in THREAD_VARIABLES if name not in environ}
    given = ", ".join(f"{name}={environ[name]}" for name in THREAD_VARIABLES if name in environ)
    share = f"{threads} of {cores} cores" if shared else f"threads as set: {given}"
    specs = []
    for index in range(count):
        env = dict(shared)
        place = share
        if gpus:
            gpu = gpus[index // per_gpu]
            env["CUDA_VISIBLE_DEVICES"] = gpu
            shared_by = f", 1/{per_gpu} of its memory" if per_gpu > 1 else ""
            place = f"GPU {gpu} (CUDA_VISIBLE_DEVICES={gpu}){shared_by}, {share}"
        if per_gpu > 1:
            env[WORKERS_PER_GPU] = str(per_gpu)
        specs.append(WorkerSpec(f"w{index}", env, place))
    return specs


def _gpus_words(per_gpu: int) -> str:
    return "gpus" if per_gpu == 1 else f"gpus:{per_gpu}"


# Exit codes from least to most severe; a code not listed (1, a signal's) is the most.
_SEVERITY = {0: 0, 128 + signal.SIGINT: 1, 128 + signal.SIGTERM: 2, 2: 3}


def exit_code(returncode: int) -> int:
    """A child's return code as a shell reports it: killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def worst(codes: Sequence[int]) -> int:
    """The workers' worst exit code: an unexpected error or a death (1, 137) over bad input
    (2) over SIGTERM (143) over Ctrl-C (130) over done (0)."""
    return max(codes, key=lambda code: (_SEVERITY.get(code, len(_SEVERITY)), code), default=0)


def left_trials(code: int) -> bool:
    """Whether a worker that exited with `code` may have left its trial RUNNING: not when it
    ended cleanly (0), nor on Ctrl-C or SIGTERM, where it frees its trial itself."""
    return code not in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM)


def told(failed: Sequence[tuple[int, bool]]) -> str:
    """What became of a dead worker's trials, as `OnDeath` returned them."""
    return "; ".join(f"its trial {number} failed and re-queued for the next worker" if queued
                     else f"its trial {number} failed; its retries are used up"
                     for number, queued in failed)


def restartable(code: int) -> bool:
    """Whether a worker that exited with `code`, unasked, is started again: not once the
    study has its budget (0), nor after bad input (2), which a restart would repeat."""
    return code not in (0, 2)


@dataclass
class _Child:
    spec: WorkerSpec
    process: subprocess.Popen[str]
    restarts: int = 0
    passed_on: int = 0  # how many of the launcher's received signals it was sent


class Launcher:
    """Starts children, copies their lines with a prefix, forwards signals, restarts the
    dead. `command` is the argv of one worker; `out` and `err` receive the lines."""

    def __init__(self, command: Sequence[str], *, restarts: int, out: IO[str] = sys.stdout,
                 err: IO[str] = sys.stderr, on_death: OnDeath | None = None) -> None:
        self.command = list(command)
        self.restarts = restarts
        self.on_death = on_death
        self.out, self.err = out, err
        self.stopping: int | None = None  # the signal that stops the workers
        self._received: list[int] = []  # every stopping signal, in order
        self._announced = False
        self._children: list[_Child] = []
        self._readers: list[threading.Thread] = []
        self._mourners: list[threading.Thread] = []
        self._lock = threading.Lock()

    def say(self, text: str, prefix: str = "hpo") -> None:
        with self._lock:
            print(f"[{prefix}] {text}", file=self.out, flush=True)

    def _copy(self, stream: IO[str], prefix: str, sink: IO[str]) -> None:
        for line in stream:
            text = line.rstrip("\n")
            with self._lock:
                sink.write(f"[{prefix}] {text}\n")
                sink.flush()
        stream.close()

    def _start(self, spec: WorkerSpec, command: Sequence[str]) -> subprocess.Popen[str]:
        env = {**os.environ, **spec.env, PARENT_VARIABLE: str(os.getpid()),
               "PYTHONUNBUFFERED": "1"}
        # A session of its own: a terminal's Ctrl-C reaches the launcher alone, which passes
        # it on once, instead of every worker seeing it twice.
        process = subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        readers = [threading.Thread(target=self._copy, args=(stream, spec.name, sink),
                                    daemon=True)
                   for stream, sink in ((process.stdout, self.out), (process.stderr, self.err))]
        for reader in readers:
            reader.start()
        self._readers.extend(readers)
        return process

    def _forward(self, signum: int, frame: object) -> None:
        # A handler runs in the main thread between two of its bytecodes: perhaps inside
        # say() with the lock held, or while a reader holds it blocked on a full pipe, or
        # between starting a child and listing it. It only records the signal; the main
        # loop passes it on (_pass_on), to every child, listed or not yet, once.
        if self.stopping is None:
            self.stopping = signum
        self._received.append(signum)

    def _pass_on(self) -> None:
        """Sends each child the signals received since it was last sent any, and says once
        that a signal is stopping the workers. Main loop only."""
        received = len(self._received)
        for child in self._children:
            for signum in self._received[child.passed_on:received]:
                if child.process.poll() is None:
                    child.process.send_signal(signum)
            child.passed_on = received
        if self.stopping is not None and not self._announced:
            self._announced = True
            self.say(f"{signal.Signals(self.stopping).name}: stopping every worker; each "
                     f"frees its running trial for a retry")

    def run_once(self, spec: WorkerSpec, command: Sequence[str]) -> int:
        """One child to its end (the study's creation): its exit code."""
        with self._signals():
            child = _Child(spec, self._start(spec, command))
            self._children = [child]
            while child.process.poll() is None:
                self._pass_on()
                time.sleep(_POLL_SECONDS)
            self._pass_on()
            code = exit_code(child.process.returncode)
        self._join()
        return code

    def supervise(self, specs: Sequence[WorkerSpec]) -> int:
        """Every worker to its end, restarting the dead: the worst exit code."""
        codes: dict[str, int] = {}
        with self._signals():
            for spec in specs:
                child = _Child(spec, self._start(spec, self.command))
                self._children.append(child)
                self.say(f"started: pid {child.process.pid}, {spec.place}", spec.name)
                self._pass_on()
            while len(codes) < len(specs):
                time.sleep(_POLL_SECONDS)
                self._pass_on()
                for child in self._children:
                    if child.spec.name in codes or child.process.poll() is None:
                        continue
                    code = exit_code(child.process.returncode)
                    self._mourn(child)
                    if self._restart(child, code):
                        continue
                    codes[child.spec.name] = code
            for mourner in self._mourners:
                mourner.join()
            self._pass_on()
        self._join()
        return worst(list(codes.values()))

    def _mourn(self, child: _Child) -> None:
        """Fail the trials a dead worker left RUNNING, in a thread of its own: the storage
        may be slow, or out, and the loop goes on passing signals and restarting workers."""
        returncode = child.process.returncode
        if self.on_death is None or not left_trials(exit_code(returncode)):
            return
        mourner = threading.Thread(
            target=self._fail_trials,
            args=(child.spec.name, child.process.pid, process_end(returncode), self.on_death),
            name=f"mourn-{child.process.pid}", daemon=True)
        mourner.start()
        self._mourners.append(mourner)

    def _fail_trials(self, name: str, pid: int, how: str, on_death: OnDeath) -> None:
        try:
            failed = on_death(pid, how)
        except Exception as exc:
            # The launcher outlives its storage's errors: the heartbeat reaper remains.
            self.say(f"{how}; its running trial, if any, is left to the heartbeat reaper "
                     f"(after the grace period): {one_line(exc)}", name)
            return
        if failed:
            self.say(f"{how}; {told(failed)}", name)

    def _restart(self, child: _Child, code: int) -> bool:
        name = child.spec.name
        if self.stopping is not None or not restartable(code):
            if code not in (0, 128 + signal.SIGINT, 128 + signal.SIGTERM):
                self.say(f"exited with code {code}", name)
            return False
        if child.restarts >= self.restarts:
            self.say(f"exited with code {code}; not restarted: it has been restarted "
                     f"{child.restarts} time(s), the bound (--restarts)", name)
            return False
        child.restarts += 1
        child.process = self._start(child.spec, self.command)
        self.say(f"exited with code {code}; restarted ({child.restarts} of {self.restarts}): "
                 f"pid {child.process.pid}, {child.spec.place}", name)
        return True

    def _join(self) -> None:
        for reader in self._readers:
            reader.join()
        self._readers.clear()

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Ctrl-C and SIGTERM forwarded while the block runs (main thread only)."""
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {s: signal.signal(s, self._forward)
                        for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


def follow_parent() -> None:
    """In a worker the launcher started: receive SIGTERM when the launcher dies, so a killed
    launcher leaves no worker behind (each frees its trial on SIGTERM)."""
    parent = os.environ.get(PARENT_VARIABLE)
    if not parent or not parent.isdigit():
        return
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def launch(count: int | None, worker_command: Sequence[str], create_command: Sequence[str],
           *, restarts: int, on_death: OnDeath | None = None, per_gpu: int = 1) -> int:
    """Create the study once, then run `count` workers (`per_gpu` per GPU where None) to
    their end: the worst exit code. `on_death` fails the trials a dead worker left running.
    Raises LaunchError for a count this host cannot run. The creation's check runs under
    the workers' share of a GPU, so its verdicts are the ones they look up."""
    from hpo.hardware import visible_gpus  # torch: only once the command line is sound

    specs = plan(count, visible_gpus(), cores(), os.environ, per_gpu=per_gpu)
    launcher = Launcher(worker_command, restarts=restarts, on_death=on_death)
    # The study's creation and check run alone, on the first worker's GPU and every core.
    alone = {k: v for k, v in specs[0].env.items() if k not in THREAD_VARIABLES}
    code = launcher.run_once(WorkerSpec("create", alone, specs[0].place), create_command)
    if code != 0 or launcher.stopping is not None:
        return code
    launcher.say(f"starting {len(specs)} worker(s); each line is prefixed with its worker")
    return launcher.supervise(specs)
