import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEMO_DATA, H100

from hpo import faults
from hpo.data.batching import Collator, encode
from hpo.data.redsm5 import read_redsm5
from hpo.data.tasks import build_examples
from hpo.hardware import detect, peak_flops
from hpo.training import train as train_module
from hpo.training.flops import model_flops
from hpo.training.models import ModelStore
from hpo.training.train import (
    CompiledOrEager,
    Hooks,
    NonFiniteLoss,
    Paused,
    PauseHere,
    Plan,
    Progress,
    as_epochs,
    balanced_pos_weight,
    evaluation_points,
    micro_batch_loss,
    predict,
    prepare,
    train,
)


@pytest.fixture(scope="module")
def setup(tiny_model):
    store = ModelStore()
    tokenizer = store.tokenizer(str(tiny_model))
    posts = read_redsm5(DEMO_DATA)[:40]
    data = encode(tokenizer, build_examples(posts, "multilabel"), 48)
    return store, tokenizer, data


def gradients(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_accumulated_gradient_equals_one_big_batch(setup, tiny_model):
    store, tokenizer, data = setup
    model = store.build(str(tiny_model), 9, seed=0)
    model.eval()  # no dropout, so both passes see the same function
    collate = Collator(data, tokenizer.pad_token_id)
    weight = balanced_pos_weight(data.labels)
    indices = list(range(10))

    micro_batch_loss(model, collate(indices), 10, weight).backward()
    whole = gradients(model)
    model.zero_grad(set_to_none=True)
    # Micro-batches of 4, 4 and a smaller last one of 2, each padded to its own length.
    for micro in (indices[:4], indices[4:8], indices[8:]):
        micro_batch_loss(model, collate(micro), 10, weight).backward()
    accumulated = gradients(model)
    model.zero_grad(set_to_none=True)
    # Averaging each micro-batch over its own size (a common bug) gives another gradient.
    for micro in (indices[:4], indices[4:8], indices[8:]):
        (micro_batch_loss(model, collate(micro), len(micro), weight) / 3).backward()
    naive = gradients(model)

    assert len(whole) == len(accumulated) > 0
    for a, b in zip(whole, accumulated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-6)
               for a, b in zip(whole, naive, strict=True))


def test_pos_weight_balances_rare_labels():
    labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert balanced_pos_weight(labels).tolist() == [3.0, 1.0, 1.0]


def plan(**changes) -> Plan:
    base = dict(precision="none", effective_batch=8, physical_batch=3, eval_batch=16,
                learning_rate=1e-3, weight_decay=0.0, warmup_ratio=0.1, max_grad_norm=1.0,
                epochs=2, seed=0)
    return Plan(**{**base, **changes})


