"""Attention and dropout for training on a CPU, where PyTorch's own spend most of a step.

On a CPU, `scaled_dot_product_attention` with dropout cannot use its fused kernel and falls back
to its math path, and every dropout mask is drawn with `bernoulli_`, one serial random number
per element. On a 2-core Xeon a training step of all-MiniLM (16 x 192 tokens, bf16) spent a
third of its time in `bernoulli_` and about two thirds in dropout masks, attention's matrix
products, its softmax and its masked-row checks (profile in benchmarks/README.md). Here the
mask comes from 64-bit random words cut into four 16-bit draws (a quarter of the random
numbers), and attention with dropout is the plain composition of matrix products and a
softmax, in chunks.

The arithmetic stays PyTorch's: inputs converted to float32 before anything else, whatever
the autocast precision, as the math path does; the dropout keeps each element with
probability 1 - p (p rounded to a multiple of 2^-16) and scales what it keeps by 1 / (1 - p),
so every activation keeps its expectation. GPUs keep SDPA: their fused kernels do dropout in
the kernel.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "hpo_cpu"
_DRAWS = 1 << 16  # a mask element is one 16-bit draw
# Attention runs on (samples x heads) chunks whose float32 scores take about this much: big
# enough that the per-chunk dispatch is negligible, small enough that glibc serves every
# temporary from its heap instead of fresh mmap'd pages (above 32 MiB it always maps new pages,
# one page fault per 4 KiB: the math path's 16 x 12 x 256 x 256 scores cost 12,288 faults per
# tensor). 1 MiB chunks ran 1.4x slower per step than 16 MiB ones (2-core Xeon, bf16).
CHUNK_BYTES = 16 << 20


def dropped_mask(shape: torch.Size, p: float) -> tuple[torch.Tensor, float]:
    """Which elements dropout at rate p drops (p rounded to a multiple of 2^-16, at most
    1 - 2^-16), and the scale 1 / (1 - p) that keeps the expectation of the rest; drawn from
    the default generator, so `torch.manual_seed` makes it repeatable."""
    dropped = min(round(p * _DRAWS), _DRAWS - 1)
    numel = shape.numel()
    words = torch.empty((numel + 3) // 4, dtype=torch.int64)
    words.random_(-(1 << 63), (1 << 63) - 1)
    draws = words.view(torch.int16)[:numel].view(shape)
    return draws < dropped - _DRAWS // 2, _DRAWS / (_DRAWS - dropped)


def cheap_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    if p <= 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    drop, scale = dropped_mask(x.shape, p)
    return x.masked_fill(drop, 0.0) * scale


class Dropout(torch.nn.Dropout):
    """`torch.nn.Dropout` with the cheaper mask (training only; inference is the identity)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.inplace and self.p < 1.0:
            drop, scale = dropped_mask(x.shape, self.p)
            return x.masked_fill_(drop, 0.0).mul_(scale)
        return cheap_dropout(x, self.p)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. Training with dropout on a CPU takes the composition
    below; every other case (inference, no dropout, causal without a mask, grouped key/value
    heads, a query batch broadcast over the keys', masks neither boolean nor additive, position
    biases, caches, soft-capping) is SDPA's, unchanged."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    plain = (
        0.0 < dropout < 1.0
        and module.training
        and query.device.type == "cpu"
        and key.shape[:2] == query.shape[:2]
        and (attention_mask is None or attention_mask.dtype == torch.bool
             or attention_mask.is_floating_point())
        and not (causal and attention_mask is None and query.shape[2] > 1)
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and kwargs.get("softcap") is None
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    with torch.autocast("cpu", enabled=False):
        rows = [
            torch.cat([
                _attend(query[c], key[c], value[c], _chunk_of(attention_mask, c), scale, dropout)
                for c in heads
            ], dim=1)
            for heads in _chunks(query.shape, key.shape[2])
        ]
    return torch.cat(rows, dim=0).to(value.dtype).transpose(1, 2).contiguous(), None


Chunk = tuple[slice, slice]  # samples, heads


def _chunks(shape: torch.Size, kv_length: int) -> list[list[Chunk]]:
    """(samples, heads) slices whose float32 score matrices hold about CHUNK_BYTES each,
    grouped by samples."""
    batch, heads, q_length = shape[0], shape[1], shape[2]
    per_head = q_length * kv_length * 4
    h = max(1, min(heads, CHUNK_BYTES // per_head))
    b = max(1, CHUNK_BYTES // (per_head * heads)) if h == heads else 1
    return [
        [(slice(b0, b0 + b), slice(h0, h0 + h)) for h0 in range(0, heads, h)]
        for b0 in range(0, batch, b)
    ]


def _chunk_of(mask: torch.Tensor | None, chunk: Chunk) -> torch.Tensor | None:
    if mask is None:
        return None
    # A mask dimension of 1 is broadcast over every sample or head.
    samples, heads = chunk
    return mask[samples if mask.shape[0] > 1 else slice(None),
                heads if mask.shape[1] > 1 else slice(None)]


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    p: float,
) -> torch.Tensor:
    scores = torch.matmul(q.float() * scale, k.float().transpose(-1, -2))
    if mask is not None and mask.dtype == torch.bool:
        # The most negative finite value, not -inf: a row with every key masked then averages
        # the values (as transformers' eager attention does) instead of turning into NaN.
        scores.masked_fill_(mask.logical_not(), torch.finfo(torch.float32).min)
    elif mask is not None:
        scores.add_(mask)
    probs = torch.softmax(scores, dim=-1)
    drop, keep_scale = dropped_mask(probs.shape, p)
    # The dropout's scale goes on v, which is head_dim / length the size of the probabilities.
    return torch.matmul(probs.masked_fill(drop, 0.0), v.float() * keep_scale)


# Registered on import, under a name of their own: a model uses them only once `install`
# switches it; SDPA and every other implementation stay as transformers ships them.
AttentionInterface.register(ATTENTION, attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def install(model: torch.nn.Module) -> bool:
    """Switch a transformers model from SDPA to this attention and these dropout modules;
    False, and the model unchanged, for a model that does not run SDPA (one that needs eager
    attention, say) or whose attention cannot be switched."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not getattr(
        model, "_can_set_attn_implementation", lambda: False
    )():
        return False
    model.set_attn_implementation(ATTENTION)
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is torch.nn.Dropout:
                setattr(parent, name, Dropout(child.p, child.inplace))
    return True
