"""Turning posts into model examples for the two task framings.

- `multilabel`: one example per post, one 0/1 target per label name (sigmoid head).
- `nli_pairs`: one (post, criterion description) pair per label name with a single yes/no
  target, so a sentence-pair model can read the criterion instead of learning a label index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpo.data.redsm5 import SPECIAL_CASE, Post, label_names

TASKS = ("multilabel", "nli_pairs")

CRITERIA: dict[str, str] = {
    "DEPRESSED_MOOD": "The person feels sad, empty, hopeless or tearful most of the day.",
    "ANHEDONIA": "The person has lost interest or pleasure in activities they used to enjoy.",
    "APPETITE_CHANGE": "The person's appetite or weight has clearly increased or decreased.",
    "SLEEP_ISSUES": "The person sleeps far too little or far too much, such as insomnia.",
    "PSYCHOMOTOR": "The person is visibly restless and agitated or slowed down in movement "
    "and speech.",
    "FATIGUE": "The person feels tired, drained or without energy nearly every day.",
    "WORTHLESSNESS": "The person feels worthless or has excessive, inappropriate guilt.",
    "COGNITIVE_ISSUES": "The person has trouble thinking, concentrating or making decisions.",
    "SUICIDAL_THOUGHTS": "The person has recurrent thoughts of death, suicidal ideas or a "
    "suicide plan or attempt.",
    SPECIAL_CASE: "The person describes something clinically relevant, such as panic, self-harm "
    "or substance use, that is not one of the nine depression criteria.",
}


@dataclass(frozen=True)
class Example:
    post_id: str
    text: str
    text_pair: str | None  # None for multilabel; the criterion description for nli_pairs
    labels: tuple[float, ...]  # multilabel: one 0/1 per label name; nli_pairs: (1.0,) or (0.0,)


def targets(task: str, names: Sequence[str]) -> int:
    """The targets of one example, a classifier head's outputs: one per label name for
    multilabel, a single yes/no for nli_pairs."""
    return len(names) if task == "multilabel" else 1


def build_examples(
    posts: Sequence[Post], task: str, *, special_case: bool = False
) -> list[Example]:
    """Examples in post order; for nli_pairs, each post's pairs follow label order."""
    _validate_task(task)
    names = label_names(special_case)
    if task == "multilabel":
        return [
            Example(
                post_id=post.post_id,
                text=post.text,
                text_pair=None,
                labels=tuple(float(name in post.symptoms) for name in names),
            )
            for post in posts
        ]
    return [
        Example(
            post_id=post.post_id,
            text=post.text,
            text_pair=CRITERIA[name],
            labels=(float(name in post.symptoms),),
        )
        for post in posts
        for name in names
    ]


def _validate_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (expected one of {', '.join(TASKS)})")
