"""The study file's schema: its sections and keys, their defaults and their validation.

`study_files` finds and reads a study file, applies its `--set` and environment overrides and
validates it against this schema, reporting all its problems in one line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PRECISIONS = ("fp16", "bf16", "none")
T = TypeVar("T")


class _Section(BaseModel):
    # Each field's docstring is its description, which the study-file reference in the docs
    # is generated from (scripts/study_reference.py): a key without one fails a test.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _validate_range(low: float, high: float, log: bool) -> None:
    if low > high:
        raise ValueError(f"low ({low}) is greater than high ({high})")
    if log and low <= 0:
        raise ValueError(f"log scale needs low > 0, got {low}")


class FloatRange(_Section):
    low: float
    """The smallest value sampled."""
    high: float
    """The largest value sampled."""
    log: bool = False
    """Sample on a log scale (for rates spanning orders of magnitude; needs low > 0)."""

    @model_validator(mode="after")
    def _ordered(self) -> FloatRange:
        _validate_range(self.low, self.high, self.log)
        return self


class IntRange(_Section):
    low: int
    """The smallest value sampled."""
    high: int
    """The largest value sampled."""
    log: bool = False
    """Sample on a log scale (needs low > 0, step 1)."""
    step: Annotated[int, Field(ge=1)] = 1
    """The spacing of the values sampled."""

    @model_validator(mode="after")
    def _ordered(self) -> IntRange:
        _validate_range(self.low, self.high, self.log)
        if self.log and self.step != 1:
            raise ValueError("log scale and step cannot be combined")
        return self


def _unique(values: Sequence[Any]) -> Sequence[Any]:
    if len(set(values)) != len(values):
        raise ValueError(f"choices repeat: {values}")
    return values


_Choices = Annotated[list[T], Field(min_length=1)]


# `fp_precision` values that leave the precisions to the device: `native`, every precision
# it runs natively; `auto`, of those the ones whose training step the study's check measured
# no slower than the fastest's by more than `study.precision_tolerance`, summed over models.
BY_DEVICE = ("auto", "native")


class SearchSpace(_Section):
    model_name: Annotated[list[str], Field(min_length=1)]
    """The models searched: hub ids or local model directories."""
    fp_precision: str | list[str] = "auto"
    """`auto`: the precisions the device runs natively whose training step the check measured
    within `study.precision_tolerance` of the fastest's, summed over the models, decided once
    for the study by its first worker; `native`: every natively run one; or a list of
    `fp16`, `bf16`, `none` (fp32), each of which must be native."""
    target_effective_batch_size: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1)]
    """The effective batch sizes searched: samples per optimizer step, made exact by
    gradient accumulation over the largest physical batch that fits."""
    learning_rate: FloatRange
    """The learning rate's range (for trials with adapters too, unless
    `adapter_learning_rate` gives them their own)."""
    # Extra parameters: each replaces the training setting of the same name for the trial.
    weight_decay: FloatRange | None = None
    """Searched instead of `training.weight_decay`."""
    warmup_ratio: FloatRange | None = None
    """Searched instead of `training.warmup_ratio`."""
    max_grad_norm: FloatRange | None = None
    """Searched instead of `training.max_grad_norm`."""
    epochs: IntRange | None = None
    """Searched instead of `training.epochs`."""
    peft: Annotated[list[Literal["none", "lora", "dora"]], Field(min_length=1)] | None = None
    """Fine-tuning methods searched: `none` (the whole model), `lora`, `dora` (peft's
    adapters on the frozen pretrained body; the head trains whole)."""
    lora_r: _Choices[Annotated[int, Field(ge=1)]] | IntRange | None = None
    """Adapter rank; sampled only by trials with adapters."""
    lora_alpha: _Choices[Annotated[float, Field(gt=0)]] | FloatRange | None = None
    """Adapter alpha; sampled only by trials with adapters."""
    lora_alpha_ratio: _Choices[Annotated[float, Field(gt=0)]] | FloatRange | None = None
    """Adapter alpha as a multiple of the rank (instead of `lora_alpha`)."""
    lora_dropout: _Choices[Annotated[float, Field(ge=0, lt=1)]] | FloatRange | None = None
    """Adapter dropout; sampled only by trials with adapters."""
    adapter_learning_rate: FloatRange | None = None
    """The learning rate's range for trials with adapters, which want higher rates than full
    fine-tuning (one range judges one of the two unfairly); `learning_rate` is then sampled
    only by trials without. Needs `peft` with lora or dora."""

    @field_validator("fp_precision")
    @classmethod
    def _precisions(cls, value: str | list[str]) -> str | list[str]:
        if value in BY_DEVICE:
            return value
        if isinstance(value, str) or not value:
            raise ValueError("expected auto, native or a non-empty list of fp16, bf16, none")
        unknown = [p for p in value if p not in PRECISIONS]
        if unknown:
            raise ValueError(f"unknown precision {unknown[0]!r} (expected fp16, bf16 or none)")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> SearchSpace:
        _unique(self.model_name)
        _unique(self.target_effective_batch_size)
        if not self.by_device:
            _unique(self.fp_precision)
        for name in ("peft", *ADAPTER_KEYS):
            if isinstance(getattr(self, name), list):
                _unique(getattr(self, name))
        return self

    @model_validator(mode="after")
    def _adapters(self) -> SearchSpace:
        searched = [name for name in (*ADAPTER_KEYS, ADAPTER_RATE)
                    if getattr(self, name) is not None]
        if searched and not set(self.peft or ()) - {"none"}:
            raise ValueError(f"{searched[0]} is searched, but peft has no lora or dora")
        if self.lora_alpha is not None and self.lora_alpha_ratio is not None:
            raise ValueError("search lora_alpha or lora_alpha_ratio, not both")
        if isinstance(self.lora_dropout, FloatRange) and not (
                self.lora_dropout.low >= 0 and self.lora_dropout.high < 1):
            raise ValueError("lora_dropout must lie in [0, 1)")
        if isinstance(self.lora_r, IntRange) and self.lora_r.low < 1:
            raise ValueError("lora_r must be at least 1")
        for name in ("lora_alpha", "lora_alpha_ratio"):
            if isinstance(getattr(self, name), FloatRange) and getattr(self, name).low <= 0:
                raise ValueError(f"{name} must be above 0")
        return self

    @property
    def by_device(self) -> bool:
        """Whether the device decides the precisions searched (`auto` or `native`)."""
        return self.fp_precision in BY_DEVICE

    def extras(self) -> dict[str, FloatRange | IntRange | list]:
        """The extra parameters, `peft` before the adapter settings it decides about."""
        names = ("weight_decay", "warmup_ratio", "max_grad_norm", "epochs", "peft",
                 *ADAPTER_KEYS)
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    # Not beside space.suggest: StudyConfig checks `study.enqueue` with it, config may not
    # import space (space imports config), and reading a study file must not import space,
    # which loads torch through hardware.
    def rejects(self, params: dict[str, Any]) -> str | None:
        """Why a set of parameter values (some or all of the space's) is not a point of this
        space, or None if it is. With `fp_precision: auto` or `native` no precision may be
        given: which ones are searched is the device's to say."""
        choices: dict[str, Sequence[Any]] = {"model_name": self.model_name,
                                    "target_effective_batch_size":
                                        self.target_effective_batch_size}
        if not self.by_device:
            choices["fp_precision"] = self.fp_precision
        ranges: dict[str, FloatRange | IntRange] = {"learning_rate": self.learning_rate}
        if self.adapter_learning_rate is not None:
            ranges[ADAPTER_RATE] = self.adapter_learning_rate
        for name, dist in self.extras().items():
            if isinstance(dist, list):
                choices[name] = dist
            else:
                ranges[name] = dist
        for key, value in params.items():
            if key in choices:
                if value not in choices[key]:
                    return f"{key} {value!r} is not one of {choices[key]}"
            elif key in ranges:
                span = ranges[key]
                if isinstance(value, bool) or not isinstance(value, int | float) or not (
                        span.low <= value <= span.high):
                    return f"{key} {value!r} is outside [{span.low}, {span.high}]"
            elif key == "fp_precision":
                return (f"fp_precision is {self.fp_precision} in the search space: leave it "
                        f"out")
            else:
                return f"{key} is not a parameter of the search space"
        adapter_keys = [key for key in params if key in (*ADAPTER_KEYS, ADAPTER_RATE)]
        peft = params.get("peft")
        if adapter_keys and (peft == "none" or (peft is None and "none" in (self.peft or ()))):
            return (f"{adapter_keys[0]} is set, but the set may run without adapters: give "
                    f"peft: lora or dora")
        may_adapt = peft in ("lora", "dora") or (
                peft is None and bool(set(self.peft or ()) - {"none"}))
        if self.adapter_learning_rate is not None and "learning_rate" in params and may_adapt:
            return (f"learning_rate is set, but the set may run with adapters, whose rate is "
                    f"{ADAPTER_RATE}: give peft: none, or {ADAPTER_RATE} with peft: lora "
                    f"or dora")
        return None


# The adapter settings a trial with `peft` lora or dora samples (none: not sampled).
ADAPTER_KEYS = ("lora_r", "lora_alpha", "lora_alpha_ratio", "lora_dropout")
# The parameter that holds the learning rate of a trial with adapters, where the space
# gives adapters a range of their own.
ADAPTER_RATE = "adapter_learning_rate"


class SamplerConfig(_Section):
    name: Literal["tpe", "random"] = "tpe"
    """Optuna's sampler: `tpe` or `random`."""
    seed: int | None = None
    """Seeds the sampler per trial number: a run repeats, and two workers never draw the
    same values."""
    n_startup_trials: Annotated[int, Field(ge=0)] = 10
    """TPE: random trials before it models the results."""
    multivariate: bool = True
    """TPE: model the parameters jointly rather than one by one."""
    group: bool = False
    """TPE: model apart the groups of parameters that occur together (trials with and
    without adapters); needs `multivariate`."""
    constant_liar: bool = True
    """TPE: count the trials other workers are running as poor results, so workers sampling
    at once do not all pick the same promising region."""
    startup_counts_paused: bool = False
    """TPE: a trial paused at a rung (`pruner.pause`) counts among the `n_startup_trials`
    that end the random start-up, as the stop it replaces would. Off: in the replay it gave
    one worker less regret over time and two or more a worse final model on LCBench
    (benchmarks/README.md, "TPE's start-up under pausing")."""
    startup_min_complete: Annotated[int, Field(ge=0)] | Literal["workers"] = 0
    """TPE, with `startup_counts_paused`: the random start-up also lasts until this many
    trials have ended COMPLETE, so TPE does not start from one or two results; `workers`:
    as many as there are workers (the trials training when it samples, itself included).
    Off: about 1% less regret over time on the demo for a slightly worse final model
    (benchmarks/README.md, "A counted start-up that waits for complete trials")."""
    paused_as_pruned_from: Annotated[float, Field(ge=0, le=1)] | None = 0.5
    """TPE: read a trial paused at a rung (`pruner.pause`) as the PRUNED trial stopping would
    have made of it (ranked by how far it got and what it reported there) rather than as one
    still running, where it paused this share of the training's steps in or later (0: at
    any rung; `hpo.search.paused_view`). A late epoch ranks trials as their ends do; an
    early one need not (benchmarks/README.md, "Paused trials shown to TPE as pruned").
    None: a paused trial is a running one to TPE."""

    @model_validator(mode="after")
    def _needs(self) -> SamplerConfig:
        if self.group and not self.multivariate:
            raise ValueError("sampler.group needs sampler.multivariate: true")
        if self.startup_min_complete and not self.startup_counts_paused:
            raise ValueError("sampler.startup_min_complete needs sampler.startup_counts_paused:"
                             " true")
        return self


class PrunerConfig(_Section):
    name: Literal["median", "successive_halving", "hyperband", "none"] = "successive_halving"
    """Optuna's pruner, asked after each epoch (each fold under `data.cv_folds`):
    `successive_halving` (the default, chosen by the search-quality replay and confirmed by
    the real benchmark: benchmarks/README.md), `median`, `hyperband` or `none`."""
    n_startup_trials: Annotated[int, Field(ge=0)] = 5
    """median: no pruning until this many trials have finished."""
    n_warmup_steps: Annotated[int, Field(ge=0)] = 1
    """median: no trial is pruned before it has reported this many epochs."""
    min_resource: int | Literal["auto"] = "auto"
    """successive_halving, hyperband: epochs (folds) before the first decision; a trial
    goes on past min_resource x reduction_factor^k epochs only if it ranks in the top
    1/reduction_factor of the trials that reached that epoch. `auto` (the default): after
    ceil(steps / reduction_factor^2) of the steps a trial reports, 1 up to 9 epochs at
    reduction factor 3, 6 for 52: on LCBench's 52-epoch curves a first rung at 6 searched far
    better than at 1, where on the demo's it is 1 as before (benchmarks/README.md)."""
    reduction_factor: Annotated[int, Field(ge=2)] = 3
    """successive_halving, hyperband: the share (1/reduction_factor) kept at each rung."""
    min_rung_trials: Annotated[int, Field(ge=1)] = 1
    """successive_halving: a rung stops trials only once this many have reached it (1: from
    the second trial on, as Optuna's, which stops it unless it beats the first)."""
    min_rung_agreement: Annotated[float, Field(ge=-1.0, le=1.0)] | None = None
    """successive_halving: a rung stops trials only once its ranking agrees with the end:
    Kendall's tau between the value at the rung and the final value, over the finished trials
    that reported there (at least 5), is at least this. Until then trials pass it unchecked.
    null: no such check (Optuna's rule)."""

    pause: bool | Literal["auto"] = "auto"
    """successive_halving: a trial its rung would stop pauses instead (its checkpoint kept in
    the artifact store) and resumes, on any worker, once enough later trials rank below it
    (asynchronous successive halving's promotion form); what is still paused when the budget
    is spent ends pruned. false: stopped for good (Optuna's rule). Not under cv_folds.
    `auto` (the default): pause where a rung can (successive_halving, not cross-validated),
    keeping checkpoints where the study has an artifact store (`study.artifacts`, or the
    directory beside a SQLite file) and none where it has not; else stop (the worker says
    which)."""
    max_checkpoints: Annotated[int, Field(ge=0)] | None = 8
    """pause: at most this many paused trials keep a checkpoint in the store (the model's
    weights and AdamW's state: about 3 x 4 bytes a parameter). Past it, the paused trial
    least likely to be promoted (the largest share of its rung above its value; of equals
    the lower rung, then the later trial) gives its checkpoint up and stays paused: if a rung
    promotes it, it trains again from its start, and the budget counts those steps twice.
    0: no checkpoint, no store needed. null: no bound."""

    def on_evidence(self) -> bool:
        """Whether a rung waits for evidence (hpo's `EvidenceHalvingPruner`, not Optuna's)."""
        return self.min_rung_trials > 1 or self.min_rung_agreement is not None

    @field_validator("min_resource", mode="before")
    @classmethod
    def _min_resource(cls, value: Any) -> Any:
        if value == "auto" or (type(value) is int and value >= 1):
            return value
        raise ValueError("expected auto or a whole number of epochs, at least 1")

    @field_validator("pause", mode="before")
    @classmethod
    def _pause(cls, value: Any) -> Any:
        # One line for the two branches of `bool | "auto"` (pydantic would name both).
        if value == "auto" or type(value) is bool:
            return value
        raise ValueError("expected true, false or auto")

    def first_rung(self, steps: int) -> int:
        """`min_resource` for trials that report `steps` steps, `auto` resolved."""
        if self.min_resource == "auto":
            return max(1, math.ceil(steps / self.reduction_factor**2))
        return self.min_resource


class StudySection(_Section):
    name: str | None = None
    """The study's name in the storage; default: the study file's stem."""
    storage: str | None = None
    """The storage URL, used where neither `--storage` nor `HPO_STORAGE` gives one; default
    `sqlite:///hpo.db`."""
    objective: Literal["macro_f1", "micro_f1"] = "macro_f1"
    """The validation score maximized: `macro_f1` or `micro_f1` over the labels."""
    objective_epoch: Literal["best", "last"] = "best"
    """A trial's value: its best epoch's score (the epoch is recorded as `value_epoch`) or
    its last epoch's."""
    budget: Literal["trials", "trainings"] = "trainings"
    """What `--n-trials N` counts. `trials` (Optuna's): N trials finished or running.
    `trainings` (the default): the compute of N full trainings, N x the steps a trial
    reports (its epochs x `training.evaluations_per_epoch`); a trial starts, or a paused one
    resumes, only while all it may train still fits beside what the study trained and what
    its running trials may still train. A pruned or paused trial gives back what it did not
    train, so more trials run, and the study never trains more than N trainings. Fixed in
    the study by its first worker (a study of an earlier release counts trials unless its
    file says trainings); a worker whose file counts otherwise is refused."""
    max_consecutive_failures: Annotated[int, Field(ge=1)] = 3
    """A worker stops (exit 1) after this many FAILed trials in a row instead of burning
    the budget."""
    heartbeat_interval: Annotated[int, Field(ge=1)] = 30
    """Seconds between a running trial's heartbeats (fixed in the study when created)."""
    grace_period: Annotated[int, Field(ge=1)] = 120
    """Seconds of silence after which any worker fails a running trial and re-queues it;
    must exceed `heartbeat_interval`."""
    max_retry: Annotated[int, Field(ge=0)] = 2
    """How many times a trial whose worker went silent is run again."""
    enqueue: list[dict[str, Any]] = []
    """Parameter sets run first, once for the whole fleet (known-good starting points;
    parameters left out are sampled); each must be a point of the search space."""
    warm_start_from: str | None = None
    """Another study in the same storage whose best COMPLETE trials are enqueued first."""
    warm_start_trials: Annotated[int, Field(ge=1)] = 5
    """How many of `warm_start_from`'s best trials are enqueued."""
    keep_best: Annotated[int, Field(ge=0)] = 1
    """The models of the study's best K COMPLETE trials are kept in the artifact store
    (0: none)."""
    artifacts: str | None = None
    """The artifact store of kept models: a directory (a shared volume for a fleet) or
    `s3://BUCKET`; default a directory beside a SQLite storage file (`hpo.db` ->
    `hpo-artifacts/`), none for a server storage."""
    precision_tolerance: Annotated[float, Field(ge=0)] = 0.1
    """With `fp_precision: auto`, a native precision is searched only if its training step,
    summed over the models, took within this fraction of the fastest precision's: a slower
    one would spend the budget on trials no better for it."""

    @model_validator(mode="after")
    def _grace(self) -> StudySection:
        if self.grace_period <= self.heartbeat_interval:
            raise ValueError(
                f"grace_period ({self.grace_period}) must exceed heartbeat_interval "
                f"({self.heartbeat_interval})"
            )
        return self
    sampler: SamplerConfig = SamplerConfig()
    """Optuna's sampler and its settings."""
    pruner: PrunerConfig = PrunerConfig()
    """Optuna's pruner and its settings."""


class DataConfig(_Section):
    dir: str
    """The directory holding `redsm5_posts.csv` and `redsm5_annotations.csv`; a relative
    path is read from the working directory (the demo's from the package where it is not
    there)."""
    task: Literal["multilabel", "nli_pairs"] = "multilabel"
    """`multilabel`: one example per post with a label per symptom; `nli_pairs`: one (post,
    criterion description) pair per label, answered yes or no."""
    special_case: bool = False
    """Add ReDSM5's SPECIAL_CASE annotation as a tenth label."""
    validation_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.15
    """The share of posts the trials are scored on."""
    test_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.15
    """The share of posts held out for `hpo final`; no trial reads them."""
    split_seed: int = 13
    """Seeds the split of posts (and of folds)."""
    max_length: Annotated[int, Field(ge=8, le=8192)] = 512
    """Tokens per post; longer ones are cut."""
    cv_folds: Annotated[int, Field(ge=2, le=20)] | None = None
    """K-fold cross-validation by post over the training and validation posts (the test
    split stays out): a trial's value is the mean over its K folds. Default: one
    validation split."""

    @model_validator(mode="after")
    def _fractions(self) -> DataConfig:
        if self.validation_fraction + self.test_fraction >= 1:
            raise ValueError("validation_fraction + test_fraction must be below 1")
        return self


class TrainingConfig(_Section):
    epochs: Annotated[int, Field(ge=1)] = 3
    """Training epochs of a trial; the pruner is asked after each."""
    evaluations_per_epoch: Annotated[int, Field(ge=1)] = 1
    """Validation scores per epoch, evenly spaced over its steps (the last at its end), each
    reported to the pruner, as the Trainer's `eval_steps`: a training of one or two epochs can
    still be pruned; each costs a pass over the validation split."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.01
    """AdamW's weight decay."""
    warmup_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """The share of optimizer steps the learning rate warms up over (then decays linearly)."""
    max_grad_norm: Annotated[float, Field(gt=0)] = 1.0
    """Gradients are clipped to this norm."""
    pos_weight: Literal["balanced", "none"] = "balanced"
    """`balanced`: each label's positives weigh negatives/positives in the loss (rare
    symptoms otherwise sit below the 0.5 threshold for most of a short run); `none`."""
    max_physical_batch_size: Annotated[int, Field(ge=1)] = 256
    """The largest physical batch the batch search tries."""
    safety_margin: Annotated[float, Field(gt=0, le=1)] = 0.9
    """The share of the largest batch that survived a step which trials use."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, a larger batch, slower steps."""
    compile: bool = False
    """Run each model through `torch.compile` (inductor, dynamic shapes); a model the
    compiler fails on trains eagerly, with a warning."""
    seed: int = 42
    """Seeds a trial's model head, adapters (their initial weights), dropout and batch order."""
    device: str = "auto"
    """`auto` (the GPU if there is one), `cpu`, `cuda` or `cuda:N`."""
    isolate_trials: bool = False
    """Run each trial in a fresh child process: a library that leaks cannot poison the next
    trial, and memory stays exactly flat."""
    peft: Literal["none", "lora", "dora"] = "none"
    """The fine-tuning method where the search space does not sample one: `none` (the whole
    model), `lora` or `dora`."""
    lora_r: Annotated[int, Field(ge=1)] = 8
    """Adapter rank, where the search space does not sample one."""
    lora_alpha: Annotated[float, Field(gt=0)] | None = None
    """Adapter alpha; default `lora_alpha_ratio` x rank."""
    lora_alpha_ratio: Annotated[float, Field(gt=0)] = 2.0
    """Adapter alpha as a multiple of the rank, where `lora_alpha` is not set."""
    lora_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.1
    """Adapter dropout."""
    lora_target_modules: Annotated[list[str], Field(min_length=1)] | None = None
    """The modules given adapters; default every linear layer of the pretrained body,
    whatever the architecture names them."""
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    """`bfloat16`: the frozen body of bf16 adapter trials is stored in bf16 (the adapters and
    the head train in float32), halving its memory; refused where bf16 is emulated."""

    def adapter_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else (
            self.lora_alpha_ratio * self.lora_r)


class StudyConfig(_Section):
    study: StudySection = StudySection()
    """The study: its name, storage, objective, fleet settings, sampler and pruner."""
    data: DataConfig
    """The posts, their task and their split."""
    search_space: SearchSpace
    """The parameters each trial samples."""
    training: TrainingConfig = TrainingConfig()
    """The settings every trial trains with; a search-space key of the same name replaces
    one."""

    @model_validator(mode="after")
    def _enqueued(self) -> StudyConfig:
        for index, params in enumerate(self.study.enqueue):
            why = self.search_space.rejects(params)
            if why is not None:
                raise ValueError(f"study.enqueue[{index}]: {why}")
        return self

    @model_validator(mode="after")
    def _alpha(self) -> StudyConfig:
        if self.search_space.lora_alpha_ratio is not None and (
                self.training.lora_alpha is not None):
            raise ValueError("search_space.lora_alpha_ratio is searched, but training.lora_alpha "
                             "fixes alpha: remove one")
        return self

    @model_validator(mode="after")
    def _pause(self) -> StudyConfig:
        pruner = self.study.pruner
        if pruner.pause is True and pruner.name != "successive_halving":
            raise ValueError(f"study.pruner.pause needs successive_halving, not {pruner.name}")
        if pruner.pause is True and self.data.cv_folds:
            raise ValueError("study.pruner.pause cannot pause a cross-validated trial "
                             "(data.cv_folds): set pause false")
        return self

    @model_validator(mode="after")
    def _resource(self) -> StudyConfig:
        pruner = self.study.pruner
        # Only a first rung the file sets as a number can be its mistake: `auto` follows the
        # epochs, which an override may set to one (the worker then says it prunes nothing).
        explicit = "min_resource" in pruner.model_fields_set and pruner.min_resource != "auto"
        if explicit and not self.prunes():
            raise ValueError(
                f"study.pruner.min_resource ({pruner.min_resource}) must be below the "
                f"{self.max_steps()} steps a trial reports (its epochs, or its folds under "
                f"cv_folds): {pruner.name} would prune nothing")
        return self

    def prunes(self) -> bool:
        """Whether the pruner can stop any trial: a rung pruner needs a rung before the last
        step a trial reports (the last is never pruned: its compute is spent)."""
        pruner = self.study.pruner
        if pruner.name == "none":
            return False
        if pruner.name == "median":
            return max(pruner.n_warmup_steps, 1) < self.max_steps()
        return pruner.first_rung(self.max_steps()) < self.max_steps()

    def pruning_note(self) -> str | None:
        """Said where the study's pruner can stop no trial although the file names one."""
        pruner = self.study.pruner
        if pruner.name == "none" or self.prunes():
            return None
        steps = self.max_steps()
        what = (f"data.cv_folds {steps}" if self.data.cv_folds is not None
                else f"{steps} epoch{'s' * (steps != 1)}")
        return (f"  no pruning: trials report {steps} step{'s' * (steps != 1)} ({what}) "
                f"and study.pruner ({pruner.name}) decides only before the last; more epochs "
                f"or training.evaluations_per_epoch let it prune")

    def max_steps(self) -> int:
        """The most steps a trial reports, the pruners' resource: its folds under
        cross-validation, else its epochs (the most the space may sample). Known before any
        trial, so hyperband's brackets are the same in every worker from the first trial on
        (Optuna's "auto" waits for a finished trial)."""
        if self.data.cv_folds is not None:
            return self.data.cv_folds
        searched = self.search_space.epochs
        epochs = searched.high if searched is not None else self.training.epochs
        return epochs * self.training.evaluations_per_epoch

    @model_validator(mode="after")
    def _evaluations(self) -> StudyConfig:
        if self.data.cv_folds is not None and self.training.evaluations_per_epoch > 1:
            raise ValueError("training.evaluations_per_epoch: a cross-validated trial "
                             "(data.cv_folds) reports once per fold; leave it at 1")
        return self

    @model_validator(mode="after")
    def _device(self) -> StudyConfig:
        device = self.training.device
        if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
            raise ValueError(f"training.device must be auto, cpu, cuda or cuda:N, got {device!r}")
        return self
