"""Tokenization once per split, and batches that waste little on padding.

Training batches come in optimizer steps of exactly the effective batch size, each cut into
micro-batches of at most the physical batch size. Samples are grouped by length (the epoch
is sorted by lengths blurred with a little noise, or by length or width ranks blurred,
whichever pads less, then cut) so each micro-batch pads to a length close to its longest
sample; the order of steps is shuffled so training does not see lengths in sequence.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from hpo.data.tasks import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Each epoch is sorted by length times a random factor within 1 +- LENGTH_NOISE (the noise of
# AllenNLP's bucket sampler): samples within about a tenth of each other's length trade places
# from epoch to epoch, so most steps change company (a step of the tail's outliers may not),
# while a sort over the whole epoch finds closer lengths than sorting shuffled slices of it.
# The share of real tokens it leaves against slices sorted exactly: benchmarks/README.md,
# "Training throughput and padding against transformers' Trainer".
LENGTH_NOISE = 0.05
# A blur of lengths spans more samples the more of them share a length: on 5,000 posts and
# more, the 5% lets samples a tenth apart in length share a step, and the Trainer's exact sort
# within mega-batches pads less. So each epoch is also ordered by exact length rank moved by
# a random amount within +- RANK_BLUR effective batches (samples within a step of each other
# trade places, whatever the data's size), and the order that pads fewer tokens is trained.
# Measured by benchmarks/padding.py (benchmarks/README.md, "Padding at every data size").
RANK_BLUR = 0.5
# Finer blurs, tried too, of the rank by padded width: samples the collator pads to one
# width are interchangeable for padding, so they come in random order among themselves and
# only the widths are sorted. With no blur at all (0) no order pads fewer tokens at the data's
# widths (a micro-batch's width is its widest sample's, and equal-sized batches of a sorted
# order have the least sum of widths), yet on large data hundreds of samples share each width
# and steps still change company from epoch to epoch; a blur of a fraction of a step mixes
# more where a width holds fewer. A blur is admitted only where its orders of this epoch and
# the next keep, on average, at most MAX_KEPT of each sample's step-mates together: no more
# than the half-step blur keeps on data of distinct lengths (benchmarks/README.md,
# "Padding at every data size"). On a few hundred posts of wide spread they keep more, and are not
# admitted.
FINE_RANK_BLURS = (0.25, 0.125, 0.0)
MAX_KEPT = 0.6

# Batch widths are rounded up to a multiple, the smallest power of two that leaves a data set
# at most MAX_WIDTHS distinct widths (never past its longest example), and never coarser than
# WIDEST_MULTIPLE: 8 at 256 tokens and beyond, the multiple tensor cores want, but 2 at the
# demo's 64. Few shapes mean the kernels
# built per shape (oneDNN primitives on a CPU, cuBLAS plans on a GPU) are reused instead of
# built and kept for every length, so a worker's memory stops growing after its first trials.
# 32 rather than 16 keeps multiples of 8 up to 256 tokens, which pads less at the same peak
# memory; short data are not held to multiples of 8, which would pad more than the Trainer's
# `group_by_length`. The figures: benchmarks/README.md (worker memory growth; padding and
# throughput against the Trainer; benchmarks/padding.py).
MAX_WIDTHS = 32
# Past 256 tokens the width bound alone would round to 16 (512) or 32 (1,024), and even each
# post padded alone to such widths carries fewer real tokens than the Trainer's exact widths
# on large data (benchmarks/README.md, padding at max_length 512): there the widths may
# number up to longest / 8, which CPU kernel caches bound (hardware.CPU_KERNEL_CACHES) and
# cuBLAS's plans make little of.
WIDEST_MULTIPLE = 8


@dataclass(frozen=True, eq=False)
class Encoded:
    """Tokenized examples, packed: every example's ids end to end (int32, a few bytes per
    token instead of a Python int each), where each one starts, token types in the same layout
    (pairs only) and one label row per example. The tokenization cache stores these tensors."""

    tokens: torch.Tensor
    offsets: torch.Tensor  # int64, len(examples) + 1
    token_types: torch.Tensor | None
    labels: torch.Tensor  # float, one row per example

    @classmethod
    def pack(
        cls,
        input_ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]] | None,
        labels: torch.Tensor,
    ) -> Encoded:
        offsets = torch.zeros(len(input_ids) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor([len(ids) for ids in input_ids], dtype=torch.int64).cumsum(0)
        return cls(
            tokens=_flat(input_ids),
            offsets=offsets,
            token_types=_flat(token_type_ids) if token_type_ids is not None else None,
            labels=labels,
        )

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def select(self, indices: Sequence[int]) -> Encoded:
        """The examples at `indices`, in that order."""
        b = self.bounds
        ids = [self.tokens[b[i]:b[i + 1]] for i in indices]
        lengths = torch.tensor([len(t) for t in ids], dtype=torch.int64)
        offsets = torch.zeros(len(indices) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        types = (None if self.token_types is None
                 else torch.cat([self.token_types[b[i]:b[i + 1]] for i in indices]))
        tokens = torch.cat(ids) if ids else self.tokens[:0]
        return Encoded(tokens, offsets, types, self.labels[list(indices)])

    @classmethod
    def join(cls, first: Encoded, second: Encoded) -> Encoded:
        """The examples of `first`, then those of `second`."""
        types = (None if first.token_types is None or second.token_types is None
                 else torch.cat([first.token_types, second.token_types]))
        return cls(torch.cat([first.tokens, second.tokens]),
                   torch.cat([first.offsets, second.offsets[1:] + first.offsets[-1]]),
                   types, torch.cat([first.labels, second.labels]))

    @cached_property
    def bounds(self) -> list[int]:
        return self.offsets.tolist()

    @cached_property
    def lengths(self) -> list[int]:
        b = self.bounds
        return [b[i + 1] - b[i] for i in range(len(self))]

    @cached_property
    def longest(self) -> int:
        return max(self.lengths, default=0)


def _flat(sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.tensor([t for seq in sequences for t in seq], dtype=torch.int32)


def labels_of(examples: Sequence[Example]) -> torch.Tensor:
    return torch.tensor([e.labels for e in examples], dtype=torch.float32)


def encode(tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example],
           max_length: int) -> Encoded:
    texts = [e.text for e in examples]
    pairs = [e.text_pair for e in examples]
    has_pairs = any(p is not None for p in pairs)
    encoded = tokenizer(
        texts,
        pairs if has_pairs else None,
        # Cuts the longer side token by token: the post, unless max_length is so short that
        # the criterion alone overflows it (where "only_first" would raise).
        truncation="longest_first",
        max_length=max_length,
        padding=False,
    )
    return Encoded.pack(encoded["input_ids"], encoded.get("token_type_ids"), labels_of(examples))


Step = list[list[int]]  # micro-batches of example indices


def training_steps(
    lengths: Sequence[int], effective: int, physical: int, *, seed: int, epoch: int
) -> list[Step]:
    """One epoch's optimizer steps; the samples that do not fill a last step are left out
    (a different few each epoch), so every step holds exactly `effective` samples."""
    rng, kept = _epoch_samples(len(lengths), effective, seed, epoch)
    by_length = sorted(kept, key=lambda i: -lengths[i] * rng.uniform(1 - LENGTH_NOISE,
                                                                   1 + LENGTH_NOISE))
    exact = sorted(kept, key=lambda i: -lengths[i])  # ties in the shuffled order
    by_rank = _blurred(exact, RANK_BLUR * effective, rng)
    candidates = [_cut(by_length, effective, physical), _cut(by_rank, effective, physical)]
    widths = _widths(lengths)
    by_width = {e: _by_width(widths, effective, seed, e) for e in (epoch, epoch + 1)}
    for fine in FINE_RANK_BLURS:
        this, following = (_fine_blurred(by_width[e], effective, seed, e, fine)
                           for e in (epoch, epoch + 1))
        if kept_company(this, following, effective) <= MAX_KEPT:
            candidates.append(_cut(this, effective, physical))
    steps = min(candidates, key=lambda cut: padded_tokens(cut, lengths))
    rng.shuffle(steps)
    return steps


def _epoch_samples(n: int, effective: int, seed: int, epoch: int
                   ) -> tuple[random.Random, list[int]]:
    """The epoch's random stream and the samples it trains, in shuffled order: all but the
    few (a different few each epoch) that would not fill a last step."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    return rng, order[: n - n % effective]


