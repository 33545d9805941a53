"""The training FLOPs rule, checked against torch's own count of a real forward and backward
pass (`torch.utils.flop_counter`), for a whole model and for one with adapters."""

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertForSequenceClassification, DistilBertConfig

from hpo.training.flops import ModelFlops, model_flops


def bert() -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=256, num_labels=3, attn_implementation="sdpa"))


def counted(model: torch.nn.Module, sequences: int, length: int) -> int:
    """The FLOPs torch counts in one training pass over a padded batch."""
    ids = torch.randint(0, 100, (sequences, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.sum().backward()
    return counter.get_total_flops()


def test_the_counts_skip_embedding_tables_and_vectors():
    per_layer = 4 * 64 * 64 + 2 * 64 * 256  # attention's 4 projections, the feed-forward
    assert model_flops(bert()) == ModelFlops(
        trained=4 * per_layer + 64 * 64 + 64 * 3, frozen=0, layers=4, hidden=64)


def test_the_rule_is_torchs_count_but_for_the_pooled_head_counted_per_token():
    model = bert()
    estimate = model_flops(model).sequences(torch.full((4,), 32))
    torch_count = counted(model, 4, 32)
    # The pooler and classifier see one token per sequence; the rule, like PaLM's, counts
    # every weight per token: an overcount of their share of the weights (2% here).
    assert 1.0 <= estimate / torch_count < 1.03


def test_frozen_weights_under_adapters_cost_their_forward_and_input_gradient_only():
    model = get_peft_model(bert(), LoraConfig(r=4, target_modules=["query", "key", "value",
                                                                    "dense"]))
    flops = model_flops(model)
    assert flops.frozen > 0 and flops.trained < flops.frozen / 10
    # Beside the head, the first layer's projections of the (frozen) embeddings need no input
    # gradient: an overcount that shrinks with depth (5% at these 4 layers).
    assert 1.0 <= flops.sequences(torch.full((4,), 32)) / counted(model, 4, 32) < 1.06


def test_families_that_name_their_sizes_otherwise_are_read_through_the_config():
    from transformers import DistilBertForSequenceClassification

    model = DistilBertForSequenceClassification(DistilBertConfig(
        vocab_size=100, dim=32, n_layers=3, n_heads=2, hidden_dim=64))
    assert (model_flops(model).layers, model_flops(model).hidden) == (3, 32)


def test_attention_grows_with_the_square_of_each_sequences_length():
    flops = ModelFlops(trained=0, frozen=0, layers=2, hidden=16)
    assert flops.sequences(torch.tensor([8, 3])) == 12 * 2 * 16 * (8 ** 2 + 3 ** 2)


def test_padding_adds_no_flops():
    """A padded token is work for nothing: the rule counts the real ones, so padding lowers
    the utilisation instead of raising the count."""
    flops = model_flops(bert())
    mask = torch.tensor([[1] * 32, [1] * 16 + [0] * 16])
    assert flops.sequences(mask.sum(dim=1)) == (
        flops.sequences(torch.tensor([32])) + flops.sequences(torch.tensor([16])))
    assert flops.sequences(mask.sum(dim=1)) < flops.sequences(torch.tensor([32, 32]))