def test_training_runs_exact_steps_and_reports_each_epoch(setup, tiny_model):
    store, tokenizer, data = setup
    device = detect("cpu")
    p = plan()
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    epochs, steps = [], []
    progress = train(
        model, data, p, device, pad_id=tokenizer.pad_token_id,
        hooks=Hooks(lambda m: 0.5, lambda e, s: epochs.append((e, s)),
                    lambda pr: steps.append(pr.step)),
    )
    assert epochs == [(1, 0.5), (2, 0.5)]
    assert progress.samples == 2 * (40 // 8) * 8
    assert p.grad_accum_steps == 3
    assert 0 < progress.padding_efficiency <= 1
    assert progress.train_seconds >= progress.step_seconds > 0
    assert len(progress.epoch_seconds) == 2 and min(progress.epoch_seconds) > 0
    assert sum(progress.epoch_seconds) == pytest.approx(progress.train_seconds)
    # Every real token of 2 epochs' batches, at the model's FLOPs per token or more.
    flops = model_flops(model)
    assert progress.model_flops >= 6 * flops.trained * progress.real_tokens > 0
    assert progress.flops_per_second == progress.model_flops / progress.step_seconds
    assert progress.mfu is None  # no known peak for a CPU


@pytest.mark.parametrize(("steps", "per_epoch", "points"), [
    (5, 1, [5]), (5, 2, [3, 5]), (6, 3, [2, 4, 6]), (7, 4, [2, 4, 6, 7]), (1, 2, [1, 1]),
])
def test_evaluations_are_spread_evenly_over_an_epoch_the_last_at_its_end(steps, per_epoch,
                                                                          points):
    assert evaluation_points(steps, per_epoch) == points


@pytest.mark.parametrize(("evaluation", "per_epoch", "epochs"), [
    (1, 1, 1), (3, 1, 3), (1, 2, 0.5), (3, 2, 1.5), (4, 2, 2), (1, 3, 0.333),
])
def test_an_evaluation_is_named_in_epochs(evaluation, per_epoch, epochs):
    assert as_epochs(evaluation, per_epoch) == epochs
    assert isinstance(as_epochs(evaluation, per_epoch), int) is (evaluation % per_epoch == 0)


def test_evaluations_inside_epochs_report_each_and_stop_after_ends_the_schedule_there(
        setup, tiny_model, monkeypatch):
    store, tokenizer, data = setup
    device = detect("cpu")
    totals = []
    real = train_module.get_linear_schedule_with_warmup

    def schedule(optimizer, warmup, total):
        totals.append(total)
        return real(optimizer, warmup, total)

    monkeypatch.setattr(train_module, "get_linear_schedule_with_warmup", schedule)
    reports, steps = [], []
    p = plan(evaluations_per_epoch=2)  # 40 posts at 8: 5 steps an epoch, scored after 3 and 5
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    progress = train(model, data, p, device, pad_id=tokenizer.pad_token_id,
                     hooks=Hooks(lambda m: 0.5, lambda i, s: reports.append(i),
                                 lambda pr: steps.append((pr.epoch, pr.step))))
    assert reports == [1, 2, 3, 4] and p.evaluations == 4
    assert len(progress.epoch_seconds) == 4 and totals == [10]
    assert steps[-1] == (2, 5)
    # Stopped after its third evaluation (epoch 1.5): 8 steps, the schedule ending there.
    reports.clear()
    steps.clear()
    p = plan(evaluations_per_epoch=2, stop_after=3)
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    progress = train(model, data, p, device, pad_id=tokenizer.pad_token_id,
                     hooks=Hooks(lambda m: 0.5, lambda i, s: reports.append(i),
                                 lambda pr: steps.append((pr.epoch, pr.step))))
    assert reports == [1, 2, 3] and totals[-1] == 8 and steps[-1] == (2, 3)
    assert progress.samples == 8 * 8


def test_mfu_is_the_achieved_rate_over_the_devices_peak_in_the_trials_precision():
    progress = Progress(model_flops=3e15, step_seconds=10.0,
                        peak_flops=peak_flops(H100, "bf16"))
    assert progress.flops_per_second == 3e14
    assert progress.mfu == pytest.approx(3e14 / 989.4e12)


def _weights_score(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


@pytest.mark.parametrize(("per_epoch", "pause_at", "precision"),
                         [(1, 1, "none"), (2, 3, "none"), (1, 2, "fp16")])
def test_a_paused_run_resumed_in_a_fresh_model_ends_as_the_run_that_never_stopped(
        setup, tiny_model, per_epoch, pause_at, precision):
    import io
    store, tokenizer, data = setup
    device = detect("cpu")
    p = plan(epochs=3, evaluations_per_epoch=per_epoch, precision=precision)
    straight: list[tuple[int, float]] = []
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    whole = train(model, data, p, device, pad_id=tokenizer.pad_token_id,
                  hooks=Hooks(_weights_score, lambda i, s: straight.append((i, s))))

    def pause(index: int, score: float) -> None:
        paused.append((index, score))
        if index == pause_at:
            raise PauseHere

    paused: list[tuple[int, float]] = []
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    with pytest.raises(Paused) as stopped:
        train(model, data, p, device, pad_id=tokenizer.pad_token_id,
              hooks=Hooks(_weights_score, pause))
    assert stopped.value.state.evaluations == pause_at
    # Through the bytes a checkpoint is stored as, into a model built from another seed.
    buffer = io.BytesIO()
    torch.save(stopped.value.state, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    model = prepare(store.build(str(tiny_model), 9, seed=1), p, device)
    resumed = train(model, data, p, device, pad_id=tokenizer.pad_token_id,
                    hooks=Hooks(_weights_score, lambda i, s: paused.append((i, s)),
                                resume=state))
    assert [i for i, _ in paused] == [i for i, _ in straight]
    assert paused == straight  # every step taken once, with the same draws: bit for bit
    assert resumed.samples == whole.samples and resumed.step == whole.step
    assert len(resumed.epoch_seconds) == len(whole.epoch_seconds)


def test_a_resumed_epoch_keeps_each_steps_samples_when_the_micro_batch_changed(setup):
    from hpo.training.train import _epoch_steps

    _, _, data = setup
    lengths = data.lengths
    p = plan(effective_batch=8, physical_batch=2)
    paused_with = train_module.TrainState(3, 7, 2, 1, 3, {}, {}, {}, {}, {}, Progress())
    steps = _epoch_steps(lengths, p, 2, paused_with)
    laid_out = train_module.training_steps(lengths, 8, 3, seed=0, epoch=2)
    assert [sorted(i for m in s for i in m) for s in steps] == [
        sorted(i for m in s for i in m) for s in laid_out]
    assert max(len(m) for s in steps for m in s) == 2
    # Where the micro-batch is the same, the paused run's layout as it was.
    assert _epoch_steps(lengths, plan(physical_batch=3), 2, paused_with) == laid_out


@pytest.mark.parametrize("precision", ["bf16", "fp16", "none"])
def test_autocast_precisions_train_on_cpu_with_a_grad_scaler_for_fp16_only(
        setup, tiny_model, precision, monkeypatch):
    scalers = []

    class Scaler(torch.amp.GradScaler):
        def __init__(self, *args, enabled=True, **kwargs):
            scalers.append(enabled)
            super().__init__(*args, enabled=enabled, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", Scaler)
    store, tokenizer, data = setup
    device = detect("cpu")
    p = plan(precision=precision, epochs=1, effective_batch=20, physical_batch=20)
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    before = [t.clone() for t in model.parameters()]
    progress = train(model, data, p, device, pad_id=tokenizer.pad_token_id,
                     hooks=Hooks(lambda m: 0.0))
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # The scaler's scale is recorded for fp16 (2**16 unless a step overflowed), else nothing.
    if precision == "fp16":
        assert 0 < progress.grad_scale <= 2.0**16
    else:
        assert progress.grad_scale is None
    probabilities = predict(model, data, 7, device, precision, tokenizer.pad_token_id)
    assert probabilities.shape == data.labels.shape
    assert torch.isfinite(probabilities).all()
    assert scalers == [precision == "fp16"]


def test_non_finite_loss_stops_training(setup, tiny_model):
    store, tokenizer, data = setup
    device = detect("cpu")
    p = plan(epochs=1)
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    model.classifier.register_forward_hook(lambda _m, _i, out: out * math.nan)
    with pytest.raises(NonFiniteLoss, match="loss nan at epoch 1, step 1"):
        train(model, data, p, device, pad_id=tokenizer.pad_token_id,
              hooks=Hooks(lambda m: 0.0))


def test_too_few_examples_for_one_step(setup, tiny_model):
    store, tokenizer, data = setup
    device = detect("cpu")
    p = plan(effective_batch=64)
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, device)
    with pytest.raises(ValueError, match="fewer than one effective batch of 64"):
        train(model, data, p, device, pad_id=tokenizer.pad_token_id,
              hooks=Hooks(lambda m: 0.0))


PREPARE_FOR_CUDA = """
import os, sys, torch
from conftest import A100
from hpo.training.models import ModelStore
from hpo.training.train import prepare
import test_train

model = ModelStore().build(sys.argv[1], 9, seed=0)
before_modules = [type(m) for m in model.modules()]
before_imports, before_env = set(sys.modules), dict(os.environ)
moved = []
model.to = lambda device: moved.append(device) or model  # no GPU here: nothing to move to
prepared = prepare(model, test_train.plan(), A100)
assert moved == [torch.device("cuda", 0)], moved
assert prepared is model and prepared.training
assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
assert [type(m) for m in model.modules()] == before_modules
assert not model._forward_pre_hooks and not model._forward_hooks
assert dict(os.environ) == before_env
new = sorted(m for m in set(sys.modules) - before_imports if m.startswith("hpo"))
assert new == [], new
print("ok")
"""


def test_preparing_a_model_for_a_cuda_device_installs_nothing_cpu_specific(tiny_model):
    """The GPU path trains the model as transformers builds it: SDPA attention, PyTorch's
    dropout, no hooks, no new hpo module imported and no environment variable set."""
    result = subprocess.run(
        [sys.executable, "-c", PREPARE_FOR_CUDA, str(tiny_model)],
        capture_output=True, text=True, timeout=300,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("HPO_FAULT_")},
             # conftest (tests/, with benchmarks/ for its postgres helpers) and this module,
             # as the script imports them
             "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                            str(Path(__file__).parents[2] / "benchmarks"),
                                            str(Path(__file__).parent),
                                            os.environ.get("PYTHONPATH", "")])},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def _train_once(model, setup, p):
    store, tokenizer, data = setup
    device = detect("cpu")
    train(model, data, p, device, pad_id=tokenizer.pad_token_id,
          hooks=Hooks(lambda m: 0.0))
    return predict(model, data, 7, device, p.precision, tokenizer.pad_token_id)


