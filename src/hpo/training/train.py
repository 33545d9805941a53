"""Train and evaluate one configuration: autocast, GradScaler for fp16, fused AdamW, exact
gradient accumulation, clipping, per-epoch evaluation.

The accumulated gradient of a step equals the gradient of one big batch: each micro-batch's
summed per-sample loss is divided by the step's sample count, not by its own size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import get_linear_schedule_with_warmup

from hpo import faults
from hpo.data.batching import Collator, Encoded, PlannedBatches, eval_batches, training_steps
from hpo.errors import one_line
from hpo.hardware import Device, autocast_dtype, fused_adamw, loader_settings, peak_flops
from hpo.training import memory
from hpo.training.flops import ModelFlops, model_flops
from hpo.training.models import config_of


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass(frozen=True)
class Plan:
    """Everything a run needs besides the model and data; derived once per trial."""

    precision: str
    effective_batch: int
    physical_batch: int
    eval_batch: int
    learning_rate: float
    weight_decay: float
    warmup_ratio: float
    max_grad_norm: float
    epochs: int
    seed: int
    gradient_checkpointing: bool = False
    compile: bool = False
    # Validation scores per epoch, evenly spaced over its optimizer steps (the last at its end).
    evaluations_per_epoch: int = 1
    # Training ends after this many evaluations, its schedule with it (hpo final's refit to
    # the evaluation a trial's value came from); None: after every epoch's.
    stop_after: int | None = None
    # The loss's positive weight per label (`training.pos_weight`): balanced, or none.
    pos_weight: str = "none"

    @property
    def grad_accum_steps(self) -> int:
        return math.ceil(self.effective_batch / self.physical_batch)

    @property
    def evaluations(self) -> int:
        """The evaluations a run makes: the steps it reports to the pruner."""
        return self.stop_after or self.epochs * self.evaluations_per_epoch


def as_epochs(evaluation: int, per_epoch: int) -> int | float:
    """An evaluation's 1-based index in epochs: whole where it ends an epoch (always with one
    evaluation per epoch), else a fraction (1.5: the middle of the second epoch)."""
    whole, part = divmod(evaluation, per_epoch)
    return whole if part == 0 else round(evaluation / per_epoch, 3)


def evaluation_points(steps_per_epoch: int, per_epoch: int) -> list[int]:
    """After which optimizer step of an epoch (1-based) each of its `per_epoch` evaluations
    comes: evenly spaced, the last at the epoch's end. An epoch of fewer steps than
    evaluations scores some points twice in name only: one evaluation serves them all."""
    return [math.ceil(k * steps_per_epoch / per_epoch) for k in range(1, per_epoch + 1)]


@dataclass
class Progress:
    """Running counters of a training run, read by the progress display and the trial."""

    epoch: int = 0
    step: int = 0
    steps_per_epoch: int = 0
    samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    step_seconds: float = 0.0
    eval_seconds: float = 0.0
    # fp16's GradScaler scale after the last epoch (None without a scaler): it starts at 2**16
    # and halves on every step whose gradients overflowed, so a scale that fell far says the
    # run skipped steps.
    grad_scale: float | None = None
    # Each finished epoch's seconds, its steps and its evaluation: what a replay of the
    # search in simulated time looks up (benchmarks/learning_curves.py).
    epoch_seconds: list[float] = field(default_factory=list)
    # The model's training FLOPs so far (hpo.training.flops) and the device's peak in the trial's
    # precision, where known: the model-FLOPs utilisation.
    model_flops: float = 0.0
    peak_flops: float | None = None

    def count(self, mask: torch.Tensor, flops: ModelFlops) -> None:
        """A micro-batch's tokens and FLOPs, from its mask's host copy: on a GPU, reading
        the device copy would sync."""
        lengths = mask.sum(dim=1)
        self.real_tokens += int(lengths.sum())
        self.padded_tokens += mask.numel()
        self.model_flops += flops.sequences(lengths)

    @property
    def flops_per_second(self) -> float:
        return self.model_flops / self.step_seconds if self.step_seconds else 0.0

    @property
    def mfu(self) -> float | None:
        return self.flops_per_second / self.peak_flops if self.peak_flops else None

    @property
    def train_seconds(self) -> float:
        return self.step_seconds + self.eval_seconds

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.step_seconds if self.step_seconds else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0


def autocast(device: Device, precision: str) -> contextlib.AbstractContextManager:
    dtype = autocast_dtype(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def prepare(model: torch.nn.Module, plan: Plan, device: Device) -> torch.nn.Module:
    model.to(device.torch_device)
    faults.install(model, device.sharing)
    if plan.gradient_checkpointing:
        # transformers 5 renamed it; older releases only know the first name. (Any: torch
        # types a module's attributes, this transformers method too, as tensors or modules.)
        enable: Any = getattr(model, "activation_checkpointing_enable", None) or (
            model.gradient_checkpointing_enable)
        enable()
    model.train()
    if plan.compile:
        return compiled(model, plan, device)
    return model


class CompiledOrEager(torch.nn.Module):
    """A model run through `torch.compile` until the compiler fails on it, eagerly from then
    on (`failure` says why): a model the compiler cannot handle trains slower rather than
    failing its trial. Out-of-memory errors pass through, as from the eager model."""

    def __init__(self, model: torch.nn.Module, backend: Callable | str) -> None:
        super().__init__()
        self.eager = model
        self.config = config_of(model)
        import torch._dynamo  # forward sets one of its settings; torch.compile loads it anyway

        self.compiled = torch.compile(model, dynamic=True, backend=backend)
        self.failure: str | None = None

    def forward(self, **inputs: torch.Tensor) -> Any:
        if self.failure is None:
            try:
                # Past its recompile limit torch runs a graph eagerly from then on without a
                # word, and the trial would record itself compiled; raised instead, it says
                # why it trains without the compiler. A private module's documented setting:
                # test_train's recompile-limit test fails if it goes.
                with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                    return self.compiled(**inputs)
            except Exception as exc:
                if memory.is_oom(exc):
                    raise
                self.fail(exc)
        # Outside the except block: the failed attempt's tensors are gone with its traceback.
        return self.eager(**inputs)

    def fail(self, exc: BaseException) -> None:
        self.failure = one_line(exc)


def compiled(model: torch.nn.Module, plan: Plan, device: Device) -> CompiledOrEager:
    """`model` compiled, its compilation done now on small batches in both the ways a trial
    runs it (a training step, forward and backward, and an evaluation): torch compiles the
    backward lazily, at the first backward pass, where no forward call could catch its
    failure. Dynamic shapes specialise a batch of one sample (its own graphs, backward
    included), so a plan whose training runs micro-batches of one compiles those now too."""
    wrapped = CompiledOrEager(model, faults.compile_backend())
    generator = torch.Generator().manual_seed(0)
    batches = [2] + ([1] if 1 in micro_batch_sizes(plan) else [])
    try:
        for batch in batches:
            shape = (batch, 8)
            inputs = {
                "input_ids": torch.randint(0, config_of(model).vocab_size, shape,
                                           generator=generator),
                "attention_mask": torch.ones(shape, dtype=torch.long),
            }
            inputs = {k: v.to(device.torch_device) for k, v in inputs.items()}
            wrapped.train()
            with autocast(device, plan.precision):
                logits = wrapped(**inputs).logits
            logits.float().sum().backward()
            with torch.inference_mode(), autocast(device, plan.precision):
                wrapped.eval()
                wrapped(**inputs)
    except Exception as exc:
        if memory.is_oom(exc) or wrapped.failure is not None:
            raise
        wrapped.fail(exc)
    model.zero_grad(set_to_none=True)
    wrapped.train()
    return wrapped


def micro_batch_sizes(plan: Plan) -> set[int]:
    """The micro-batch sizes training runs: the physical batch, and what is left of an
    optimizer step after whole physical batches."""
    rest = plan.effective_batch % plan.physical_batch
    return {plan.physical_batch} | ({rest} if rest else set())


def make_optimizer(model: torch.nn.Module, plan: Plan, device: Device) -> torch.optim.AdamW:
    # Biases and normalisation weights are not decayed, as in BERT's recipe.
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": plan.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # Fused kernels, one launch per step for every parameter, where torch has them for the
    # device; its default (foreach, else a loop over parameters) where it has not.
    fused = fused_adamw(device.type) or None
    return torch.optim.AdamW(groups, lr=plan.learning_rate, fused=fused)


def balanced_pos_weight(labels: torch.Tensor) -> torch.Tensor:
    """negatives / positives per label; 1 for a label with no positives or no negatives."""
    positives = labels.sum(0)
    negatives = labels.shape[0] - positives
    weight = negatives / positives.clamp(min=1)
    return torch.where((positives > 0) & (negatives > 0), weight, torch.ones_like(weight))


def loss_pos_weight(setting: str, labels: torch.Tensor) -> torch.Tensor | None:
    """The loss's per-label positive weight for `training.pos_weight`: balanced, or none."""
    return balanced_pos_weight(labels) if setting == "balanced" else None


