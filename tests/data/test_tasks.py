from __future__ import annotations

import pytest

from hpo.data.redsm5 import SPECIAL_CASE, SYMPTOMS, Post, label_names
from hpo.data.tasks import CRITERIA, build_examples

POSTS = [
    Post("a", "I can't sleep and I feel worthless.", frozenset({"SLEEP_ISSUES", "WORTHLESSNESS"})),
    Post("b", "Nice weather today.", frozenset()),
    Post("c", "Panic attacks every day.", frozenset({SPECIAL_CASE})),
]


def test_criteria_describe_every_label_in_one_sentence() -> None:
    assert set(CRITERIA) == set(label_names(special_case=True))
    for description in CRITERIA.values():
        assert description.endswith(".") and description.count(". ") == 0
        assert "\n" not in description


def test_multilabel_vectors() -> None:
    examples = build_examples(POSTS, "multilabel")
    assert [e.post_id for e in examples] == ["a", "b", "c"]
    first = examples[0]
    assert first.text == POSTS[0].text
    assert first.text_pair is None
    expected = [0.0] * 9
    expected[SYMPTOMS.index("SLEEP_ISSUES")] = 1.0
    expected[SYMPTOMS.index("WORTHLESSNESS")] = 1.0
    assert first.labels == tuple(expected)
    assert examples[1].labels == (0.0,) * 9
    # SPECIAL_CASE is not a column unless enabled, even if the post carries it.
    assert examples[2].labels == (0.0,) * 9


def test_multilabel_with_special_case() -> None:
    examples = build_examples(POSTS, "multilabel", special_case=True)
    assert all(len(e.labels) == 10 for e in examples)
    assert examples[2].labels == (0.0,) * 9 + (1.0,)
    assert examples[0].labels[-1] == 0.0


@pytest.mark.parametrize("special_case", [False, True])
def test_nli_pairs(special_case: bool) -> None:
    names = label_names(special_case)
    examples = build_examples(POSTS, "nli_pairs", special_case=special_case)
    assert len(examples) == len(POSTS) * len(names) == len(POSTS) * (10 if special_case else 9)
    for post_index, post in enumerate(POSTS):
        pairs = examples[post_index * len(names) : (post_index + 1) * len(names)]
        for example, name in zip(pairs, names, strict=True):
            assert example.post_id == post.post_id and example.text == post.text
            assert example.text_pair == CRITERIA[name]
            assert example.labels == ((1.0,) if name in post.symptoms else (0.0,))
    criterion = {text: name for name, text in CRITERIA.items()}
    yes = {(e.post_id, criterion[e.text_pair]) for e in examples if e.labels == (1.0,)}
    expected = {("a", "SLEEP_ISSUES"), ("a", "WORTHLESSNESS")}
    assert yes == (expected | {("c", SPECIAL_CASE)} if special_case else expected)


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="nli_pairs"):
        build_examples(POSTS, "regression")


def test_examples_are_frozen() -> None:
    example = build_examples(POSTS, "multilabel")[0]
    with pytest.raises(AttributeError):
        example.text = "changed"  # type: ignore[misc]
