"""The model FLOPs of training, from which a trial's model-FLOPs utilisation (MFU) follows.

The rule, PaLM's (its appendix B) as nanoGPT's `estimate_mfu` applies it: a training step
costs, per token, 6 FLOPs for each weight of a matrix the token is multiplied by (2 in the
forward pass, 2 for the input's gradient, 2 for the weight's), and 12 x layers x hidden x the
sequence's length for attention's two products (the scores and their weighted sum), forward
and backward. Only real tokens count: padding is work the device does for nothing, so a
padded batch lowers the utilisation, as it should. A frozen weight (an adapter's base model)
costs 4, as its own gradient is never computed. Embedding tables are looked up, not
multiplied, and vectors (biases, norms) are elementwise: neither is counted. Recomputation
under gradient checkpointing is not counted either: MFU counts the model's FLOPs, not the
hardware's. The rule counts every weight per token, as PaLM's does, though a classifier's
pooler and head see one token per sequence: about 1% high for the shipped models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelFlops:
    trained: int  # weights of matrices outside the embedding tables that get a gradient
    frozen: int  # the same, frozen
    layers: int  # transformer layers (0 where the model's config does not say)
    hidden: int  # their width

    def sequences(self, lengths: torch.Tensor) -> float:
        """Training FLOPs of one forward and backward pass over sequences of these real
        lengths (their padding not counted)."""
        lengths = lengths.to(torch.int64)
        tokens, squares = int(lengths.sum()), int((lengths * lengths).sum())
        weights = 6 * self.trained + 4 * self.frozen
        return float(weights * tokens + 12 * self.layers * self.hidden * squares)


def _layers_and_width(model: torch.nn.Module) -> tuple[int, int]:
    # An adapter wrapper or the compile wrapper holds the transformers model deeper down;
    # transformers maps each family's own names (DistilBERT's n_layers, dim) onto these.
    for module in model.modules():
        config = getattr(module, "config", None)
        layers = getattr(config, "num_hidden_layers", None)
        hidden = getattr(config, "hidden_size", None)
        if isinstance(layers, int) and isinstance(hidden, int):
            return layers, hidden
    return 0, 0


def model_flops(model: torch.nn.Module) -> ModelFlops:
    """The counts the rule needs, read off a model as it will train."""
    tables = {id(parameter) for module in model.modules()
              if isinstance(module, torch.nn.Embedding)
              for parameter in module.parameters(recurse=False)}
    trained = frozen = 0
    for parameter in model.parameters():
        if parameter.dim() < 2 or id(parameter) in tables:
            continue
        if parameter.requires_grad:
            trained += parameter.numel()
        else:
            frozen += parameter.numel()
    return ModelFlops(trained, frozen, *_layers_and_width(model))