def micro_batch_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    step_samples: int,
    pos_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    labels = batch.pop("labels")
    logits = model(**batch).logits.float()
    per_sample = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, labels, reduction="none", pos_weight=pos_weight
    ).mean(dim=1)
    return per_sample.sum() / step_samples


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    max_grad_norm: float,
) -> None:
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Stepper:
    """The optimizer and the gradient scaler (enabled for fp16 only) a model's steps share."""

    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler

    @classmethod
    def fresh(cls, model: torch.nn.Module, plan: Plan, device: Device) -> Stepper:
        return cls(make_optimizer(model, plan, device),
                   torch.amp.GradScaler(device.type, enabled=plan.precision == "fp16"))

    def step(self, model: torch.nn.Module, max_grad_norm: float) -> None:
        optimizer_step(model, self.optimizer, self.scaler, max_grad_norm)


def probe_step(model: torch.nn.Module, plan: Plan, device: Device, batch: int, length: int,
               stepper: Stepper | None = None) -> float:
    """One full training step (forward, backward, optimizer step) on `batch` sequences of
    `length` tokens drawn from the model's vocabulary: the memory a real step of that size
    needs, optimizer state included. A fresh optimizer and scaler unless `stepper` holds
    them. Returns the step's loss."""
    stepper = stepper or Stepper.fresh(model, plan, device)
    generator = torch.Generator().manual_seed(0)
    config = config_of(model)
    labels = config.num_labels
    assert labels is not None  # a classifier's config has its labels
    inputs = {
        "input_ids": torch.randint(0, config.vocab_size, (batch, length), generator=generator),
        "attention_mask": torch.ones((batch, length), dtype=torch.long),
        "labels": torch.zeros((batch, labels)),
    }
    inputs = {k: v.to(device.torch_device) for k, v in inputs.items()}
    with autocast(device, plan.precision):
        loss = micro_batch_loss(model, inputs, batch)
    stepper.scaler.scale(loss).backward()
    stepper.step(model, plan.max_grad_norm)
    _synchronize(device)
    return float(loss.detach())


