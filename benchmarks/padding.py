"""Padding alone, by data set size and max_length: the share of processed tokens that are
real, in hpo's training batches against the Trainer's `group_by_length` and random batches, on
benchmarks/throughput.py's synthetic posts. No training: on a GPU, where a step costs in
proportion to the tokens it processes, the ratio of two efficiencies is the speed-up padding
gives one loop over the other at equal kernels.

    PYTHONPATH=src python benchmarks/padding.py [--sizes 400 1500 5000 20000] [--epochs 10]
        [--batches 8 32 128] [--max-lengths 64 128 256 512] [--model NAME_OR_DIR]
        [--study demo]

One table over size x batch x max_length, and the worst ratio of hpo's efficiency to
`group_by_length`'s over its cells. `--study NAME` measures that study's training split at its
max_length instead of the synthetic posts.

hpo's batches come from `batching.training_steps` and are padded to `batching.padded_width`
at `batching.pad_multiple`, as its collator pads them (the best order at hpo's widths: the
same samples sorted exactly, the least padding any order of them has at those widths; the
ceiling column: every sample padded alone to its own width, the best any batches can do at
that multiple); the Trainer's from its own `LengthGroupedSampler` (random mega-batches of
`min(n // (4 * batch), 50)` batches, each sorted by length) and from a random permutation,
each batch padded to its longest, as `DataCollatorWithPadding` pads it. Each is averaged over
`--epochs` epochs (training seed 0, epoch k).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Iterable, Sequence

import torch
from throughput import corpus
from transformers.trainer_pt_utils import LengthGroupedSampler

from hpo import study_files
from hpo.data.batching import encode, pad_multiple, padded_width, training_steps
from hpo.data.redsm5 import read_redsm5
from hpo.data.splits import split_posts
from hpo.data.tasks import Example, build_examples
from hpo.training.models import ModelStore, quiet_transformers


def efficiency(batches: Iterable[Sequence[int]], lengths: Sequence[int], *,
               rounded: bool) -> float:
    longest = max(lengths)
    multiple = pad_multiple(longest) if rounded else 1
    real = processed = 0
    for batch in batches:
        width = padded_width(max(lengths[i] for i in batch), multiple, longest)
        real += sum(lengths[i] for i in batch)
        processed += width * len(batch)
    return real / processed


def mean_efficiency(epochs: list[list[list[int]]], lengths: Sequence[int], *,
                    rounded: bool) -> float:
    return statistics.mean(efficiency(batches, lengths, rounded=rounded) for batches in epochs)


def hpo_batches(lengths: Sequence[int], batch: int, epoch: int) -> list[list[int]]:
    return [micro for step in training_steps(lengths, batch, batch, seed=0, epoch=epoch)
            for micro in step]


def best_batches(hpo: list[list[int]], lengths: Sequence[int], batch: int) -> list[list[int]]:
    """hpo's samples of the epoch sorted exactly, longest first, and cut into batches: at
    hpo's widths no order of those samples pads fewer tokens."""
    order = sorted((i for micro in hpo for i in micro), key=lambda i: -lengths[i])
    return [order[s : s + batch] for s in range(0, len(order), batch)]


def trainer_batches(lengths: Sequence[int], batch: int, epoch: int, *,
                    grouped: bool) -> list[list[int]]:
    generator = torch.Generator().manual_seed(epoch)
    order = (list(LengthGroupedSampler(batch, lengths=list(lengths), generator=generator))
             if grouped else torch.randperm(len(lengths), generator=generator).tolist())
    return [order[s : s + batch] for s in range(0, len(order), batch)]


def study_training_split(name: str) -> tuple[list[Example], int]:
    data = study_files.load(study_files.study_path(name)).data
    posts = read_redsm5(study_files.local_path(data.dir), special_case=data.special_case)
    splits = split_posts(posts, validation=data.validation_fraction, test=data.test_fraction,
                         seed=data.split_seed)
    return build_examples(splits.train, data.task, special_case=data.special_case), data.max_length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[400, 1500, 5000, 20000])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--max-lengths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--study", help="a study's training split instead of synthetic posts")
    args = parser.parse_args()
    quiet_transformers()
    tokenizer = ModelStore().tokenizer(args.model)
    if args.study:
        examples, max_length = study_training_split(args.study)
        data = [(f"{args.study}'s training split", encode(tokenizer, examples, max_length),
                 max_length)]
    else:
        posts = {n: corpus(n, 1, seed=0)[0] for n in args.sizes}
        data = [("synthetic", encode(tokenizer, posts[n], max_length), max_length)
                for n, max_length in itertools.product(args.sizes, args.max_lengths)]
    print(f"Tokens of {args.model}; the mean over {args.epochs} epochs\n")
    print("| posts | max_length | batch | hpo's width multiple | mega-batch of the Trainer's "
          "sampler | hpo | best order at hpo's widths | Trainer, group_by_length | Trainer, "
          "group_by_length, widths at hpo's multiple | Trainer, random batches | ceiling at "
          "hpo's multiple | hpo over group_by_length |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cells = [table_row(label, encoded.lengths, max_length, batch, args.epochs)
             for (label, encoded, max_length), batch in itertools.product(data, args.batches)]
    ratios = [ratio for ratio, _ in cells]
    out_of_reach = sum(ratio < 1 and unreachable for ratio, unreachable in cells)
    print(f"\nhpo over group_by_length: worst {min(ratios):.6f}x; {sum(r < 1 for r in ratios)} "
          f"of {len(ratios)} cells below 1, {out_of_reach} of them with the best order at "
          "hpo's widths below group_by_length too")


def table_row(label: str, lengths: Sequence[int], max_length: int, batch: int,
              epochs: int) -> tuple[float, bool]:
    """Prints one cell's row; returns hpo's ratio to group_by_length and whether no order
    reaches group_by_length at hpo's widths."""
    hpo = [hpo_batches(lengths, batch, e) for e in range(epochs)]
    ours = mean_efficiency(hpo, lengths, rounded=True)
    best = mean_efficiency([best_batches(h, lengths, batch) for h in hpo], lengths, rounded=True)
    grouped_epochs = [trainer_batches(lengths, batch, e, grouped=True) for e in range(epochs)]
    grouped = mean_efficiency(grouped_epochs, lengths, rounded=False)
    grouped_rounded = mean_efficiency(grouped_epochs, lengths, rounded=True)
    # Every sample alone in a batch of its own width: what rounding widths leaves at best.
    ceiling = efficiency([[i] for i in range(len(lengths))], lengths, rounded=True)
    shuffled = mean_efficiency([trainer_batches(lengths, batch, e, grouped=False)
                                for e in range(epochs)], lengths, rounded=False)
    mega = max(1, min(len(lengths) // (4 * batch), 50)) * batch
    print(f"| {label} ({len(lengths):,}) | {max_length} | {batch} | "
          f"{pad_multiple(max(lengths))} | {mega} | {ours:.4f} | {best:.4f} | {grouped:.4f} | "
          f"{grouped_rounded:.4f} | {shuffled:.4f} | {ceiling:.4f} | {ours / grouped:.4f}x |")
    return ours / grouped, best < grouped

if __name__ == "__main__":
    main()