def _fine_rank_order(lengths: Sequence[int], effective: int, seed: int, epoch: int,
                     blur: float) -> list[int]:
    """The epoch's samples by the rank of the width the collator pads them to, each moved
    within +- `blur` effective batches: the order `training_steps` tries for that blur."""
    by_width = _by_width(_widths(lengths), effective, seed, epoch)
    return _fine_blurred(by_width, effective, seed, epoch, blur)


def _widths(lengths: Sequence[int]) -> list[int]:
    """Each sample's width alone, as the collator pads it."""
    longest = max(lengths, default=0)
    multiple = pad_multiple(longest)
    return [padded_width(n, multiple, longest) for n in lengths]


def _by_width(widths: Sequence[int], effective: int, seed: int, epoch: int) -> list[int]:
    """The epoch's samples, widest first; samples of one width in the epoch's shuffled order.
    The same samples as the epoch's other orders."""
    _, kept = _epoch_samples(len(widths), effective, seed, epoch)
    return sorted(kept, key=lambda i: -widths[i])


def _fine_blurred(by_width: list[int], effective: int, seed: int, epoch: int,
                  blur: float) -> list[int]:
    """`by_width` with each sample moved within +- `blur` effective batches, by its own
    random stream, so the epoch's other orders are unchanged by it."""
    if blur == 0:
        return by_width
    return _blurred(by_width, blur * effective, random.Random(f"{seed}:{epoch}:{blur}"))