def _synchronize(device: Device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device.torch_device)


def _loader(data: Encoded, pad_id: int, device: Device,
            sampler: PlannedBatches) -> torch.utils.data.DataLoader[int]:
    settings = loader_settings(device)
    return torch.utils.data.DataLoader(
        range(len(data)),  # type: ignore[arg-type]  # any sequence is a map-style dataset
        batch_sampler=sampler,
        collate_fn=Collator(data, pad_id),
        num_workers=settings.num_workers,
        pin_memory=settings.pin_memory,
        persistent_workers=settings.persistent_workers,
        prefetch_factor=settings.prefetch_factor,
    )


def _ignored(*_: object) -> None:
    return None


class PauseHere(Exception):
    """Raised by `Hooks.on_evaluation` to pause the run after that evaluation: `train` answers
    with `Paused`, which holds where the run stands."""


@dataclass(frozen=True)
class TrainState:
    """Where a run stands after an evaluation: enough for `train` to go on from there as if
    it had never stopped (no step repeated or skipped, the same schedule, the same data order
    and random draws). The tensors are the live ones, not copies: save them before the model
    trains on."""

    evaluations: int
    optimizer_steps: int
    epoch: int  # the epoch it stopped in (1-based)
    step: int  # that epoch's optimizer steps done
    physical_batch: int  # the micro-batch it ran: the epoch's samples are laid out by it
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    rng: dict[str, torch.Tensor]
    progress: Progress


