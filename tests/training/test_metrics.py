import pytest
import torch

from hpo.training.metrics import (
    all_positive_baseline,
    apply_thresholds,
    as_grid,
    bootstrap_intervals,
    chosen_epoch,
    f1_scores,
    per_label_scores,
    tune_thresholds,
)


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


def test_precision_recall_and_f1_per_label_by_hand():
    gold = torch.tensor([[1, 0], [1, 1], [0, 0], [0, 1]]).bool()
    pred = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 0]]).bool()
    scores = per_label_scores(pred, gold, ("a", "b"))
    assert (scores["a"].precision, scores["a"].recall, scores["a"].f1) == (0.5, 0.5, 0.5)
    assert (scores["b"].precision, scores["b"].recall) == (1.0, 0.5)
    assert (scores["a"].support, scores["b"].support) == (2, 2)
    assert scores["b"].f1 == pytest.approx(f1_scores(pred, gold, ("a", "b")).per_label["b"])


def test_thresholds_are_tuned_per_label_to_the_best_f1():
    # Label a: positives score 0.3 and 0.35, negatives 0.1 and 0.2: any threshold from 0.2 up
    # to below 0.3 separates them; the nearest to 0.5 of those is 0.25. Label b has no
    # positives (F1 0 everywhere): it keeps 0.5.
    probabilities = torch.tensor([[0.3, 0.9], [0.35, 0.1], [0.1, 0.6], [0.2, 0.2]])
    gold = torch.tensor([[1, 0], [1, 0], [0, 0], [0, 0]]).bool()
    thresholds = tune_thresholds(probabilities, gold)
    assert thresholds == (0.25, 0.5)
    predicted = apply_thresholds(probabilities, thresholds)
    assert f1_scores(predicted, gold, ("a", "b")).per_label["a"] == 1.0
    assert f1_scores(probabilities > 0.5, gold, ("a", "b")).per_label["a"] == 0.0


def test_bootstrap_intervals_hold_the_score_and_narrow_with_more_posts():
    generator = torch.Generator().manual_seed(0)
    gold = torch.rand(400, 4, generator=generator) > 0.6
    noise = torch.rand(400, 4, generator=generator) > 0.8
    predicted = gold ^ noise  # about 80% of cells right
    names = tuple("abcd")
    widths = []
    for n in (40, 400):
        point = f1_scores(predicted[:n], gold[:n], names)
        intervals = bootstrap_intervals(predicted[:n], gold[:n])
        assert intervals["macro_f1"].low <= point.macro_f1 <= intervals["macro_f1"].high
        assert intervals["micro_f1"].low <= point.micro_f1 <= intervals["micro_f1"].high
        widths.append(intervals["macro_f1"].high - intervals["macro_f1"].low)
    assert widths[1] < widths[0] / 2  # about 1/sqrt(10) as wide
    assert bootstrap_intervals(predicted, gold) == bootstrap_intervals(predicted, gold)
