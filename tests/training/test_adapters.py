"""Adapters (peft's LoRA and DoRA) on each family's tiny replica: only the adapters and the
head train, the merged model is a plain transformers model that predicts as the adapted one,
and `hpo run` checks, sizes the batch for and trains none, LoRA and DoRA side by side."""

import copy

import optuna
import pytest
import torch
import yaml
from conftest import study_dict
from optuna.trial import TrialState
from peft import PeftModel
from transformers import AutoModelForSequenceClassification

from hpo.cli import main
from hpo.config import TrainingConfig
from hpo.hardware import detect
from hpo.space import Params
from hpo.training import adapters
from hpo.training.models import ModelStore
from hpo.trial import step_check
from hpo.trial.batch_limit import StudyBatchCache, cache_key

FAMILIES = ("bert", "deberta-v3", "electra", "roberta")


def inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(5, 300, (3, 12), generator=generator),
            "attention_mask": torch.ones((3, 12), dtype=torch.long)}


@pytest.mark.parametrize("method", ["lora", "dora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_and_the_head_are_all_that_trains(replica, family, method):
    model = adapters.build(ModelStore(), str(replica(family)), 9,
                           TrainingConfig(peft=method), "none")
    model(**inputs()).logits.sum().backward()
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    graded = {n for n, p in model.named_parameters() if p.grad is not None}
    assert graded == trains
    body = [n for n in trains if "modules_to_save" not in n]
    assert body and all(".lora_" in n for n in body)  # the body: adapters only
    assert any("lora_magnitude_vector" in n for n in body) == (method == "dora")
    head = {n.split(".modules_to_save")[0].rsplit(".", 1)[-1] for n in trains - set(body)}
    # DeBERTa's pooler is not in its checkpoints: it trains whole, as the classifier does.
    assert head == ({"pooler", "classifier"} if family == "deberta-v3" else {"classifier"})
    # Every linear layer of the body has an adapter: attention and feed-forward alike.
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n in body if ".lora_A" in n}
    attention = {"query_proj", "key_proj", "value_proj"} if family == "deberta-v3" else {
        "query", "key", "value"}
    assert attention | {"dense"} <= adapted
    trainable, total = adapters.trainable_parameters(model)
    assert trainable == sum(model.get_parameter(n).numel() for n in trains) and trainable < total


def test_adapters_start_from_the_training_seed_whatever_the_process_drew_before(tiny_model):
    # `hpo final` retrains a trial's configuration in a process that drew other random numbers
    # first (no check, no batch search); its adapters must start where the trial's did.
    training = TrainingConfig(peft="lora", seed=3)
    store = ModelStore()
    store.build(str(tiny_model), 9, seed=training.seed)  # the head, seeded on first use

    def adapter_weights(draws: int) -> dict[str, torch.Tensor]:
        torch.rand(draws)
        before = torch.get_rng_state()
        model = adapters.build(store, str(tiny_model), 9, training, "none")
        assert torch.equal(torch.get_rng_state(), before)  # the caller's stream is untouched
        return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_A" in n}

    first, second = adapter_weights(1), adapter_weights(1000)
    assert first and first.keys() == second.keys()
    assert all(torch.equal(first[n], second[n]) for n in first)
    other_seed = adapters.build(store, str(tiny_model), 9, TrainingConfig(peft="lora", seed=4),
                                "none")
    assert not all(torch.equal(p, first[n]) for n, p in other_seed.named_parameters()
                   if n in first)


def test_the_optimizer_holds_only_what_trains(tiny_model):
    from hpo.training.train import Plan, make_optimizer

    plan = Plan(precision="none", effective_batch=8, physical_batch=8, eval_batch=8,
                learning_rate=1e-4, weight_decay=0.01, warmup_ratio=0.0, max_grad_norm=1.0,
                epochs=1, seed=0)
    model = adapters.build(ModelStore(), str(tiny_model), 9, TrainingConfig(peft="lora"),
                           "none")
    held = sum(p.numel() for group in make_optimizer(model, plan, detect("cpu")).param_groups
               for p in group["params"])
    assert held == adapters.trainable_parameters(model)[0]


def test_full_fine_tuning_trains_everything(tiny_model):
    model = adapters.build(ModelStore(), str(tiny_model), 9, TrainingConfig(), "none")
    assert not isinstance(model, PeftModel)
    trainable, total = adapters.trainable_parameters(model)
    assert trainable == total


@pytest.mark.parametrize(("family", "method"), [("bert", "lora"), ("deberta-v3", "dora"),
                                                ("roberta", "dora")])
def test_a_merged_model_is_plain_transformers_and_predicts_the_same(replica, tmp_path, family,
                                                                    method):
    model = adapters.build(ModelStore(), str(replica(family)), 9,
                           TrainingConfig(peft=method, lora_dropout=0.0), "none")
    with torch.no_grad():  # trained adapters: LoRA's B starts at zero
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    model.eval()
    adapted = model(**inputs()).logits
    plain = adapters.merged(model)
    assert not isinstance(plain, PeftModel)
    torch.testing.assert_close(plain(**inputs()).logits, adapted, atol=1e-5, rtol=1e-4)
    plain.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(**inputs()).logits, adapted, atol=1e-5, rtol=1e-4)