class Paused(Exception):
    """A run paused after an evaluation (`PauseHere`): `state` says where it stands."""

    def __init__(self, state: TrainState) -> None:
        super().__init__(f"paused after evaluation {state.evaluations}")
        self.state = state


def rng_state(device: Device) -> dict[str, torch.Tensor]:
    """The random state dropout draws from: the host's generator, and the device's own."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device.torch_device)
    return state


def set_rng_state(device: Device, state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device.torch_device)


@dataclass(frozen=True)
class Hooks:
    """What a training run calls out to: `evaluate` scores the model at each evaluation
    point (`evaluation_points`), `on_evaluation` hears its 1-based index and the score (and
    may raise optuna.TrialPruned to stop, or `PauseHere` to pause), `on_step` hears the
    progress after each step; a run that `resume`s a paused one goes on from its state."""

    evaluate: Callable[[torch.nn.Module], float]
    on_evaluation: Callable[[int, float], None] = _ignored
    on_step: Callable[[Progress], None] = _ignored
    # Where the run starts: from scratch, or where the paused run it resumes stood.
    resume: TrainState | None = None


@dataclass
class _Position:
    """Where a run stands: the epoch it is in (1-based), that epoch's optimizer steps done,
    and the run's optimizer steps and evaluations."""

    epoch: int = 1
    step: int = 0
    optimizer_steps: int = 0
    evaluations: int = 0


@dataclass(frozen=True)
class _Run:
    model: torch.nn.Module
    plan: Plan
    device: Device
    stepper: Stepper
    scheduler: torch.optim.lr_scheduler.LRScheduler
    progress: Progress

    def state(self, at: _Position) -> TrainState:
        # An epoch's end is the next one's start: resumed there, no epoch is begun twice.
        epoch, step = ((at.epoch + 1, 0) if at.step == self.progress.steps_per_epoch
                       else (at.epoch, at.step))
        return TrainState(
            at.evaluations, at.optimizer_steps, epoch, step, self.plan.physical_batch,
            self.model.state_dict(),
            self.stepper.optimizer.state_dict(), self.scheduler.state_dict(),
            self.stepper.scaler.state_dict(), rng_state(self.device), self.progress)

    def restore(self, state: TrainState) -> _Position:
        """The run put where `state` stood: weights, optimizer, schedule, scaler and
        counters (the model's weights first, as the optimizer's state is keyed by its
        parameters; the device's peak is this device's); the random state is the loop's to
        put back, where the run stood. The state's weights and moments are let go once
        loaded, so the run does not hold a second copy of the model."""
        self.model.load_state_dict(state.model)
        self.stepper.optimizer.load_state_dict(state.optimizer)
        self.scheduler.load_state_dict(state.scheduler)
        self.stepper.scaler.load_state_dict(state.scaler)
        state.model.clear()
        state.optimizer.clear()
        for name, value in dataclasses.asdict(state.progress).items():
            if name not in ("peak_flops", "steps_per_epoch"):
                setattr(self.progress, name, value)
        return _Position(state.epoch, state.step, state.optimizer_steps, state.evaluations)


