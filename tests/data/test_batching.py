import random

import pytest
from conftest import DEMO_DATA

from hpo.data import batching
from hpo.data.batching import (
    Collator,
    Encoded,
    eval_batches,
    pad_multiple,
    padded_tokens,
    padded_width,
    training_steps,
)
from hpo.data.redsm5 import read_redsm5


def long_tailed_lengths(n: int = 500, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [min(512, max(4, int(rng.lognormvariate(4.3, 0.9)))) for _ in range(n)]


@pytest.mark.parametrize(("effective", "physical"), [(32, 8), (32, 32), (24, 5), (8, 16)])
def test_every_step_holds_exactly_the_effective_batch(effective, physical):
    lengths = long_tailed_lengths()
    steps = training_steps(lengths, effective, physical, seed=1, epoch=1)
    assert len(steps) == len(lengths) // effective
    seen = [i for step in steps for micro in step for i in micro]
    assert len(seen) == len(set(seen)) == len(steps) * effective
    for step in steps:
        assert sum(len(m) for m in step) == effective
        assert all(1 <= len(m) <= physical for m in step)


def test_steps_are_reproducible_and_vary_by_epoch():
    lengths = long_tailed_lengths()
    a = training_steps(lengths, 16, 4, seed=3, epoch=1)
    assert a == training_steps(lengths, 16, 4, seed=3, epoch=1)
    assert a != training_steps(lengths, 16, 4, seed=3, epoch=2)


def repeated_steps(lengths: list[int], effective: int, seed: int) -> float:
    """The share of epoch 1's steps whose samples form a step of epoch 2 as well."""
    first, second = ({frozenset(i for micro in step for i in micro)
                      for step in training_steps(lengths, effective, effective, seed=seed,
                                                 epoch=epoch)}
                     for epoch in (1, 2))
    return len(first & second) / len(first)


@pytest.mark.parametrize("effective", [8, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_most_steps_change_company_from_epoch_to_epoch(effective, seed, monkeypatch):
    # 400 samples fill whole steps, so no left-out sample varies them: the noise must.
    lengths = long_tailed_lengths(400)
    assert repeated_steps(lengths, effective, seed) <= 0.15  # outliers of the tail may not
    # Sorted exactly, a step of samples of distinct lengths keeps its company.
    monkeypatch.setattr(batching, "LENGTH_NOISE", 0.0)
    assert repeated_steps(lengths, effective, seed) >= 0.3


def padding_efficiency(lengths, batches) -> float:
    real = sum(lengths[i] for b in batches for i in b)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return real / padded


def test_length_grouping_wastes_little_on_padding():
    lengths = long_tailed_lengths()
    grouped = [m for s in training_steps(lengths, 32, 8, seed=0, epoch=1) for m in s]
    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    plain = [order[i : i + 8] for i in range(0, len(grouped) * 8, 8)]
    assert padding_efficiency(lengths, grouped) >= 0.85
    assert padding_efficiency(lengths, plain) < 0.6


@pytest.mark.parametrize("n", [400, 5000, 20_000])
def test_an_epoch_takes_the_blurred_rank_order_where_it_pads_less_than_the_length_blur(
        n, monkeypatch):
    """A 5% blur of lengths spans hundreds of samples of a large data set, whose steps then
    pad more than the Trainer's group_by_length; an order by blurred length rank pads less
    there, and the epoch takes whichever of the two pads less."""
    lengths = long_tailed_lengths(n)
    chosen = training_steps(lengths, 32, 8, seed=0, epoch=1)
    monkeypatch.setattr(batching, "RANK_BLUR", 1e12)  # a random rank order: never chosen
    monkeypatch.setattr(batching, "FINE_RANK_BLURS", ())
    by_length = training_steps(lengths, 32, 8, seed=0, epoch=1)
    assert padded_tokens(chosen, lengths) <= padded_tokens(by_length, lengths)
    if n >= 5000:
        assert padded_tokens(chosen, lengths) < 0.98 * padded_tokens(by_length, lengths)
    # The collator pads each micro-batch as padded_tokens counts it.
    multiple, longest = pad_multiple(max(lengths)), max(lengths)
    assert padded_tokens(chosen, lengths) == sum(
        len(micro) * padded_width(max(lengths[i] for i in micro), multiple, longest)
        for step in chosen for micro in step)


def test_a_finer_rank_blur_is_taken_where_steps_still_change_company(monkeypatch):
    """On 20,000 samples many share each length: a blur of a fraction of a step still changes
    most steps' company, and pads less than half a step's blur."""
    lengths = long_tailed_lengths(20_000)
    chosen = training_steps(lengths, 128, 32, seed=0, epoch=1)
    monkeypatch.setattr(batching, "FINE_RANK_BLURS", ())
    coarse = training_steps(lengths, 128, 32, seed=0, epoch=1)
    assert padded_tokens(chosen, lengths) < 0.995 * padded_tokens(coarse, lengths)


def test_a_finer_rank_blur_is_refused_where_steps_would_keep_their_company(monkeypatch):
    # Each width (multiples of 16 up to 512) holds exactly one step's samples: the width order
    # keeps every step's company, and a blur of a fraction of a step most of it.
    lengths = [16 * k for k in range(1, 33) for _ in range(16)]
    for fine in batching.FINE_RANK_BLURS:
        this, following = (batching._fine_rank_order(lengths, 16, 0, epoch, fine)
                           for epoch in (1, 2))
        assert batching.kept_company(this, following, 16) > batching.MAX_KEPT
    chosen = training_steps(lengths, 16, 16, seed=0, epoch=1)
    monkeypatch.setattr(batching, "FINE_RANK_BLURS", ())
    assert chosen == training_steps(lengths, 16, 16, seed=0, epoch=1)


def test_the_width_order_sorts_widths_and_shuffles_samples_of_one_width():
    lengths = long_tailed_lengths(2000)
    multiple, longest = pad_multiple(max(lengths)), max(lengths)
    orders = [batching._fine_rank_order(lengths, 16, 0, epoch, 0.0) for epoch in (1, 2)]
    for order in orders:
        widths = [padded_width(lengths[i], multiple, longest) for i in order]
        assert widths == sorted(widths, reverse=True)
    # Samples of one width come in another order each epoch, so steps change company.
    assert orders[0][:200] != orders[1][:200]
    assert batching.kept_company(orders[0], orders[1], 16) <= batching.MAX_KEPT


def trainer_like_order(lengths: list[int], kept: list[int], batch: int,
                       rng: random.Random) -> list[int]:
    """transformers' LengthGroupedSampler over `kept`: random mega-batches of
    min(n // (4 * batch), 50) batches, each sorted by length, longest first."""
    order = rng.sample(kept, len(kept))
    mega = max(1, min(len(kept) // (4 * batch), 50)) * batch
    return [i for s in range(0, len(order), mega)
            for i in sorted(order[s : s + mega], key=lambda i: -lengths[i])]


def truncated_lengths(n: int, max_length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max_length, max(3, int(rng.lognormvariate(5.3, 0.8)))) for _ in range(n)]


@pytest.mark.parametrize("max_length", [64, 128, 256, 512])
@pytest.mark.parametrize(("n", "effective", "physical"), [(400, 8, 8), (400, 32, 8),
                                                          (3000, 8, 8), (3000, 32, 16)])
def test_an_epoch_pads_no_more_than_the_trainers_length_grouping(max_length, n, effective,
                                                                 physical):
    """At the collator's widths, the chosen steps pad no more than the Trainer's order of
    mega-batches sorted by length would, cut the same way, over the same samples."""
    for seed in (0, 1):
        lengths = truncated_lengths(n, max_length, seed)
        steps = training_steps(lengths, effective, physical, seed=seed, epoch=1)
        kept = [i for step in steps for micro in step for i in micro]
        trainer = trainer_like_order(lengths, kept, effective, random.Random(seed))
        assert padded_tokens(steps, lengths) <= padded_tokens(
            batching._cut(trainer, effective, physical), lengths)


@pytest.mark.parametrize("max_length", [64, 128, 256, 512])
def test_where_the_width_order_is_admitted_no_order_pads_fewer_tokens(max_length):
    # 5,000 samples: hundreds share each width, and the width order mixes steps.
    lengths = truncated_lengths(5000, max_length, 0)
    steps = training_steps(lengths, 32, 8, seed=0, epoch=1)
    kept = [i for step in steps for micro in step for i in micro]
    exact = sorted(kept, key=lambda i: -lengths[i])  # the least padding of whole steps
    assert padded_tokens(steps, lengths) == padded_tokens(batching._cut(exact, 32, 8), lengths)


def test_kept_company_is_the_share_of_step_mates_kept():
    order = list(range(8))
    assert batching.kept_company(order, order, 4) == 1.0
    # Each sample keeps one of its three step-mates.
    assert batching.kept_company(order, [0, 1, 4, 5, 2, 3, 6, 7], 4) == pytest.approx(1 / 3)
    # Samples only one order trains are left out of the mean.
    assert batching.kept_company([0, 1, 2, 3], [0, 2, 4, 5, 1, 3, 6, 7], 2) == 0.0


def test_a_finer_blurs_order_trains_the_same_samples_as_the_epochs_others():
    lengths = long_tailed_lengths(1003)  # 1003 % 16: 11 samples left out each epoch
    for epoch in (1, 2):
        steps = training_steps(lengths, 16, 16, seed=0, epoch=epoch)
        trained = sorted(i for step in steps for micro in step for i in micro)
        for fine in batching.FINE_RANK_BLURS:
            assert sorted(batching._fine_rank_order(lengths, 16, 0, epoch, fine)) == trained


def test_eval_batches_cover_everything_once():
    lengths = long_tailed_lengths(101)
    batches = eval_batches(lengths, 16)
    assert sorted(i for b in batches for i in b) == list(range(101))
    assert max(len(b) for b in batches) == 16


def test_collator_pads_to_the_longest_in_the_batch():
    import torch

    data = Encoded.pack([(5, 6, 7), (8,)], None, torch.tensor([[1.0], [0.0]]))
    batch = Collator(data, pad_id=0)([1, 0])
    assert batch["input_ids"].tolist() == [[8, 0, 0], [5, 6, 7]]
    assert batch["attention_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch["labels"].tolist() == [[0.0], [1.0]]
    assert "token_type_ids" not in batch


def test_collator_pads_token_types_of_pairs():
    import torch

    data = Encoded.pack([(5, 6), (7, 8, 9, 10)], [(0, 1), (0, 0, 1, 1)],
                        torch.tensor([[1.0], [0.0]]))
    assert data.lengths == [2, 4] and len(data) == 2
    batch = Collator(data, pad_id=3)([0, 1])
    assert batch["input_ids"].tolist() == [[5, 6, 3, 3], [7, 8, 9, 10]]
    assert batch["token_type_ids"].tolist() == [[0, 1, 0, 0], [0, 0, 1, 1]]


def test_widths_round_up_to_the_multiple_but_never_past_the_longest_example():
    import torch

    data = Encoded.pack([(5,) * 3, (6,) * 17, (7,) * 140], None, torch.zeros((3, 1)))
    collate = Collator(data, pad_id=0)  # the longest is 140: widths are multiples of 8
    assert collate([0])["input_ids"].shape == (1, 8)
    assert collate([0, 1])["input_ids"].shape == (2, 24)
    assert collate([2, 0])["input_ids"].shape == (2, 140)  # 144 would pass the longest
    assert collate([0])["attention_mask"].sum() == 3
    assert padded_width(32, 16, 512) == 32


@pytest.mark.parametrize(("longest", "multiple"), [(1, 1), (32, 1), (33, 2), (64, 2), (100, 4),
                                                   (140, 8), (256, 8), (257, 8), (512, 8),
                                                   (1024, 8)])
def test_the_multiple_is_the_finest_power_of_two_that_keeps_at_most_32_widths_up_to_8(
        longest, multiple):
    assert pad_multiple(longest) == multiple
    widths = len({padded_width(n, multiple, longest) for n in range(1, longest + 1)})
    assert widths <= max(32, -(-longest // 8))
    if 1 < multiple < 8:  # and no finer one would keep 32
        assert len({padded_width(n, multiple // 2, longest) for n in range(1, longest + 1)}) > 32


def test_demo_posts_are_long_tailed():
    words = sorted(len(p.text.split()) for p in read_redsm5(DEMO_DATA))
    assert words[-1] > 10 * words[len(words) // 2]


def test_selected_and_joined_examples_keep_their_tokens_types_and_labels():
    import torch

    first = Encoded.pack([(5, 6), (7, 8, 9)], [(0, 1), (0, 0, 1)], torch.tensor([[1.0], [0.0]]))
    second = Encoded.pack([(4,)], [(1,)], torch.tensor([[1.0]]))
    both = Encoded.join(first, second)
    assert both.lengths == [2, 3, 1] and both.labels.tolist() == [[1.0], [0.0], [1.0]]
    picked = both.select([2, 0])
    assert picked.lengths == [1, 2] and picked.labels.tolist() == [[1.0], [1.0]]
    batch = Collator(picked, pad_id=3)([0, 1])
    assert batch["input_ids"].tolist() == [[4, 3], [5, 6]]
    assert batch["token_type_ids"].tolist() == [[1, 0], [0, 1]]