@pytest.mark.parametrize("graph", ["forward", "backward"])
def test_a_model_the_compiler_fails_on_trains_eagerly_and_says_why(
        setup, tiny_model, graph, monkeypatch):
    """The backward graph is compiled at the first backward pass, after a forward call that
    went well: the compilation in `prepare` catches it there too."""
    monkeypatch.setenv("HPO_FAULT_COMPILE", graph)
    store = setup[0]
    p = plan(compile=True, epochs=1, effective_batch=20, physical_batch=10)
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, detect("cpu"))
    assert isinstance(model, CompiledOrEager)
    assert model.failure is not None
    assert f"injected: HPO_FAULT_COMPILE={graph}" in model.failure
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    eager = prepare(store.build(str(tiny_model), 9, seed=0), plan(epochs=1), detect("cpu"))
    # Training eagerly is training as if compile were off: the same run, to the bit.
    torch.testing.assert_close(_train_once(model, setup, p),
                               _train_once(eager, setup, plan(epochs=1, effective_batch=20,
                                                              physical_batch=10)),
                               rtol=0, atol=0)


def test_an_out_of_memory_error_in_a_compiled_model_is_not_a_compile_failure(
        setup, tiny_model, monkeypatch):
    monkeypatch.setenv("HPO_FAULT_COMPILE", "forward")
    monkeypatch.setenv("HPO_FAULT_OOM_ABOVE_BATCH", "1")
    with pytest.raises(torch.OutOfMemoryError):
        prepare(setup[0].build(str(tiny_model), 9, seed=0), plan(compile=True), detect("cpu"))


