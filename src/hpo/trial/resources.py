"""What a worker process keeps across trials: the study's examples, each model's tokenized
splits and initial weights, built once and drawn on by every trial of the process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hpo.config import StudyConfig
from hpo.data import token_cache
from hpo.data.batching import Encoded
from hpo.data.redsm5 import label_names, read_redsm5
from hpo.data.splits import Splits, folds, split_posts
from hpo.data.tasks import Example, build_examples, targets
from hpo.errors import one_line
from hpo.hardware import Device
from hpo.search.artifacts import Keeper
from hpo.space import PinnedSpace
from hpo.training import memory, metrics
from hpo.training.models import ModelStore

if TYPE_CHECKING:
    from optuna.artifacts._protocol import ArtifactStore


@dataclass(frozen=True)
class Fold:
    """One fold of a cross-validated trial: what it trains on, what it is scored on."""

    train: Encoded
    validation: Encoded
    gold: torch.Tensor  # the validation posts' labels as a post x label grid


@dataclass(frozen=True)
class Resources:
    """The study's settings and device, and the caches of data, tokens and models. Frozen once
    built: a worker that decides its precisions after the study's check goes on with a copy
    (`dataclasses.replace`), which shares the caches."""

    config: StudyConfig
    pinned: PinnedSpace
    device: Device
    train_examples: list[Example]
    validation_examples: list[Example]
    label_names: tuple[str, ...]
    models: ModelStore = field(default_factory=ModelStore)
    token_cache_dir: Path | None = field(default_factory=token_cache.default_dir)
    keeper: Keeper | None = None  # where the best trials' models are kept, if anywhere
    checkpoints: ArtifactStore | None = None  # where paused trials' checkpoints go, if any
    _encoded: dict[str, tuple[Encoded, Encoded]] = field(default_factory=dict)

    def encoded(self, model_name: str) -> tuple[Encoded, Encoded, str]:
        """Both splits tokenized for this model, and where they came from: this process's
        memory, the machine's disk cache, or the tokenizer."""
        if model_name in self._encoded:
            return *self._encoded[model_name], "worker memory"
        train, train_hit = self.encode(self.train_examples, model_name)
        validation, validation_hit = self.encode(self.validation_examples, model_name)
        self._encoded[model_name] = (train, validation)
        return train, validation, "disk cache" if train_hit and validation_hit else "tokenizer"

    def encode(self, examples: list[Example], model_name: str) -> tuple[Encoded, bool]:
        """`examples` tokenized for this model, through the machine's token cache; whether
        the cache had them."""
        return token_cache.cached_encode(self.models.tokenizer(model_name), examples,
                                         self.config.data.max_length, self.token_cache_dir)

    @property
    def num_labels(self) -> int:
        """The outputs of a trial's classifier head: one per example's target."""
        return targets(self.config.data.task, self.label_names)

    def pad_id(self, model_name: str) -> int:
        """The token the collator pads this model's batches with."""
        pad = self.models.tokenizer(model_name).pad_token_id
        return pad if pad is not None else 0

    def folds(self, model_name: str) -> Iterator[Fold]:
        """`data.cv_folds` folds by post of the training and validation posts together,
        tokenized for this model (from the two splits' tokens, no second tokenization), made
        one at a time so that only one fold's copy of the tokens is held."""
        train, validation, _ = self.encoded(model_name)
        pool = Encoded.join(train, validation)
        per_post = len(self.label_names) if self.config.data.task == "nli_pairs" else 1
        data = self.config.data
        assert data.cv_folds is not None, "folds are made only under data.cv_folds"

        def examples(posts: list[int]) -> list[int]:
            return [p * per_post + j for p in posts for j in range(per_post)]

        for train_posts, validation_posts in folds(len(pool) // per_post, data.cv_folds,
                                                   data.split_seed):
            held = pool.select(examples(validation_posts))
            yield Fold(pool.select(examples(train_posts)), held,
                       metrics.as_grid(held.labels, len(self.label_names)).bool())

    def preload(self) -> dict[str, str]:
        """Every model of the search space read and its splits tokenized before the first
        trial, so the process holds from the start what it would hold after each model's
        first trial. Returns where each model's tokens came from."""
        sources = {}
        for name in self.pinned.declared["model_name"]:
            try:
                train, _, sources[name] = self.encoded(name)
                self.models.build(name, train.labels.shape[1], seed=self.config.training.seed)
            except Exception as exc:  # the trials that draw this model fail with the error
                sources[name] = f"not loaded: {one_line(exc)}"
        memory.release_memory()
        return sources

    def gold(self, examples: list[Example] | None = None) -> torch.Tensor:
        """The labels of `examples` (by default the validation posts') as a post x label
        grid."""
        chosen = self.validation_examples if examples is None else examples
        labels = torch.tensor([e.labels for e in chosen])
        return metrics.as_grid(labels, len(self.label_names)).bool()

    def baseline(self) -> metrics.Scores:
        return metrics.all_positive_baseline(self.gold(), self.label_names)


def load_resources(
    config: StudyConfig, pinned: PinnedSpace, device: Device, splits: Splits | None = None,
    keeper: Keeper | None = None, checkpoints: ArtifactStore | None = None,
) -> Resources:
    """The resources for this study's data, reading and splitting it unless `splits` is given;
    `keeper` keeps the best trials' models, if anything does; `checkpoints` holds paused
    trials' checkpoints, where the study pauses them."""
    data = config.data
    if splits is None:
        posts = read_redsm5(data.dir, special_case=data.special_case)
        splits = split_posts(posts, validation=data.validation_fraction,
                             test=data.test_fraction, seed=data.split_seed)
    return Resources(
        config=config,
        pinned=pinned,
        device=device,
        train_examples=build_examples(splits.train, data.task, special_case=data.special_case),
        validation_examples=build_examples(
            splits.validation, data.task, special_case=data.special_case
        ),
        label_names=label_names(data.special_case),
        keeper=keeper,
        checkpoints=checkpoints,
    )
