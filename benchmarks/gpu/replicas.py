"""Full-size replicas of the `redsm5` study's four models, for the GPU check (no hub there).

What is kept in the repository, under benchmarks/gpu/replicas/FAMILY/, is small: each hub
repository's own config.json (the real sizes: 12 layers of 768, its vocabulary size, its
positions) and tokenizer files in that repository's formats (WordPiece vocab.txt, byte-level
BPE vocab.json + merges.txt, SentencePiece spm.model), learnt from the demo's posts with a
smaller vocabulary than the real one (ids stay below the config's vocabulary size). The
weights are built where the check runs, randomly initialised from the config:

    python benchmarks/gpu/replicas.py write      # here, once: the small files, committed

A replica trains, fits in memory and runs as fast as the real model; only its scores mean
nothing.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KEPT = HERE / "replicas"
# The redsm5 study's models, by the tiny-replica family that has their files' formats.
FAMILIES = {
    "bert-base-uncased": "bert",
    "roberta-base": "roberta",
    "electra-base-discriminator": "electra",
    "deberta-v3-base": "deberta-v3",
}
_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
         "intermediate_size": 3072, "hidden_act": "gelu", "hidden_dropout_prob": 0.1,
         "attention_probs_dropout_prob": 0.1, "initializer_range": 0.02}
# The hub repositories' config.json, as published (google-bert/bert-base-uncased,
# FacebookAI/roberta-base, google/electra-base-discriminator, microsoft/deberta-v3-base).
HUB_CONFIGS = {
    "bert-base-uncased": {**_BASE, "architectures": ["BertForMaskedLM"], "model_type": "bert",
                          "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
                          "pad_token_id": 0, "position_embedding_type": "absolute",
                          "type_vocab_size": 2, "vocab_size": 30522},
    "roberta-base": {**_BASE, "architectures": ["RobertaForMaskedLM"], "model_type": "roberta",
                     "bos_token_id": 0, "eos_token_id": 2, "layer_norm_eps": 1e-05,
                     "max_position_embeddings": 514, "pad_token_id": 1, "type_vocab_size": 1,
                     "vocab_size": 50265},
    "electra-base-discriminator": {**_BASE, "architectures": ["ElectraForPreTraining"],
                                   "model_type": "electra", "embedding_size": 768,
                                   "layer_norm_eps": 1e-12, "max_position_embeddings": 512,
                                   "pad_token_id": 0, "type_vocab_size": 2,
                                   "vocab_size": 30522},
    "deberta-v3-base": {**_BASE, "model_type": "deberta-v2", "layer_norm_eps": 1e-07,
                        "max_position_embeddings": 512, "max_relative_positions": -1,
                        "norm_rel_ebd": "layer_norm", "pad_token_id": 0,
                        "pooler_dropout": 0, "pooler_hidden_act": "gelu",
                        "pooler_hidden_size": 768, "pos_att_type": ["p2c", "c2p"],
                        "position_biased_input": False, "position_buckets": 256,
                        "relative_attention": True, "share_att_key": True,
                        "type_vocab_size": 0, "vocab_size": 128100},
}
TOKENIZER_VOCAB = 8000


def _make_tiny_model():
    sys.path.insert(0, str(REPO / "scripts"))
    import make_tiny_model

    return make_tiny_model


def write(root: Path = KEPT) -> None:
    """Each replica's config.json and tokenizer files, in `root/NAME`."""
    tiny = _make_tiny_model()
    texts = tiny.read_posts(REPO / "data" / "demo")
    for name, family in FAMILIES.items():
        with tempfile.TemporaryDirectory() as scratch:
            made = tiny.make_replica(family, texts, Path(scratch), vocab_size=TOKENIZER_VOCAB)
            target = root / name
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            for path in made.iterdir():
                if path.name not in ("config.json", "model.safetensors", "pytorch_model.bin"):
                    shutil.copy(path, target / path.name)
        (target / "config.json").write_text(json.dumps(HUB_CONFIGS[name], indent=2) + "\n")


def build(name: str, dest: Path, source: Path = KEPT) -> Path:
    """A loadable model directory: the kept files and random weights from the config."""
    import torch
    import transformers

    torch.manual_seed(0)
    shutil.copytree(source / name, dest, dirs_exist_ok=True)
    config = transformers.AutoConfig.from_pretrained(dest)
    architecture = (config.architectures or ["AutoModel"])[0]
    model = (getattr(transformers, architecture)(config) if architecture != "AutoModel"
             else transformers.AutoModel.from_config(config))
    model.save_pretrained(dest)
    return dest


def tiny(name: str, dest: Path) -> Path:
    """The rehearsal's stand-in: a tiny replica of the same family and file formats."""
    tiny_module = _make_tiny_model()
    texts = tiny_module.read_posts(REPO / "data" / "demo")
    return tiny_module.make_replica(FAMILIES[name], texts, dest)


if __name__ == "__main__":
    if sys.argv[1:] != ["write"]:
        raise SystemExit("usage: python benchmarks/gpu/replicas.py write")
    write()
