"""Tokenized splits kept on disk, so the workers on one machine (and every later run) read what
the first one tokenized instead of tokenizing again.

An entry is a safetensors file named by a hash of everything the ids depend on: the tokenizer
(its full serialized pipeline, vocabulary included), max_length and every example's text and
text pair. Labels are not stored; they come from the examples. Entries are written to a
temporary file and renamed into place, so a reader never sees half an entry and two workers
that tokenize at once both write the same bytes. A cache that cannot be read or written costs
the tokenization, never the trial.

Location: `$HPO_CACHE_DIR/tokens`, else `$XDG_CACHE_HOME/hpo/tokens`, else
`~/.cache/hpo/tokens`; `HPO_CACHE_DIR=off` turns the disk cache off. Nothing is evicted;
deleting the directory is always safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hpo.data.batching import Encoded, encode, labels_of
from hpo.data.tasks import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FORMAT = 1  # part of every key: bump it when `encode` changes what it produces
log = logging.getLogger(__name__)


def default_dir() -> Path | None:
    configured = os.environ.get("HPO_CACHE_DIR")
    if configured is not None:
        return None if configured.strip().lower() in ("", "off") else Path(configured) / "tokens"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hpo" / "tokens"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """A hash of the tokenizer's whole pipeline; None for a tokenizer without a serializable
    backend (those are not cached on disk)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    pipeline = json.loads(backend.to_str())
    # Truncation and padding are call settings the tokenizer keeps from its last call; the ids
    # depend on the ones `encode` passes, which the key holds separately.
    pipeline.pop("truncation", None)
    pipeline.pop("padding", None)
    serialized = json.dumps([type(tokenizer).__name__, pipeline], sort_keys=True)
    return hashlib.sha256(serialized.encode()).hexdigest()


def entry_key(tokenizer_hash: str, examples: Sequence[Example], max_length: int) -> str:
    digest = hashlib.sha256(f"hpo-tokens-v{FORMAT}|{tokenizer_hash}|{max_length}".encode())
    for e in examples:
        digest.update(json.dumps([e.text, e.text_pair]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def cached_encode(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example], max_length: int,
    directory: Path | None,
) -> tuple[Encoded, bool]:
    """`encode`, through the disk cache in `directory` (None: no disk cache). Returns the
    encoded examples and whether they came from the cache."""
    fingerprint = tokenizer_fingerprint(tokenizer) if directory is not None else None
    if directory is None or fingerprint is None:
        return encode(tokenizer, examples, max_length), False
    path = directory / f"{entry_key(fingerprint, examples, max_length)}.safetensors"
    stored = _read(path, len(examples))
    if stored is not None:
        tokens, offsets, token_types = stored
        return Encoded(tokens, offsets, token_types, labels_of(examples)), True
    encoded = encode(tokenizer, examples, max_length)
    _write(path, encoded)
    return encoded, False


Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # tokens, offsets, types


def _read(path: Path, count: int) -> Packed | None:
    try:
        tensors = load_file(path)
    except FileNotFoundError:
        return None
    except (OSError, SafetensorError) as exc:
        log.warning("token cache entry %s is unreadable, tokenizing again: %s", path, exc)
        return None
    tokens, offsets = tensors.get("tokens"), tensors.get("offsets")
    if (
        tokens is None
        or offsets is None
        or offsets.numel() != count + 1
        or int(offsets[-1]) != tokens.numel()
    ):
        log.warning("token cache entry %s does not match its key, tokenizing again", path)
        return None
    return tokens, offsets, tensors.get("token_types")


def _write(path: Path, encoded: Encoded) -> None:
    tensors = {"tokens": encoded.tokens, "offsets": encoded.offsets}
    if encoded.token_types is not None:
        tensors["token_types"] = encoded.token_types
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, temporary)
        os.replace(temporary, path)
    except (OSError, SafetensorError) as exc:
        # A full disk or a read-only volume: safetensors reports a failed write as its own
        # error, not an OSError. A cache may cost time, never the trial.
        log.warning("token cache %s is not writable, not caching: %s", path.parent, exc)
        with contextlib.suppress(OSError):
            temporary.unlink()
