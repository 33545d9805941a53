"""Build a tiny, randomly initialised BERT with a WordPiece vocabulary learnt from a corpus.

The demo study's second model choice (no hub needed) and the tests' fixture model:

    python scripts/make_tiny_model.py data/demo data/demo/models/tiny-bert

reads the posts of a ReDSM5-format directory and writes a model directory that
transformers' Auto classes load like any other. Deterministic for a given corpus.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def make_tiny_bert(
    texts: Iterable[str],
    out_dir: Path,
    *,
    vocab_size: int = 2000,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    max_positions: int = 512,
    seed: int = 0,
) -> Path:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL)
    )
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    from tokenizers.processors import TemplateProcessing

    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", model_max_length=max_positions,
    )
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.token_to_id("[PAD]"),
    )
    model = BertForSequenceClassification(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    fast.save_pretrained(out_dir)
    return out_dir


def read_posts(directory: Path) -> list[str]:
    with (directory / "redsm5_posts.csv").open(encoding="utf-8-sig", newline="") as handle:
        return [row["text"] for row in csv.DictReader(handle)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    make_tiny_bert(read_posts(args.data_dir), args.out_dir, hidden=args.hidden,
                   layers=args.layers)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