def test_a_bfloat16_body_is_only_for_bf16_adapter_trials(tiny_model):
    training = TrainingConfig(peft="lora", base_dtype="bfloat16")
    model = adapters.build(ModelStore(), str(tiny_model), 9, training, "bf16")
    dtypes = {p.dtype for p in model.parameters() if not p.requires_grad}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**inputs()).logits.float().sum().backward()
    no_autocast = adapters.build(ModelStore(), str(tiny_model), 9, training, "none")
    assert {p.dtype for p in no_autocast.parameters()} == {torch.float32}
    full = adapters.build(ModelStore(), str(tiny_model), 9,
                          TrainingConfig(base_dtype="bfloat16"), "bf16")
    assert {p.dtype for p in full.parameters()} == {torch.float32}  # full fine-tuning


def test_adapters_merge_into_a_bfloat16_body_in_float32(tiny_model):
    training = TrainingConfig(peft="lora", base_dtype="bfloat16", lora_dropout=0.0)
    model = adapters.build(ModelStore(), str(tiny_model), 9, training, "bf16")
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn_like(param))
    reference = copy.deepcopy(model).to(torch.float32).eval()(**inputs()).logits
    plain = adapters.merged(model).eval()
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    # Rounding the update to bfloat16 would be off by about 1e-3.
    torch.testing.assert_close(plain(**inputs()).logits, reference, atol=2e-5, rtol=1e-4)


def test_the_batch_cache_keys_tell_adapter_settings_apart():
    params = Params("m", "bf16", 16, 1e-4)
    device = detect("cpu")
    keys = {cache_key(params, TrainingConfig(**settings), 128, device) for settings in (
        {}, {"peft": "lora"}, {"peft": "lora", "lora_r": 16}, {"peft": "dora"},
        {"peft": "lora", "base_dtype": "bfloat16"}, {"peft": "lora", "lora_dropout": 0.0})}
    assert len(keys) == 6
    # Full fine-tuning keeps the key it had before adapters existed: caches stay valid.
    assert cache_key(params, TrainingConfig(), 128, device) == f"m|bf16|128|{device.cache_key}"


@pytest.mark.parametrize("family", FAMILIES)
def test_hpo_run_checks_sizes_and_trains_none_lora_and_dora(replica, small_data, tmp_path,
                                                            monkeypatch, family):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = study_dict([replica(family)], small_data)
    spec["study"].update(name="tiny", enqueue=[{"peft": m} for m in ("none", "lora", "dora")])
    spec["search_space"].update(peft=["none", "lora", "dora"], lora_r=[4, 8],
                                target_effective_batch_size=[8])
    path = tmp_path / "peft.yaml"
    path.write_text(yaml.safe_dump(spec))
    storage = f"sqlite:///{tmp_path / 'peft.db'}"
    assert main(["run", "--config", str(path), "--storage", storage, "--n-trials", "3"]) == 0
    study = optuna.load_study(study_name="tiny", storage=storage)
    trials = {t.params["peft"]: t for t in study.trials}
    assert set(trials) == {"none", "lora", "dora"}
    for method, trial in trials.items():
        assert trial.state == TrialState.COMPLETE, trial.user_attrs.get("error")
        assert trial.user_attrs["training"]["peft"] == method
        assert (trial.user_attrs["trainable_share"] == 1.0) == (method == "none")
        assert ("lora_r" in trial.params) == (method != "none")  # sampled only with adapters
    verdicts = study.user_attrs[step_check.key(detect("cpu"))]
    assert {(v["precision"], v["peft"]) for v in verdicts} == {
        ("none", m) for m in ("none", "lora", "dora")}
    batches = [k for k in study.user_attrs if k.startswith(StudyBatchCache.PREFIX)]
    assert len(batches) == 3  # one batch search per adapter setting
    assert any("|lora:" in k for k in batches) and any("|dora:" in k for k in batches)


def test_the_model_card_names_the_body_dtype_the_trial_trained_with():
    from hpo.training.export import _adapters

    training = TrainingConfig(peft="lora", base_dtype="bfloat16").model_dump(mode="json")
    assert "body in bfloat16 during training" in _adapters(training, "bf16")
    assert "body in float32 during training" in _adapters(training, "none")
    assert _adapters(TrainingConfig().model_dump(mode="json"), "bf16") == ""
