"""Real training steps per model x precision (x adapter method, where the space searches
`peft`) before the search spends GPU hours: one of two sequences, then three more, timed. With
several precisions for `fp_precision: auto` to choose from, each is timed again at a trial's
batch, in rounds taken in turn, and `auto` goes by the median round's time per sequence and
says when the rounds' spread leaves its decision open (`space.by_cost`).

A combination whose model cannot be built, whose step raises or whose loss or predictions are
not finite is unusable: the trials that sample it are pruned at once with
`prune_reason=unusable`, without a batch search or training. The verdicts are kept in the study
per device kind (its name and memory), so every other worker on the same kind of device skips
the check and a worker on another kind checks its own. A step that ran out of memory while
other processes held part of the device is no verdict on the device: the study keeps none.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from typing import Protocol

import optuna
import torch

from hpo.errors import CheckError, one_line
from hpo.hardware import Device, precision_name
from hpo.space import StepCosts, by_cost
from hpo.training import adapters, memory
from hpo.training.models import config_of
from hpo.training.train import Plan, Stepper, autocast, prepare, probe_step
from hpo.trial.resources import Resources

PREFIX = "check:"
# Two sequences of max_length tokens: the step runs every kernel a trial's step runs, in
# seconds, with memory to spare on any device that trains the model at all.
BATCH = 2
# Timed after the first step (which pays for allocation and kernel selection), at the same
# batch, which the check has just shown the device holds; only `auto`'s comparison (ROUNDS)
# goes larger, where memory allows.
TIMED_STEPS = 3
# With more than one precision for `auto` to choose from, each combination is timed again in
# this many rounds, taken in turn (every other round in reverse order), each on a fresh model,
# and keeps the median round: `auto` keeps a precision by how its step time compares with
# another's, and a burst of load on a shared host during one combination's few steps once
# dropped the faster precision (benchmarks/README.md, the overhead section). A burst slows
# one round; the median ignores it, and the rounds' spread says how far to trust the ratio.
ROUNDS = 3
# The third round is left out where the first two already decide what `auto` keeps whatever
# it would time (`settled`): the median of three lies between the other two whatever the
# third is, so a burst in one of the two is outvoted as before, and where they agree (on a
# GPU, fp16 and bf16 both within the tolerance, fp32 far out) a third of the rounds' steps
# and model builds is saved.
SETTLING_ROUNDS = 2
# The rounds run at a trial's batch: the smallest effective batch the space searches (capped
# at the physical limit), which its trials run anyway. At the check's two sequences a step is
# mostly fixed cost (kernel launches, thread start-ups) that a lower precision does not
# shrink, so the margin that decided was narrow enough for load to flip. The batch is taken
# only where its memory, extrapolated from a timed step's, is at most this share of what is
# free: on a CPU the host's OOM killer, not an exception, answers a step too large.
MEMORY_SHARE = 0.5


class Messenger(Protocol):
    def message(self, text: str) -> None: ...


class Unusable(Exception):
    """The trial sampled a combination the check found unusable on this kind of device."""


@dataclass(frozen=True)
class Verdict:
    model: str
    precision: str
    usable: bool
    why: str | None = None
    step_seconds: float | None = None
    peak_mib: float | None = None
    attention: str | None = None
    peft: str = "none"  # verdicts stored before adapters were searched are full fine-tuning
    step_batch: int | None = None  # the micro-batch `step_seconds` was timed at
    # What one step at `step_batch` needed above what the process held, where the device
    # says (memory.step_memory); and the half-range of the timed rounds over their median.
    step_mib: float | None = None
    step_spread: float | None = None
    # Unusable because a step ran out of memory while other processes held part of the
    # device (judged when it happened: a neighbour may leave before the check ends).
    shared_oom: bool = False


FIELDS = frozenset(f.name for f in fields(Verdict))


def key(device: Device) -> str:
    return PREFIX + device.cache_key


def stored(study: optuna.Study, device: Device) -> list[Verdict] | None:
    """The verdicts a worker on this kind of device stored, if any has."""
    found = study.user_attrs.get(key(device))
    # Keys a newer release added are left out: its verdicts stay readable here.
    return None if found is None else [Verdict(**{k: v[k] for k in v if k in FIELDS})
                                       for v in found]


def step_seconds(verdicts: list[Verdict] | None) -> dict[str, dict[str, float]] | None:
    """The measured seconds of a training step per sequence, per configuration (a model,
    with its adapter method if any) and precision, for the usable combinations; None if none
    was timed. Per sequence, since a precision that fits fewer sequences is timed at a
    smaller batch; verdicts of releases that timed one untimed-shape step of two sequences
    (no `step_batch`) are not counted: they rank the precisions by their overheads."""
    seconds: dict[str, dict[str, float]] = {}
    for v in _timed(verdicts):
        assert v.step_seconds is not None and v.step_batch is not None  # _timed's filter
        seconds.setdefault(_configuration(v), {})[v.precision] = v.step_seconds / v.step_batch
    return seconds or None


def step_costs(verdicts: list[Verdict] | None) -> StepCosts | None:
    """What the check measured, for `space.by_cost`; None if no step was timed."""
    seconds = step_seconds(verdicts)
    if seconds is None:
        return None
    return StepCosts(seconds, step_spreads(verdicts), crowded(verdicts))


def step_spreads(verdicts: list[Verdict] | None) -> dict[str, dict[str, float]]:
    """The relative spread of the timed rounds, where they were timed in rounds, in the shape
    of `step_seconds`."""
    spreads: dict[str, dict[str, float]] = {}
    for v in _timed(verdicts):
        if v.step_spread is not None:
            spreads.setdefault(_configuration(v), {})[v.precision] = v.step_spread
    return spreads


def crowded(verdicts: list[Verdict] | None) -> frozenset[str]:
    """The precisions no combination was found usable in, but some ran out of memory only
    while other processes held part of the device: not judged on the device alone, so no
    reason to leave them out of a search (`space.by_cost`)."""
    verdicts = verdicts or []
    return frozenset(v.precision for v in verdicts if v.shared_oom) - {
        v.precision for v in verdicts if v.usable}


def _timed(verdicts: list[Verdict] | None) -> list[Verdict]:
    return [v for v in verdicts or () if v.usable and v.step_seconds and v.step_batch]


def _configuration(verdict: Verdict) -> str:
    return verdict.model if verdict.peft == "none" else f"{verdict.model} ({verdict.peft})"


def unusable(study: optuna.Study, device: Device, model: str, precision: str,
             peft: str = "none") -> str | None:
    """Why the combination is unusable on this kind of device; None if it is usable or was
    not checked."""
    for verdict in stored(study, device) or ():
        if (verdict.model, verdict.precision, verdict.peft) == (model, precision, peft) and (
                not verdict.usable):
            return verdict.why
    return None


def methods(resources: Resources) -> list[str]:
    """The adapter methods trials may use: the searched ones, else the training setting."""
    return resources.pinned.declared.get("peft") or [resources.config.training.peft]


def combinations(resources: Resources, precisions: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """Every model of the space x precision x adapter method."""
    return [(model, precision, peft) for model in resources.pinned.declared["model_name"]
            for precision in precisions for peft in methods(resources)]


def check_all(resources: Resources, precisions: tuple[str, ...],
              skip: frozenset[tuple[str, str, str]] = frozenset()) -> Iterator[Verdict]:
    """A verdict per combination not in `skip`, one real step each (adapters at the
    training section's rank and dropout). With more than one precision for `auto` to choose
    from, their step times are taken again at a trial's batch (`compare`)."""
    todo = [c for c in combinations(resources, precisions) if c not in skip]
    verdicts: dict[tuple[str, str, str], Verdict] = {}
    for combination in todo:
        verdicts[combination] = check_one(resources, *combination)
        memory.release_memory()  # the step's tensors are gone with check_one
    timed = {c: verdicts[c] for c in todo if verdicts[c].usable and verdicts[c].step_batch}
    # Only `auto` keeps precisions by their step times; a pinned list's are only shown.
    compared = resources.pinned.declared.get("fp_precision") == "auto"
    if compared and len({precision for _, precision, _ in timed}) > 1:
        # Settled early only where these are all the verdicts the decision weighs.
        verdicts |= compare(resources, timed, settle=not skip)
    yield from verdicts.values()


def timing_batch(target: int, batch: int, step_mib: float | None,
                 free_mib: float | None) -> int:
    """The batch `auto`'s rounds time a model at: `target`, a trial's batch, as far as a
    step's memory, extrapolated from `step_mib` at `batch` as proportional to the batch, stays
    within MEMORY_SHARE of `free_mib`; `batch`, which the check ran, where either is unknown."""
    if target <= batch:
        return target
    if step_mib is None or free_mib is None:
        return batch
    per_sequence = step_mib / batch
    fitting = int(MEMORY_SHARE * free_mib / per_sequence) if per_sequence > 0 else target
    return max(batch, min(target, fitting))


def compare(resources: Resources, verdicts: dict[tuple[str, str, str], Verdict],
            settle: bool = True) -> dict[tuple[str, str, str], Verdict]:
    """`verdicts` with the step times `auto` compares: each configuration (model and adapter
    method) at one `timing_batch` for all its precisions, in ROUNDS rounds taken in turn (with
    `settle`, SETTLING_ROUNDS where they already decide: `settled`), the median round kept
    with the rounds' spread. A configuration whose rounds ran out of memory keeps the check's
    own timing, at the check's batch."""
    space, training = resources.config.search_space, resources.config.training
    target = min(min(space.target_effective_batch_size), training.max_physical_batch_size)
    free = memory.free_bytes(resources.device)
    batches: dict[tuple[str, str], int] = {}
    for (model, _, peft), verdict in verdicts.items():
        batch = timing_batch(target, verdict.step_batch or BATCH, verdict.step_mib,
                             None if free is None else free / 2**20)
        batches[model, peft] = min(batches.get((model, peft), batch), batch)
    rounds: dict[tuple[str, str, str], list[float]] = {c: [] for c in verdicts}
    order = list(verdicts)
    tolerance = resources.config.study.precision_tolerance
    for turn in range(ROUNDS):
        if settle and turn >= SETTLING_ROUNDS and settled(verdicts, rounds, batches, tolerance):
            break
        for combination in order[::-1] if turn % 2 else order:
            model, _, peft = combination
            try:
                seconds = time_steps(resources, *combination, batches[model, peft])
            except Exception as exc:
                if not memory.is_oom(exc):
                    raise
                seconds = math.inf
            memory.release_memory()
            rounds[combination].append(seconds)
    lost = {(model, peft) for (model, _, peft), times in rounds.items() if math.inf in times}
    return {c: verdict if (c[0], c[2]) in lost else replace(
                verdict, step_seconds=round(statistics.median(rounds[c]), 4),
                step_batch=batches[c[0], c[2]], step_spread=round(spread(rounds[c]), 4))
            for c, verdict in verdicts.items()}


def settled(verdicts: dict[tuple[str, str, str], Verdict],
            rounds: dict[tuple[str, str, str], list[float]],
            batches: dict[tuple[str, str], int], tolerance: float) -> bool:
    """Whether the rounds timed so far decide what `auto` keeps (`space.by_cost`) whatever
    more rounds time: each combination's median will lie between its fastest and slowest
    round so far, and a precision is kept the harder the slower its steps and the faster the
    others', so it is settled where it is kept, or dropped, at both extremes."""
    lost = {(model, peft) for (model, _, peft), times in rounds.items() if math.inf in times}
    ends: dict[tuple[str, str, str], tuple[float, float]] = {}
    for (model, precision, peft), times in rounds.items():
        if (model, peft) in lost:  # it keeps the check's own timing, more rounds or not
            verdict = verdicts[model, precision, peft]
            assert verdict.step_seconds is not None and verdict.step_batch  # `timed` only
            ends[model, precision, peft] = (verdict.step_seconds / verdict.step_batch,) * 2
        else:
            batch = batches[model, peft]
            ends[model, precision, peft] = (min(times) / batch, max(times) / batch)
    precisions = tuple(dict.fromkeys(precision for _, precision, _ in rounds))

    def kept(precision: str, slow: bool) -> bool:
        """Whether `precision` is kept with its steps at their slowest (`slow`) and every
        other precision's at their fastest, or the other way round."""
        seconds: dict[str, dict[str, float]] = {}
        for combination, (low, high) in ends.items():
            other = combination[1]
            seconds.setdefault(_configuration(verdicts[combination]), {})[other] = (
                high if (other == precision) == slow else low)
        return precision in by_cost(seconds, precisions, tolerance).kept

    return all(kept(p, slow=True) == kept(p, slow=False) for p in precisions)


def spread(times: list[float]) -> float:
    """Half the range of `times` over their median: how far one round strays."""
    return (max(times) - min(times)) / 2 / statistics.median(times)


def _stepper(resources: Resources, model_name: str, precision: str,
             peft: str) -> tuple[Callable[[int], tuple[float, float]], torch.nn.Module, Plan]:
    """A fresh model of the combination and a function that runs one training step of it at
    a batch, returning the step's loss and seconds. One optimizer and scaler serve every
    step, as in training: a timed step allocates no optimizer state, and an fp16 step skipped
    for an overflow at a fresh scaler's first scale happens once, untimed."""
    config, device = resources.config, resources.device
    training = config.training.model_copy(update={"peft": peft})
    plan = Plan(precision=precision, effective_batch=BATCH, physical_batch=BATCH,
                eval_batch=BATCH, learning_rate=1e-5, weight_decay=0.0, warmup_ratio=0.0,
                max_grad_norm=training.max_grad_norm, epochs=1, seed=training.seed,
                gradient_checkpointing=training.gradient_checkpointing)
    model = adapters.build(resources.models, model_name, len(resources.label_names),
                           training, precision)
    model = prepare(model, plan, device)
    length = _length(resources, model_name)
    stepper = Stepper.fresh(model, plan, device)

    def step(batch: int) -> tuple[float, float]:
        began = time.perf_counter()
        loss = probe_step(model, plan, device, batch, length, stepper)
        return loss, time.perf_counter() - began

    return step, model, plan


def _length(resources: Resources, model_name: str) -> int:
    """A step's sequence length: max_length tokens, as the model allows."""
    tokenizer = resources.models.tokenizer(model_name)
    return min(resources.config.data.max_length, tokenizer.model_max_length)


def check_one(resources: Resources, model_name: str, precision: str,
              peft: str = "none") -> Verdict:
    device = resources.device
    attention = None
    try:
        step, model, plan = _stepper(resources, model_name, precision, peft)
        attention = config_of(model)._attn_implementation  # private; see records.record_model
        probe = memory.device_memory_probe(device)
        steps: list[tuple[int, float, float]] = []  # batch, loss, seconds

        def record(batch: int) -> None:
            steps.append((batch, *step(batch)))

        # A device too small for two sequences may still train one at a time.
        if not (memory.fits(record, BATCH) or memory.fits(record, 1)):
            raise torch.OutOfMemoryError("out of memory even at micro-batch 1")
        peak = probe.peak() / 2**20 if probe is not None else None
        timed = steps[0][0]
        step_bytes = memory.step_memory(device, lambda: record(timed))
        for _ in range(TIMED_STEPS - 1):
            record(timed)
        _, loss, _ = steps[0]
        seconds = statistics.median(s for _, _, s in steps[-TIMED_STEPS:])
        why = None if math.isfinite(loss) else f"loss {loss} after one step"
        if why is None:
            why = _predictions_not_finite(model, plan, device, _length(resources, model_name))
        verdict = Verdict(model_name, precision, why is None, why, round(seconds, 4),
                          None if peak is None else round(peak, 1), attention, peft, timed,
                          None if step_bytes is None else round(step_bytes / 2**20, 1))
    except Exception as exc:
        shared_oom = memory.is_oom(exc) and memory.foreign_bytes(device) > 0
        verdict = Verdict(model_name, precision, False, one_line(exc), attention=attention,
                          peft=peft, shared_oom=shared_oom)
    return verdict


def time_steps(resources: Resources, model_name: str, precision: str, peft: str,
               batch: int) -> float:
    """The median seconds of TIMED_STEPS training steps at `batch` of a combination already
    found usable, on a fresh model after one untimed step."""
    step, _, _ = _stepper(resources, model_name, precision, peft)
    step(batch)
    return statistics.median(step(batch)[1] for _ in range(TIMED_STEPS))


@torch.inference_mode()
def _predictions_not_finite(model: torch.nn.Module, plan: Plan, device: Device,
                            length: int) -> str | None:
    model.eval()
    inputs = {
        "input_ids": torch.randint(0, config_of(model).vocab_size, (BATCH, length),
                                   generator=torch.Generator().manual_seed(1)),
        "attention_mask": torch.ones((BATCH, length), dtype=torch.long),
    }
    with autocast(device, plan.precision):
        logits = model(**{k: v.to(device.torch_device) for k, v in inputs.items()}).logits
    if bool(torch.isfinite(logits.float()).all()):
        return None
    return "predictions not finite after one step"


def ensure(study: optuna.Study, resources: Resources, precisions: tuple[str, ...],
           report: Messenger) -> list[Verdict]:
    """The study's verdicts for this kind of device, checked now if no worker has; raises
    CheckError when nothing is usable."""
    verdicts = stored(study, resources.device) or []
    # Combinations already judged on this kind of device are not checked again; those no
    # worker has judged yet (a study checked before it searched an adapter method) are.
    done = frozenset((v.model, v.precision, v.peft) for v in verdicts)
    missing = [c for c in combinations(resources, precisions) if c not in done]
    if missing:
        report.message(f"checking {len(missing)} model x precision"
                       f"{' x peft method' if methods(resources) != ['none'] else ''} "
                       f"combination{'s' if len(missing) != 1 else ''}: a few training steps "
                       f"each, once per study and kind of device (--skip-check skips)")
        checked = list(check_all(resources, precisions, done))
        study.set_user_attr(key(resources.device), [
            asdict(v) for v in verdicts + kept_for_study(checked, resources.device, report)])
        verdicts = verdicts + checked
        report.message(table(verdicts))
    if not any(v.usable for v in verdicts):
        first = verdicts[0] if verdicts else None
        why = f"; {first.model} {first.precision}: {first.why}" if first else ""
        if any(v.shared_oom for v in verdicts):
            why += ("; other processes held part of the device: give the worker a GPU of "
                    "its own (CUDA_VISIBLE_DEVICES)")
        raise CheckError(f"no model x precision of study '{study.study_name}' is usable on "
                         f"{resources.device.describe()}{why}")
    return verdicts


def kept_for_study(checked: list[Verdict], device: Device, report: Messenger) -> list[Verdict]:
    """The verdicts every worker on this kind of device may trust. A step that ran out of
    memory while other processes held part of the device says nothing of the device alone
    (the batch cache's rule, `batch_limit.fit_batch`): the study keeps no verdict on it, this
    worker's trials of it go on to a batch search for what is left, and the next worker to
    start checks it again."""
    left = [v for v in checked if v.shared_oom]
    if left:
        names = ", ".join(f"{v.model} {precision_name(v.precision)}" for v in left)
        report.message(f"{names}: out of memory in the check while other processes held part "
                       f"of {device.describe()}, which says nothing of the device alone; the "
                       f"study keeps no verdict on it (one worker per GPU avoids this)")
    return [v for v in checked if not v.shared_oom]


def table(verdicts: list[Verdict]) -> str:
    with_peft = any(v.peft != "none" for v in verdicts)
    rows = [("model", "precision", *(("peft",) if with_peft else ()), "s/step", "batch",
             "peak MiB", "attention", "result")]
    for v in verdicts:
        rows.append((v.model, precision_name(v.precision), *((v.peft,) if with_peft else ()),
                     "-" if v.step_seconds is None else f"{v.step_seconds:.3f}",
                     "-" if v.step_batch is None else str(v.step_batch),
                     "-" if v.peak_mib is None else f"{v.peak_mib:.0f}", v.attention or "-",
                     "ok" if v.usable else f"unusable: {v.why}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)),
                                row[-1]]) for row in rows)
