from __future__ import annotations

import random

import pytest

from hpo.data.redsm5 import Post
from hpo.data.splits import Splits, folds, split_posts
from hpo.errors import DataError


def make_posts(n: int) -> list[Post]:
    return [Post(f"p{i:03d}", f"text {i}", frozenset()) for i in range(n)]


def ids(posts: tuple[Post, ...]) -> list[str]:
    return [post.post_id for post in posts]


def test_disjoint_covering_and_sized() -> None:
    posts = make_posts(100)
    splits = split_posts(posts, validation=0.15, test=0.15, seed=0)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (70, 15, 15)
    train, validation, test = set(splits.train), set(splits.validation), set(splits.test)
    assert not train & validation and not train & test and not validation & test
    assert train | validation | test == set(posts)
    for part in (splits.train, splits.validation, splits.test):
        assert ids(part) == sorted(ids(part))


def test_reproducible_and_input_order_independent() -> None:
    posts = make_posts(50)
    shuffled = posts[:]
    random.Random(99).shuffle(shuffled)
    first = split_posts(posts, validation=0.2, test=0.1, seed=7)
    assert split_posts(posts, validation=0.2, test=0.1, seed=7) == first
    assert split_posts(shuffled, validation=0.2, test=0.1, seed=7) == first
    assert split_posts(list(reversed(posts)), validation=0.2, test=0.1, seed=7) == first


def test_different_seeds_differ() -> None:
    posts = make_posts(50)
    validations = {
        tuple(ids(split_posts(posts, validation=0.2, test=0.1, seed=s).validation))
        for s in range(5)
    }
    assert len(validations) == 5


def test_small_sets_get_at_least_one_post_per_nonzero_split() -> None:
    splits = split_posts(make_posts(3), validation=0.1, test=0.1, seed=0)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (1, 1, 1)
    splits = split_posts(make_posts(10), validation=0.01, test=0.0, seed=0)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (9, 1, 0)
    # Below three posts there is no minimum: rounding alone decides.
    splits = split_posts(make_posts(2), validation=0.1, test=0.1, seed=0)
    assert (len(splits.train), len(splits.validation), len(splits.test)) == (2, 0, 0)


def test_zero_fractions_keep_everything_in_train() -> None:
    posts = make_posts(5)
    assert split_posts(posts, validation=0.0, test=0.0, seed=1) == Splits(tuple(posts), (), ())


@pytest.mark.parametrize(
    ("n", "validation", "test"), [(0, 0.1, 0.1), (3, 0.5, 0.4), (2, 0.5, 0.4), (4, 0.45, 0.45)]
)
def test_too_few_posts(n: int, validation: float, test: float) -> None:
    with pytest.raises(DataError, match="too few"):
        split_posts(make_posts(n), validation=validation, test=test, seed=0)


@pytest.mark.parametrize(("validation", "test"), [(-0.1, 0.1), (1.0, 0.0), (0.5, 0.5), (0.2, 1.2)])
def test_invalid_fractions(validation: float, test: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        split_posts(make_posts(10), validation=validation, test=test, seed=0)


def test_duplicate_post_ids_are_rejected() -> None:
    posts = make_posts(5) + [Post("p001", "another text", frozenset())]
    with pytest.raises(ValueError, match="p001"):
        split_posts(posts, validation=0.2, test=0.2, seed=0)


def test_folds_validate_every_post_once_in_folds_of_near_equal_size() -> None:
    made = folds(23, 5, seed=13)
    assert len(made) == 5
    held = [p for _, validation in made for p in validation]
    assert sorted(held) == list(range(23))
    assert {len(validation) for _, validation in made} == {4, 5}
    for train, validation in made:
        assert not set(train) & set(validation)
        assert sorted(train + validation) == list(range(23))
    assert made == folds(23, 5, seed=13) and made != folds(23, 5, seed=14)


def test_fewer_posts_than_folds_is_bad_input() -> None:
    with pytest.raises(DataError, match="data.cv_folds 5: only 4 training and validation"):
        folds(4, 5, seed=0)