def test_a_mocked_gpu_shared_by_k_workers_holds_a_kth_of_its_batch_in_each(
        setup, tiny_model, monkeypatch):
    from dataclasses import replace

    from hpo.training.train import probe_step

    monkeypatch.setenv("HPO_FAULT_OOM_ABOVE_BATCH", "8")
    half = replace(detect("cpu"), sharing=2)
    model = prepare(setup[0].build(str(tiny_model), 9, seed=0), plan(), half)
    probe_step(model, plan(), half, 4, 8)
    with pytest.raises(torch.OutOfMemoryError, match="micro-batch 5 > "):
        probe_step(model, plan(), half, 5, 8)


def counting_backend(counts: dict[str, int]):
    """An autograd-aware backend that runs the captured graphs as they are and counts each
    forward and backward compilation (torch's documented custom-backend recipe, from the
    private module faults.compile_backend uses too)."""
    from torch._dynamo.backends.common import aot_autograd

    def counted(kind: str):
        def compile_graph(graph_module, _example_inputs):
            counts[kind] += 1
            return graph_module

        return compile_graph

    return aot_autograd(fw_compiler=counted("forward"), bw_compiler=counted("backward"))


def test_a_micro_batch_of_one_sample_is_compiled_before_training(setup, tiny_model,
                                                                 monkeypatch):
    """Issue 30: a batch of one is specialised, so its graphs, backward included, were
    compiled at its first training step, where a compiler failure failed the trial."""
    torch._dynamo.reset()
    counts = {"forward": 0, "backward": 0}
    monkeypatch.setattr(faults, "compile_backend", lambda: counting_backend(counts))
    store, tokenizer, data = setup
    p = plan(compile=True, epochs=1, effective_batch=5, physical_batch=2)  # 2, 2 and 1
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, detect("cpu"))
    assert model.failure is None
    warmed = dict(counts)
    collate = Collator(data, tokenizer.pad_token_id)
    for micro in ([0, 1], [2]):  # the first step's micro-batches, of real lengths
        micro_batch_loss(model, collate(micro), 5).backward()
    assert counts == warmed, "training compiled graphs its warm-up had not"
    assert model.failure is None
    torch._dynamo.reset()


def test_a_model_past_its_recompile_limit_is_recorded_as_running_eagerly(setup, tiny_model,
                                                                         monkeypatch):
    """Issue 30: torch runs a graph past its recompile limit eagerly without saying so, and
    the trial recorded itself compiled. One compilation allowed: the warm-up's evaluation is
    the second."""
    torch._dynamo.reset()
    monkeypatch.setattr(faults, "compile_backend", lambda: "eager")
    with torch._dynamo.config.patch(recompile_limit=1):
        model = prepare(setup[0].build(str(tiny_model), 9, seed=0), plan(compile=True),
                        detect("cpu"))
    assert isinstance(model, CompiledOrEager)
    assert model.failure is not None and "recompile" in model.failure.lower(), model.failure
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_compiled_model_trains_with_the_compiler_and_predicts_as_the_eager_one(
        setup, tiny_model):
    """torch.compile (inductor) on the tiny model: about 40 s of compilation on a cold cache
    here, the reason this test is slow."""
    store = setup[0]
    p = plan(compile=True, epochs=1, effective_batch=20, physical_batch=10)
    model = prepare(store.build(str(tiny_model), 9, seed=0), p, detect("cpu"))
    assert isinstance(model, CompiledOrEager)
    assert model.failure is None
    compiled = _train_once(model, setup, p)
    assert model.failure is None, "the compiler failed after its warm-up"
    assert torch.isfinite(compiled).all()
    eager = prepare(store.build(str(tiny_model), 9, seed=0), plan(epochs=1), detect("cpu"))
    expected = _train_once(eager, setup, plan(epochs=1, effective_batch=20, physical_batch=10))
    # Fused kernels round differently; after one epoch the two runs agree closely.
    torch.testing.assert_close(compiled, expected, rtol=1e-3, atol=1e-3)
