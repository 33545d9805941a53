import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hpo import cpu_kernels
from hpo.models import ModelStore

NOTHING_DROPPED = 1e-9  # above 0, so the composition runs; below 2^-17, so it drops nothing


class Attention(torch.nn.Module):
    def __init__(self, training: bool = True, is_causal: bool = False) -> None:
        super().__init__()
        self.train(training)
        self.is_causal = is_causal


def qkv(batch=3, heads=4, length=37, dim=8, dtype=torch.float64):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(batch, heads, length, dim, dtype=dtype, generator=generator,
                        requires_grad=True) for _ in range(3)]


def padding_mask(batch=3, length=37) -> torch.Tensor:
    mask = torch.ones(batch, 1, length, length, dtype=torch.bool)
    mask[1, ..., 20:] = False  # the second sample has 20 real tokens
    return mask


# One chunk; two samples per chunk; one sample and two of four heads per chunk.
@pytest.mark.parametrize("chunk_bytes", [1 << 30, 2 * 4 * 37 * 37 * 4, 2 * 37 * 37 * 4])
def test_attention_equals_sdpa_when_nothing_is_dropped(monkeypatch, chunk_bytes):
    monkeypatch.setattr(cpu_kernels, "CHUNK_BYTES", chunk_bytes)
    q, k, v = qkv()
    mask = padding_mask()
    out, _ = cpu_kernels.attention_forward(Attention(), q, k, v, mask, dropout=NOTHING_DROPPED)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad((out * expected.detach()).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * expected.detach()).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_bf16_inputs_are_attended_in_float32():
    """As SDPA's math path does: the bf16 values converted first, then scaled and multiplied,
    so the result equals float32 attention on the same values, not a bf16-rounded one."""
    q, k, v = (t.detach().to(torch.bfloat16) * 3 for t in qkv())
    mask = padding_mask()
    out = cpu_kernels._attend(q, k, v, mask, 8**-0.5, NOTHING_DROPPED)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_an_additive_float_mask_equals_the_boolean_one():
    q, k, v = qkv(dtype=torch.float32)
    mask = padding_mask()
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    torch.manual_seed(0)
    with_bool, _ = cpu_kernels.attention_forward(Attention(), q, k, v, mask, dropout=0.2)
    torch.manual_seed(0)
    with_float, _ = cpu_kernels.attention_forward(Attention(), q, k, v, additive, dropout=0.2)
    torch.testing.assert_close(with_bool, with_float)


def test_a_rate_next_to_one_drops_all_but_a_few():
    drop, scale = cpu_kernels.dropped_mask(torch.Size((1 << 16,)), 1 - 1e-6)
    assert scale == 65536 and drop.float().mean() > 0.999


def test_attention_drops_probabilities_and_rescales_the_rest():
    q, k, v = qkv(dtype=torch.float32)
    mask, p = padding_mask(), 0.3
    torch.manual_seed(7)
    out, _ = cpu_kernels.attention_forward(Attention(), q, k, v, mask, dropout=p)
    torch.manual_seed(7)
    dropped, scale = cpu_kernels.dropped_mask(torch.Size((3, 4, 37, 37)), p)
    scores = (q @ k.transpose(-1, -2)) * 8**-0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    expected = (probs.masked_fill(dropped, 0.0) * scale) @ v
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert 0.25 < dropped.float().mean() < 0.35


def test_a_row_with_every_key_masked_stays_finite():
    q, k, v = qkv(dtype=torch.float32)
    mask = padding_mask()
    mask[2, :, 5, :] = False
    out, _ = cpu_kernels.attention_forward(Attention(), q, k, v, mask, dropout=0.1)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_drops_at_its_rate_and_keeps_the_expectation(p):
    x = torch.ones(1 << 20)
    torch.manual_seed(0)
    y = cpu_kernels.cheap_dropout(x, p)
    rate = (y == 0).float().mean().item()
    sd = (p * (1 - p) / x.numel()) ** 0.5
    assert abs(rate - p) < 5 * sd
    assert abs(y.mean().item() - 1.0) < 5 * sd / (1 - p)
    assert torch.equal(torch.unique(y), torch.tensor([0.0, 65536 / (65536 - round(p * 65536))]))
    torch.manual_seed(0)
    assert torch.equal(cpu_kernels.cheap_dropout(x, p), y)  # repeatable from the seed
    assert cpu_kernels.cheap_dropout(x, 0.0) is x
    assert not cpu_kernels.cheap_dropout(x, 1.0).any()


