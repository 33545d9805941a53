import pytest
import torch

from hpo.metrics import all_positive_baseline, as_grid, chosen_epoch, f1_scores


def test_f1_by_hand():
    gold = torch.tensor([[1, 0], [1, 1], [0, 0], [0, 1]]).bool()
    pred = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 0]]).bool()
    scores = f1_scores(pred, gold, ("a", "b"))
    # a: tp 1, fp 1, fn 1 -> 0.5; b: tp 1, fp 0, fn 1 -> 2/3
    assert scores.per_label == {"a": 0.5, "b": pytest.approx(0.6667, abs=1e-4)}
    assert scores.macro_f1 == pytest.approx((0.5 + 2 / 3) / 2)
    assert scores.micro_f1 == pytest.approx(2 * 2 / (2 * 2 + 1 + 2))


def test_label_never_present_nor_predicted_scores_zero():
    gold = torch.tensor([[1, 0], [0, 0]]).bool()
    assert f1_scores(gold, gold, ("a", "b")).per_label == {"a": 1.0, "b": 0.0}


def test_pairs_fold_back_into_a_post_grid():
    pairs = torch.arange(6).reshape(6, 1)
    assert as_grid(pairs, 3).tolist() == [[0, 1, 2], [3, 4, 5]]


def test_all_positive_baseline():
    gold = torch.tensor([[1, 0], [0, 0], [0, 0], [0, 1]]).bool()
    assert all_positive_baseline(gold, ("a", "b")).macro_f1 == pytest.approx(0.4)


def test_the_chosen_epoch_is_the_last_or_the_earliest_best():
    values = [0.41, 0.53, 0.53, 0.46]
    assert chosen_epoch(values, "best") == 1
    assert chosen_epoch(values, "last") == 3
    assert chosen_epoch([0.2], "best") == 0