def train(model: torch.nn.Module, train_data: Encoded, plan: Plan, device: Device, *,
          pad_id: int, hooks: Hooks) -> Progress:
    """Train for `plan.epochs` (or up to its `stop_after`-th evaluation), evaluating and
    reporting through `hooks`; from where a paused run stood, if it resumes one
    (`hooks.resume`). A hook that raises `PauseHere` ends it with `Paused`."""
    resume = hooks.resume
    torch.manual_seed(plan.seed)
    stepper = Stepper.fresh(model, plan, device)
    lengths = train_data.lengths
    steps_per_epoch = _steps_per_epoch(len(lengths), plan)
    points = evaluation_points(steps_per_epoch, plan.evaluations_per_epoch)
    last, into = divmod(plan.evaluations - 1, plan.evaluations_per_epoch)
    total_steps = steps_per_epoch * last + points[into]
    scheduler = get_linear_schedule_with_warmup(
        stepper.optimizer, round(plan.warmup_ratio * total_steps), total_steps
    )
    progress = Progress(steps_per_epoch=steps_per_epoch,
                        peak_flops=peak_flops(device, plan.precision))
    run = _Run(model, plan, device, stepper, scheduler, progress)
    at = run.restore(resume) if resume is not None else _Position()
    sampler = PlannedBatches()
    loader = _loader(train_data, pad_id, device, sampler)
    flops = model_flops(model)
    pos_weight = loss_pos_weight(plan.pos_weight, train_data.labels)
    if pos_weight is not None:
        pos_weight = pos_weight.to(device.torch_device)
    for epoch in range(at.epoch, last + 2):
        done = at.step if epoch == at.epoch else 0
        at.epoch, at.step = epoch, done
        progress.epoch, progress.step = epoch, done
        steps = _epoch_steps(lengths, plan, epoch, resume if done else None)[done:]
        sampler.batches = [micro for step in steps for micro in step]
        # The random state goes back where the paused run drew next. A loader draws a seed
        # as an epoch starts: every epoch's, or (persistent workers) only its first.
        rng = resume.rng if resume is not None and epoch == resume.epoch else None
        before = not done and not (loader.persistent_workers and loader.num_workers > 0)
        if rng is not None and before:
            set_rng_state(device, rng)
        batches = iter(loader)
        if rng is not None and not before:
            set_rng_state(device, rng)
        started = time.perf_counter()
        for step in steps:
            running = torch.zeros((), device=device.torch_device)
            for _ in step:
                host = next(batches)
                progress.count(host["attention_mask"], flops)
                running += _micro_step(run, host, pos_weight)
            _check_finite(float(running), epoch, progress.step + 1)  # the step's one sync
            at.optimizer_steps += 1
            faults.before_optimizer_step(at.optimizer_steps, resume is not None and (
                at.optimizer_steps == resume.optimizer_steps + 1))
            stepper.step(model, plan.max_grad_norm)
            scheduler.step()
            progress.step += 1
            at.step = progress.step
            progress.samples += plan.effective_batch
            progress.step_seconds += time.perf_counter() - started
            started = time.perf_counter()
            hooks.on_step(progress)
            due = points.count(progress.step)
            if not due:
                continue
            _evaluations(run, hooks, at, due)
            if at.evaluations == plan.evaluations:
                return progress
            started = time.perf_counter()
    return progress


