"""Seeded train / validation / test splits by post.

The posts are sorted by post_id before the seeded shuffle, so the split depends only on which
posts there are and the seed, never on the order a file happened to list them in.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from hpo.data.redsm5 import Post
from hpo.errors import DataError


@dataclass(frozen=True)
class Splits:
    train: tuple[Post, ...]
    validation: tuple[Post, ...]
    test: tuple[Post, ...]


def fingerprint(splits: Splits) -> dict[str, dict[str, int | str]]:
    """Each split's size and a digest of its post ids: what a study records of the split it
    searched on, so its final model is scored on posts no trial saw."""
    return {
        name: {"posts": len(posts), "sha256": hashlib.sha256(
            "\n".join(post.post_id for post in posts).encode()).hexdigest()[:16]}
        for name, posts in (("train", splits.train), ("validation", splits.validation),
                            ("test", splits.test))
    }


def validate_folds(splits: Splits, k: int | None) -> None:
    """`data.cv_folds` folds need at least one training or validation post each."""
    pooled = len(splits.train) + len(splits.validation)
    if k and pooled < k:
        raise DataError(f"data.cv_folds {k}: only {pooled} training and validation posts, "
                        f"fewer than one per fold")


def split_posts(posts: Sequence[Post], *, validation: float, test: float, seed: int) -> Splits:
    """Split posts into disjoint train / validation / test sets, each sorted by post_id.

    Sizes are round(n * fraction); a non-zero fraction gets at least one post once there are
    three posts, so a small data set still has something to validate and test on.
    """
    for name, fraction in (("validation", validation), ("test", test)):
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"{name} fraction must be in [0, 1), got {fraction}")
    if validation + test >= 1.0:
        raise ValueError(f"validation + test fractions must be below 1, got {validation} + {test}")
    ordered = sorted(posts, key=lambda post: post.post_id)
    for previous, current in pairwise(ordered):
        if previous.post_id == current.post_id:
            raise ValueError(f"duplicate post_id {current.post_id!r}: cannot split by post")
    n = len(ordered)
    n_validation = _size(n, validation)
    n_test = _size(n, test)
    if n - n_validation - n_test < 1:
        raise DataError(
            f"{n} posts are too few for validation={validation} and test={test}: "
            "the training split would be empty"
        )
    random.Random(seed).shuffle(ordered)
    cut = n_validation + n_test
    return Splits(
        train=_sorted(ordered[cut:]),
        validation=_sorted(ordered[:n_validation]),
        test=_sorted(ordered[n_validation:cut]),
    )


def _size(n: int, fraction: float) -> int:
    size = round(n * fraction)
    return max(size, 1) if fraction > 0 and n >= 3 else size


def _sorted(posts: list[Post]) -> tuple[Post, ...]:
    return tuple(sorted(posts, key=lambda post: post.post_id))


def folds(n_posts: int, k: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """K folds of post positions 0..n_posts-1, each a (training, validation) pair: the posts
    shuffled with `seed` and dealt round-robin, so fold sizes differ by at most one and every
    post validates exactly once."""
    if n_posts < k:
        raise DataError(f"data.cv_folds {k}: only {n_posts} training and validation posts, "
                        f"fewer than one per fold")
    order = list(range(n_posts))
    random.Random(seed).shuffle(order)
    held = [sorted(order[fold::k]) for fold in range(k)]
    return [(sorted(set(order) - set(validation)), validation) for validation in held]
