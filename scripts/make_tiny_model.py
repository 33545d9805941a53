"""Build tiny, randomly initialised models with vocabularies learnt from a corpus.

The demo study's second model choice (no hub needed) and the tests' fixture model:

    python scripts/make_tiny_model.py data/demo data/demo/models/tiny-bert

reads the posts of a ReDSM5-format directory and writes a model directory that
transformers' Auto classes load like any other. With --family it writes a tiny replica of a
model family of the shipped studies instead, with the files its hub repository ships, in their
formats, so that what loads here loads there:

    python scripts/make_tiny_model.py data/demo /tmp/tiny-deberta-v3 --family deberta-v3

- bert (google-bert/bert-base-uncased): config.json, model.safetensors, WordPiece vocab.txt,
  tokenizer.json, tokenizer_config.json {do_lower_case, model_max_length};
- roberta (FacebookAI/roberta-base): config.json, model.safetensors, byte-level BPE vocab.json
  and merges.txt, tokenizer.json, no tokenizer_config.json;
- electra (google/electra-base-discriminator): config.json, model.safetensors, vocab.txt,
  tokenizer.json, tokenizer_config.json {do_lower_case};
- deberta-v3 (microsoft/deberta-v3-base): config.json, pytorch_model.bin, SentencePiece
  spm.model and tokenizer_config.json {do_lower_case, vocab_type}, no tokenizer.json (so
  transformers converts spm.model, which needs sentencepiece and protobuf).

Deterministic for a given corpus.
"""

from __future__ import annotations

import argparse
import csv
import json
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


FAMILIES = ("bert", "roberta", "electra", "deberta-v3")


def make_replica(
    family: str, texts: list[str], out_dir: Path, *, vocab_size: int = 800, hidden: int = 32,
    layers: int = 2, heads: int = 2, max_positions: int = 512, seed: int = 0,
) -> Path:
    """A tiny replica of `family` (one of FAMILIES) in `out_dir`."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
             "intermediate_size": 4 * hidden}
    torch.manual_seed(seed)
    if family in ("bert", "electra"):
        vocab = _wordpiece(texts, out_dir, vocab_size)
        if family == "bert":
            config = transformers.BertConfig(vocab_size=vocab, pad_token_id=0,
                                             max_position_embeddings=max_positions, **sizes)
            model = transformers.BertForMaskedLM(config)
            _write_json(out_dir / "tokenizer_config.json",
                        {"do_lower_case": True, "model_max_length": max_positions})
        else:
            config = transformers.ElectraConfig(vocab_size=vocab, embedding_size=hidden // 2,
                                                pad_token_id=0,
                                                max_position_embeddings=max_positions, **sizes)
            model = transformers.ElectraForPreTraining(config)
            _write_json(out_dir / "tokenizer_config.json", {"do_lower_case": True})
        model.save_pretrained(out_dir)
    elif family == "roberta":
        vocab = _byte_level_bpe(texts, out_dir, vocab_size)
        # RoBERTa's position ids start after the padding index: 2 more positions than tokens.
        config = transformers.RobertaConfig(vocab_size=vocab, pad_token_id=1, bos_token_id=0,
                                            eos_token_id=2, type_vocab_size=1,
                                            max_position_embeddings=max_positions + 2, **sizes)
        transformers.RobertaForMaskedLM(config).save_pretrained(out_dir)
    elif family == "deberta-v3":
        vocab = _sentencepiece(texts, out_dir, vocab_size)
        config = transformers.DebertaV2Config(
            vocab_size=vocab, max_position_embeddings=max_positions, relative_attention=True,
            position_buckets=256, norm_rel_ebd="layer_norm", share_att_key=True,
            pos_att_type="p2c|c2p", layer_norm_eps=1e-7, max_relative_positions=-1,
            position_biased_input=False, type_vocab_size=0, pad_token_id=0, **sizes)
        model = transformers.DebertaV2ForMaskedLM(config)
        config.save_pretrained(out_dir)
        # The hub repository ships PyTorch's pickle format, not safetensors.
        torch.save(model.state_dict(), out_dir / "pytorch_model.bin")
        _write_json(out_dir / "tokenizer_config.json",
                    {"do_lower_case": False, "vocab_type": "spm"})
    else:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    return out_dir


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _wordpiece(texts: list[str], out_dir: Path, vocab_size: int) -> int:
    from tokenizers.processors import TemplateProcessing

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(
        texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIAL))
    tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    vocab = tokenizer.get_vocab()
    ordered = sorted(vocab, key=vocab.__getitem__)
    (out_dir / "vocab.txt").write_text("\n".join(ordered) + "\n", encoding="utf-8")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return len(ordered)


def _byte_level_bpe(texts: list[str], out_dir: Path, vocab_size: int) -> int:
    from tokenizers import ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing

    special = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=special)
    bpe.save_model(str(out_dir))  # vocab.json and merges.txt
    bpe.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    bpe.save(str(out_dir / "tokenizer.json"))
    return bpe.get_vocab_size()


def _sentencepiece(texts: list[str], out_dir: Path, vocab_size: int) -> int:
    import sentencepiece

    # DeBERTa-v3's layout: [PAD] 0, [CLS] 1, [SEP] 2, [UNK] 3, a unigram model, [MASK].
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_prefix=str(out_dir / "spm"),
        vocab_size=vocab_size, model_type="unigram", character_coverage=1.0,
        pad_id=0, pad_piece="[PAD]", bos_id=1, bos_piece="[CLS]", eos_id=2, eos_piece="[SEP]",
        unk_id=3, unk_piece="[UNK]", user_defined_symbols=["[MASK]"], hard_vocab_limit=False,
        minloglevel=2)
    (out_dir / "spm.vocab").unlink()
    return sentencepiece.SentencePieceProcessor(model_file=str(out_dir / "spm.model")
                                                ).get_piece_size()


def read_posts(directory: Path) -> list[str]:
    with (directory / "redsm5_posts.csv").open(encoding="utf-8-sig", newline="") as handle:
        return [row["text"] for row in csv.DictReader(handle)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--family", choices=FAMILIES,
                        help="a replica of this family, in its hub repository's file formats")
    args = parser.parse_args(argv)
    if args.family:
        make_replica(args.family, read_posts(args.data_dir), args.out_dir, hidden=args.hidden,
                     layers=args.layers)
    else:
        make_tiny_bert(read_posts(args.data_dir), args.out_dir, hidden=args.hidden,
                       layers=args.layers)
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