def _blurred(ranked: list[int], width: float, rng: random.Random) -> list[int]:
    """`ranked` with each sample moved by up to +- `width` places, at random."""
    return [ranked[r] for r in sorted(range(len(ranked)),
                                      key=lambda r: r + rng.uniform(-width, width))]


def kept_company(first: list[int], second: list[int], effective: int) -> float:
    """The mean share of a sample's step-mates in `first` that are its step-mates in
    `second` too, over the samples both orders train (0: all new company; 1: none)."""
    if effective < 2:
        return 0.0
    mates = []
    for order in (first, second):
        steps = {}
        for s in range(0, len(order), effective):
            step = frozenset(order[s : s + effective])
            steps.update(dict.fromkeys(step, step))
        mates.append(steps)
    both = [i for i in mates[0] if i in mates[1]]
    kept = sum(len(mates[0][i] & mates[1][i]) - 1 for i in both)
    return kept / max(1, len(both) * (effective - 1))


def _cut(ranked: list[int], effective: int, physical: int) -> list[Step]:
    steps: list[Step] = []
    for s in range(0, len(ranked), effective):
        step = ranked[s : s + effective]
        steps.append([step[m : m + physical] for m in range(0, len(step), physical)])
    return steps


def padded_tokens(steps: Sequence[Step], lengths: Sequence[int]) -> int:
    """The tokens the micro-batches of `steps` process, each padded as the collator pads it
    (to `padded_width`, at the data's `pad_multiple`)."""
    longest = max(lengths, default=0)
    multiple = pad_multiple(longest)
    return sum(padded_width(max(lengths[i] for i in micro), multiple, longest) * len(micro)
               for step in steps for micro in step)


def eval_batches(lengths: Sequence[int], batch: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[s : s + batch] for s in range(0, len(order), batch)]


@dataclass(frozen=True)
class Collator:
    data: Encoded
    pad_id: int

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        lengths, bounds = self.data.lengths, self.data.bounds
        multiple = pad_multiple(self.data.longest)
        width = padded_width(max(lengths[i] for i in indices), multiple, self.data.longest)
        ids = torch.full((len(indices), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(indices), width), dtype=torch.long)
        token_types = self.data.token_types
        types = None if token_types is None else torch.zeros_like(ids)
        for row, i in enumerate(indices):
            start, end = bounds[i], bounds[i + 1]
            ids[row, : end - start] = self.data.tokens[start:end]
            mask[row, : end - start] = 1
            if types is not None and token_types is not None:
                types[row, : end - start] = token_types[start:end]
        batch = {"input_ids": ids, "attention_mask": mask, "labels": self.data.labels[indices]}
        if types is not None:
            batch["token_type_ids"] = types
        return batch


def pad_multiple(longest: int) -> int:
    multiple = 1
    while multiple * MAX_WIDTHS < longest and multiple < WIDEST_MULTIPLE:
        multiple *= 2
    return multiple


def padded_width(longest_in_batch: int, multiple: int, longest_overall: int) -> int:
    return min(-(-longest_in_batch // multiple) * multiple, longest_overall)


class PlannedBatches(torch.utils.data.Sampler):
    """A batch sampler that yields whatever micro-batches the training loop planned for the
    current epoch, so one DataLoader (and its persistent workers) serves every epoch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