def _epoch_steps(lengths: list[int], plan: Plan, epoch: int, resume: TrainState | None
                 ) -> list[list[list[int]]]:
    """The epoch's optimizer steps. An epoch a paused run stopped in keeps the samples of
    each step as that run laid them out, by its micro-batch: where this run's differs (a
    lowered batch limit, another device), each step's samples are cut again into this run's
    micro-batches, the same gradient from the same samples, none twice, none skipped."""
    steps = training_steps(lengths, plan.effective_batch, (
        resume.physical_batch if resume is not None else plan.physical_batch),
        seed=plan.seed, epoch=epoch)
    if resume is None or resume.physical_batch == plan.physical_batch:
        return steps
    recut = []
    for step in steps:
        samples = sorted((i for micro in step for i in micro), key=lambda i: -lengths[i])
        recut.append([samples[k:k + plan.physical_batch]
                      for k in range(0, len(samples), plan.physical_batch)])
    return recut


def _micro_step(run: _Run, host: dict[str, torch.Tensor], pos_weight: torch.Tensor | None
                ) -> torch.Tensor:
    """One micro-batch's forward and backward pass; returns its loss share, on the device."""
    device = run.device
    non_blocking = device.type == "cuda"
    batch = {k: v.to(device.torch_device, non_blocking=non_blocking) for k, v in host.items()}
    with autocast(device, run.plan.precision):
        loss = micro_batch_loss(run.model, batch, run.plan.effective_batch, pos_weight)
    run.stepper.scaler.scale(loss).backward()
    return loss.detach()


def _evaluations(run: _Run, hooks: Hooks, at: _Position, due: int) -> None:
    """The model scored once for the `due` evaluation points this step ends, each heard by
    the hooks; a hook's `PauseHere` becomes `Paused`, with where the run stands."""
    score = _evaluate(run.model, hooks.evaluate, run.progress, run.stepper.scaler)
    pause = False
    for repeat in range(min(due, run.plan.evaluations - at.evaluations)):
        at.evaluations += 1
        if repeat:  # one evaluation serving two points: the second took no time
            run.progress.epoch_seconds.append(0.0)
        try:
            hooks.on_evaluation(at.evaluations, score)
        except PauseHere:
            pause = True  # after the points this step serves: a resume starts past them
    if pause:
        raise Paused(run.state(at))


def _check_finite(loss: float, epoch: int, step: int) -> None:
    if not math.isfinite(loss):
        raise NonFiniteLoss(f"loss {loss} at epoch {epoch}, step {step}")


def _steps_per_epoch(examples: int, plan: Plan) -> int:
    steps = examples // plan.effective_batch
    if steps == 0:
        raise ValueError(f"the training split has {examples} examples, fewer than one "
                         f"effective batch of {plan.effective_batch}")
    return steps


def _evaluate(model: torch.nn.Module, evaluate: Callable[[torch.nn.Module], float],
              progress: Progress, scaler: torch.amp.GradScaler) -> float:
    """`evaluate`'s score, its seconds counted, and the training and evaluation seconds since
    the last evaluation appended to `progress.epoch_seconds` (one entry per report); the
    scaler's scale so far recorded."""
    if scaler.is_enabled():
        progress.grad_scale = scaler.get_scale()
    began = time.perf_counter()
    score = evaluate(model)
    progress.eval_seconds += time.perf_counter() - began
    progress.epoch_seconds.append(progress.train_seconds - sum(progress.epoch_seconds))
    return score


@torch.inference_mode()
def predict(
    model: torch.nn.Module, data: Encoded, batch: int, device: Device, precision: str, pad_id: int
) -> torch.Tensor:
    """Sigmoid probabilities for every example, in the data's order."""
    was_training = model.training
    model.eval()
    collate = Collator(data, pad_id)
    out = torch.empty_like(data.labels)
    for indices in eval_batches(data.lengths, batch):
        inputs = {k: v.to(device.torch_device) for k, v in collate(indices).items()}
        inputs.pop("labels")
        with autocast(device, precision):
            logits = model(**inputs).logits
        out[indices] = torch.sigmoid(logits.float()).cpu()
    model.train(was_training)
    return out
