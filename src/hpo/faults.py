"""Fault injection, for tests only: out-of-memory errors on a machine without a GPU.

HPO_FAULT_OOM_ABOVE_BATCH=N   any forward pass on a micro-batch larger than N raises
                              torch.OutOfMemoryError, as a GPU that holds N samples would;
                              N // K for one of K workers sharing it (HPO_WORKERS_PER_GPU),
                              as their allocators' caps make it.
HPO_FAULT_OOM_AT_STEP=K       the K-th optimizer step of each trial's training raises
                              torch.OutOfMemoryError once.
HPO_FAULT_KILL_ABOVE_BATCH=N  any forward pass on a micro-batch larger than N kills its process
                              with SIGKILL, as the kernel's OOM killer does when the host's
                              memory runs out.
HPO_FAULT_NAN_LOSS=MODEL|PRECISION
                              the model whose name ends with MODEL, run in PRECISION (fp16,
                              bf16, none), predicts NaN: its loss is not finite, as DeBERTa's
                              can be in fp16.
HPO_FAULT_KILL_AT=POINT       the worker kills itself with SIGKILL (an eviction, the OOM killer)
                              at POINT of its first trial: `claim` (holding the study lock,
                              just after claiming), `heartbeat` (before the trial's first
                              heartbeat), `train` (at the second optimizer step), `tell` (with
                              the result, just before telling the study), `resume` (in a
                              paused trial resumed, from its checkpoint or trained again from
                              its start, at its first optimizer step).
HPO_FAULT_COMPILE=forward|backward
                              torch.compile's compiler fails on the model's forward graph, or
                              on its backward graph (which torch compiles at the first
                              backward pass), as it can on a model it does not support.
HPO_FAULT_GPUS=N              the host shows N GPUs to `hpo run --workers`, which pins one
                              worker to each (CUDA_VISIBLE_DEVICES=0 ... N-1); on a machine
                              without a GPU the workers then train on the CPU.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpo.errors import FaultConfigError

if TYPE_CHECKING:
    import torch

OOM_ABOVE_BATCH = "HPO_FAULT_OOM_ABOVE_BATCH"
OOM_AT_STEP = "HPO_FAULT_OOM_AT_STEP"
KILL_ABOVE_BATCH = "HPO_FAULT_KILL_ABOVE_BATCH"
KILL_AT = "HPO_FAULT_KILL_AT"
NAN_LOSS = "HPO_FAULT_NAN_LOSS"
COMPILE = "HPO_FAULT_COMPILE"
GPUS = "HPO_FAULT_GPUS"
KILL_POINTS = ("claim", "heartbeat", "train", "tell", "resume")
COMPILE_GRAPHS = ("forward", "backward")


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise FaultConfigError(f"{name} must be an integer, got {value!r}") from None


def validate_environment() -> None:
    """Fail early on a malformed fault variable rather than in the middle of a trial."""
    _int_env(OOM_ABOVE_BATCH)
    _int_env(OOM_AT_STEP)
    _int_env(KILL_ABOVE_BATCH)
    _int_env(GPUS)
    nan_loss = os.environ.get(NAN_LOSS, "").strip()
    if nan_loss and (nan_loss.count("|") != 1 or nan_loss.rsplit("|", 1)[1] not in
                     ("fp16", "bf16", "none")):
        raise FaultConfigError(f"{NAN_LOSS} must be MODEL|PRECISION (fp16, bf16 or none), "
                               f"got {nan_loss!r}")
    point = os.environ.get(KILL_AT, "").strip()
    if point and point not in KILL_POINTS:
        raise FaultConfigError(f"{KILL_AT} must be one of {', '.join(KILL_POINTS)}, "
                               f"got {point!r}")
    graph = os.environ.get(COMPILE, "").strip()
    if graph and graph not in COMPILE_GRAPHS:
        raise FaultConfigError(f"{COMPILE} must be one of {', '.join(COMPILE_GRAPHS)}, "
                               f"got {graph!r}")


def gpu_count() -> int | None:
    """The number of GPUs HPO_FAULT_GPUS says the host shows, if it is set."""
    return _int_env(GPUS)


def kill_at(point: str) -> None:
    """Die here, as a process the OOM killer or an eviction ends, if HPO_FAULT_KILL_AT says
    so: no handler, no `finally`, no goodbye to the database."""
    if os.environ.get(KILL_AT, "").strip() == point:
        os.kill(os.getpid(), signal.SIGKILL)


def compile_backend():
    """torch.compile's default backend, or one whose compiler fails on the graph that
    HPO_FAULT_COMPILE names."""
    graph = os.environ.get(COMPILE, "").strip()
    if not graph:
        return "inductor"
    # torch's documented way to write an autograd-aware backend (torch.compiler's "custom
    # backends" page), from a private module: test_train's compile-failure tests fail if it moves.
    from torch._dynamo.backends.common import aot_autograd

    def compiler(failing: str) -> Callable[..., Any]:
        def compile_graph(graph_module, _example_inputs):
            if failing == graph:
                raise RuntimeError(f"injected: {COMPILE}={graph} (the compiler failed)")
            return graph_module.forward
        return compile_graph

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"))


def install(model: torch.nn.Module, sharing: int = 1) -> None:
    """Make `model` fail like a GPU of limited memory when HPO_FAULT_OOM_ABOVE_BATCH is set
    (a 1/`sharing` share of it where `sharing` workers share it), die like a process the OOM
    killer chose when HPO_FAULT_KILL_ABOVE_BATCH is, or predict NaN when HPO_FAULT_NAN_LOSS
    names it."""
    limit, kill_above = _int_env(OOM_ABOVE_BATCH), _int_env(KILL_ABOVE_BATCH)
    if limit is not None:
        limit //= sharing
    if limit is not None or kill_above is not None:
        _install_batch_faults(model, limit, kill_above)
    nan_loss = os.environ.get(NAN_LOSS, "").strip()
    if nan_loss:
        name, precision = nan_loss.rsplit("|", 1)
        # A transformers config (hpo.training.models.config_of, a layer above, types it).
        config: Any = model.config
        if str(config.name_or_path).endswith(name):
            _install_nan(model, precision)


def _install_batch_faults(model: torch.nn.Module, limit: int | None,
                          kill_above: int | None) -> None:
    # torch is imported where faults fire, so the CLI checks the variables before loading it.
    import torch

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            return
        if kill_above is not None and inputs.shape[0] > kill_above:
            os.kill(os.getpid(), signal.SIGKILL)
        if limit is not None and inputs.shape[0] > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (injected: micro-batch {inputs.shape[0]} > "
                f"{OOM_ABOVE_BATCH}={limit})"
            )

    model.register_forward_pre_hook(hook, with_kwargs=True)


def _install_nan(model: torch.nn.Module, precision: str) -> None:
    import torch

    dtypes = {torch.float16: "fp16", torch.bfloat16: "bf16"}

    def hook(module: torch.nn.Module, _args: tuple, output: Any) -> Any:
        device = next(module.parameters()).device.type
        running = (dtypes.get(torch.get_autocast_dtype(device), "none")
                   if torch.is_autocast_enabled(device) else "none")
        if running == precision:
            output.logits = output.logits * float("nan")
        return output

    model.register_forward_hook(hook)


def before_optimizer_step(step: int, resumed: bool = False) -> None:
    """Raise once at the configured optimizer step (1-based, counted per trial); die at the
    second with HPO_FAULT_KILL_AT=train, at a resumed run's first (`resumed`) with
    HPO_FAULT_KILL_AT=resume."""
    if step == 2:
        kill_at("train")
    if resumed:
        kill_at("resume")
    if step == _int_env(OOM_AT_STEP):
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory (injected: {OOM_AT_STEP}={step})")