def test_dropout_module_is_the_identity_in_evaluation():
    module = cpu_kernels.Dropout(0.5)
    x = torch.randn(64, 8)
    assert torch.equal(module.eval()(x), x)
    assert (module.train()(x) == 0).any()
    inplace = cpu_kernels.Dropout(0.5, inplace=True).train()
    y = x.clone()
    assert inplace(y) is y and (y == 0).any()


def test_every_other_case_is_left_to_sdpa(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return "sdpa", None

    monkeypatch.setattr(cpu_kernels, "sdpa_attention_forward", spy)
    q, k, v = qkv(dtype=torch.float32)
    mask = padding_mask()
    cases = [
        (Attention(training=False), q, k, v, mask, 0.1),  # inference
        (Attention(), q, k, v, mask, 0.0),  # no dropout
        (Attention(is_causal=True), q, k, v, None, 0.1),  # causal, and no mask says so
        (Attention(), q, k[:, :2], v[:, :2], mask, 0.1),  # grouped key/value heads
        (Attention(), q[:1], k, v, mask, 0.1),  # one query batch broadcast over the keys'
        (Attention(), q, k, v, mask.long(), 0.1),  # an integer mask, which SDPA refuses
    ]
    for module, *tensors, p in cases:
        assert cpu_kernels.attention_forward(module, *tensors, dropout=p)[0] == "sdpa"
    assert len(calls) == len(cases)
    out, _ = cpu_kernels.attention_forward(Attention(), q, k, v, mask, dropout=0.1)
    assert isinstance(out, torch.Tensor) and len(calls) == len(cases)


def set_dropout(model: torch.nn.Module, p: float) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = p


def test_installed_bert_trains_like_sdpa_bert(tiny_model, monkeypatch):
    """A whole model through the kernels: same logits in evaluation, and, with dropout rates
    that drop nothing, the same loss and gradients in training as the SDPA model."""
    monkeypatch.setattr(cpu_kernels, "CHUNK_BYTES", 2 * 10 * 10 * 4)  # several chunks
    store = ModelStore()
    reference = store.build(str(tiny_model), 9, seed=0)
    model = store.build(str(tiny_model), 9, seed=0)
    attended = []
    attend = cpu_kernels._attend
    monkeypatch.setattr(cpu_kernels, "_attend", lambda *a: attended.append(1) or attend(*a))
    assert cpu_kernels.install(model)
    assert model.config._attn_implementation == cpu_kernels.ATTENTION
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(type(m) is cpu_kernels.Dropout for m in dropouts)
    assert store.build(str(tiny_model), 9, seed=0).config._attn_implementation == "sdpa"

    ids = torch.randint(5, 700, (4, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=ids, attention_mask=mask).logits,
                                   reference.eval()(input_ids=ids, attention_mask=mask).logits)
    assert not attended

    losses, grads = [], []
    for m in (model, reference):
        set_dropout(m, NOTHING_DROPPED)
        m.train()
        loss = m(input_ids=ids, attention_mask=mask).logits.square().sum()
        loss.backward()
        losses.append(loss)
        grads.append([p.grad for p in m.parameters()])
    assert attended
    torch.testing.assert_close(losses[0], losses[1])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_a_model_that_does_not_run_sdpa_is_left_alone(tiny_model):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(
        str(tiny_model), num_labels=9, attn_implementation="eager",
        ignore_mismatched_sizes=True)
    assert not cpu_kernels.install(model)
    assert model.config._attn_implementation == "eager"
    assert all(type(m) is torch.nn.Dropout for m in model.modules()
               if isinstance(m, torch.nn.Dropout))


def test_retained_heap_serves_a_steps_activations_without_page_faults():
    """In a fresh process, steps that each make and free four 28 MiB activations: with glibc's
    static defaults (set, so that its dynamic thresholds do not make the outcome depend on
    the process's history) every one is mapped afresh and faulted in page by page; retained,
    the heap is reused. Two warm-up rounds settle the retained heap: after one, 4 runs in 120
    still mapped one tensor afresh (not traced further); after two, none in 150."""
    script = """
import resource, torch
from hpo import memory
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        step = [torch.ones(16, 12, 192, 192) for _ in range(4)]
        del step
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
default = faults()
assert memory.retain_host_heap()
faults()
faults()
print(default, faults())
"""
    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, env=env).stdout
    default, retained = map(int, out.split())
    assert default > 3 * 4 * 6000  # 6,912 pages of 4 KiB per tensor
    assert retained < 100
