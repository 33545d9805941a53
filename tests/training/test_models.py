"""The worker's model store: every trial gets its own copy of the model first built, for
every family of the shipped studies."""

import pytest
import torch

from hpo.training.models import ModelStore

FAMILIES = ("bert", "roberta", "electra", "deberta-v3")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_build_is_an_independent_copy_of_the_first(replica, family):
    store = ModelStore()
    first = store.build(str(replica(family)), 9, seed=0)
    initial = {k: v.clone() for k, v in first.state_dict().items()}
    # Training one copy (and switching its attention) leaves the next one untouched.
    with torch.no_grad():
        for param in first.parameters():
            param.add_(1.0)
    first.config.problem_type = "changed"
    second = store.build(str(replica(family)), 9, seed=123)
    assert second is not first and second.config is not first.config
    assert second.config.problem_type == "multi_label_classification"
    state = second.state_dict()
    assert state.keys() == initial.keys()
    assert all(torch.equal(state[k], initial[k]) for k in initial)
    assert not any(p.data_ptr() == q.data_ptr()
                   for p, q in zip(first.parameters(), second.parameters(), strict=True))


def test_the_head_is_initialised_from_the_seed_of_the_first_build(tiny_model):
    heads = []
    for seed in (0, 0, 1):
        model = ModelStore().build(str(tiny_model), 9, seed=seed)
        heads.append(model.classifier.weight.detach().clone())
    assert torch.equal(heads[0], heads[1])
    assert not torch.equal(heads[0], heads[2])
