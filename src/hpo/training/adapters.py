"""Parameter-efficient fine-tuning: peft's LoRA or DoRA adapters on a frozen pretrained body,
the classifier's own modules trained whole, and the adapters merged back for export.

The adapted modules are found per model, not per architecture name: every linear layer of
the pretrained body (peft's "all-linear": BERT's and ELECTRA's query/key/value/dense,
DeBERTa-v2's query_proj/key_proj/value_proj/dense), unless the study file names them
(`training.lora_target_modules`). The head is every module outside the body: the
classifier, and DeBERTa-v2's pooler, which its checkpoints do not hold.
"""

from __future__ import annotations

import warnings

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import PreTrainedModel

from hpo.config import TrainingConfig
from hpo.training.models import ModelStore


def describe(training: TrainingConfig) -> str:
    """The trial's adapter settings in one phrase ("none" without adapters)."""
    if training.peft == "none":
        return "none"
    return (f"{training.peft} r={training.lora_r} alpha={training.adapter_alpha():g} "
            f"dropout={training.lora_dropout:g}")


def cache_suffix(training: TrainingConfig, precision: str) -> str:
    """What the adapters change in a batch's memory, for the batch-size cache key: the
    method (DoRA holds more activations) and rank, a body kept in bfloat16, and dropout
    (which keeps a dropped copy of each adapted layer's input)."""
    if training.peft == "none":
        return ""
    dropout = ":dropout" if training.lora_dropout > 0 else ""
    return f"|{training.peft}:{training.lora_r}:{body_dtype(training, precision)}{dropout}"


def body_dtype(training: TrainingConfig, precision: str) -> str:
    """The body's weights stay in bfloat16 only for adapter trials in bf16: without
    autocast a float32 head could not take a bfloat16 body's output."""
    wanted = training.base_dtype == "bfloat16" and training.peft != "none"
    return "bfloat16" if wanted and precision == "bf16" else "float32"


def head_modules(model: PreTrainedModel) -> list[str]:
    """The modules of the classifier outside its pretrained body that hold weights."""
    body = model.base_model_prefix
    return [name for name, child in model.named_children()
            if name != body and any(True for _ in child.parameters())]


def attach(model: PreTrainedModel, training: TrainingConfig, precision: str) -> torch.nn.Module:
    """`model` with the trial's adapters (itself without): only the adapters and the head
    train. Adapters are float32 whatever the body's dtype, and so is the head."""
    if training.peft == "none":
        return model
    if body_dtype(training, precision) == "bfloat16":
        # transformers wraps `to` in functools.wraps(Module.to), which mypy reads unbound.
        model.to(torch.bfloat16)  # type: ignore[arg-type]
    config = LoraConfig(
        # peft annotates lora_alpha as int; it takes any number (its scale is alpha / r).
        task_type=TaskType.SEQ_CLS, r=training.lora_r,
        lora_alpha=training.adapter_alpha(),  # type: ignore[arg-type]
        lora_dropout=training.lora_dropout, use_dora=training.peft == "dora",
        target_modules=training.lora_target_modules or "all-linear",
        modules_to_save=head_modules(model),
    )
    # The adapters' random initialisation from the training seed, not from whatever the
    # process drew before (a check, a batch search): `hpo final` and every worker then
    # start a configuration from the same weights as its trial did.
    with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        # peft 0.21 asks transformers 5 for its deprecated `is_gradient_checkpointing`.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing",
                                category=FutureWarning)
        torch.manual_seed(training.seed)
        adapted = get_peft_model(model, config, autocast_adapter_dtype=True)
    for param in adapted.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    return adapted


def build(models: ModelStore, name: str, num_labels: int, training: TrainingConfig,
          precision: str) -> torch.nn.Module:
    """A fresh classifier for a trial of these training settings, with its adapters."""
    return attach(models.build(name, num_labels, seed=training.seed), training, precision)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """The parameters that train and all of them (for an adapted model as peft counts them:
    the adapters, and the head's frozen original beside its trained copy)."""
    if isinstance(model, PeftModel):
        return model.get_nb_trainable_parameters()
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain float32 transformers model: the adapters folded into the body's weights (in
    float32, so a bfloat16 body does not round the update away) and the trained head in
    place of the original, which any pipeline loads. Consumes `model`."""
    model = model.to(torch.float32)
    if isinstance(model, PeftModel):
        return model.merge_and_unload()
    return model
