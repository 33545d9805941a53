"""Training throughput: hpo's training loop against transformers' Trainer (max_length padding,
dynamic padding by its default collator, and dynamic padding with length grouping) on the same
model, data, batch, precision, learning rate and max_length; and padding efficiency (real
tokens / tokens processed in training). Each configuration runs in a fresh process.

    PYTHONPATH=src python benchmarks/throughput.py [--train 400] [--validation 100]
        [--max-length 256] [--precision bf16|none] [--learning-rate 5e-5] [--epochs 2]
        [--pos-weight balanced|none] [--repeats 1] [--model NAME_OR_DIR] [--length-noise X]
        [--rank-blur X]
        [--rows hpo max_length default grouped]

Repeat k trains every configuration with training seed k (dropout and batch order; the
classification head starts from seed 0 in every run): a training run this short is chaotic,
and a change of kernels alone (widths rounded to 8 instead of 16) moved one seed's macro-F1 by
0.08, far more than the bootstrap over validation posts allows for. Samples/s are the median
over repeats, scores the mean, and score differences are paired by seed.

Posts are synthetic, ReDSM5-like: lognormal word counts (mean 295, capped at 6,990), each one
demo post (data/demo; it gives the labels) followed by label-free demo posts as filler; train
and validation take their labelled posts from disjoint halves of the demo. Samples/s counts
training only (no tokenization, no evaluation); every run is scored by `hpo.training.train.predict`
on its final model (threshold 0.5). Prints a markdown report for benchmarks/README.md.

A goal's verdict is the median over training seeds of hpo's samples/s over the other row's at
the same seed, not the ratio of the medians: the runs of one repeat follow each other within
minutes, while a machine's speed drifts by 30% between hours (the Trainer's rows in a VM's
first half hour). `--rows hpo grouped --repeats 4` runs only hpo's loop and the Trainer's best
set-up, alternately, so that each pair is closer still.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import accelerate
import torch
import transformers
from transformers import DataCollatorWithPadding, Trainer, TrainingArguments
from transformers.trainer_callback import PrinterCallback

from hpo.data import batching
from hpo.data.batching import Encoded, encode
from hpo.data.redsm5 import SYMPTOMS, Post, read_redsm5
from hpo.data.tasks import Example, build_examples
from hpo.hardware import Device, configure_backends, detect, native_precisions
from hpo.training.memory import long_lived_frozen
from hpo.training.metrics import f1_scores
from hpo.training.models import ModelStore, quiet_transformers
from hpo.training.train import Hooks, Plan, balanced_pos_weight, predict, prepare, train

REPO = Path(__file__).resolve().parents[1]
MEAN_WORDS, MAX_WORDS, SIGMA = 295, 6990, 1.0
BATCH, WEIGHT_DECAY, WARMUP, MAX_GRAD_NORM, SEED = 16, 0.01, 0.1, 1.0, 0
EVAL_BATCH = 32
OURS = "hpo training loop"
TRAINER_MAX = "Trainer, max_length padding"
TRAINER_DEFAULT = "Trainer, dynamic padding (its default collator)"
TRAINER_GROUPED = "Trainer, dynamic padding + group_by_length"
# hpo's samples/s over each Trainer set-up's, at an equal score (the default collator's is
# reported, its goal is implied by group_by_length's, the Trainer's best set-up).
GOALS = {TRAINER_MAX: 1.3, TRAINER_GROUPED: 1.15}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def synthetic_posts(n: int, seeds: list[Post], filler: list[str], rng: random.Random,
                    prefix: str) -> list[Post]:
    # Stratified lognormal quantiles (shuffled), so the sample's mean and tail are stable.
    mu = math.log(MEAN_WORDS) - SIGMA**2 / 2  # the lognormal's mean is exp(mu + sigma^2 / 2)
    normal = statistics.NormalDist()
    targets = [min(MAX_WORDS, max(5, round(math.exp(mu + SIGMA * normal.inv_cdf((k + 0.5) / n)))))
               for k in range(n)]
    rng.shuffle(targets)
    posts = []
    for k, target in enumerate(targets):
        seed = rng.choice(seeds)
        words = seed.text.split()
        while len(words) < target:
            words += rng.choice(filler).split()
        posts.append(Post(f"{prefix}{k}", " ".join(words[:max(target, len(seed.text.split()))]),
                          seed.symptoms))
    return posts


def corpus(n_train: int, n_val: int, seed: int) -> tuple[list[Example], list[Example]]:
    demo = read_redsm5(REPO / "data" / "demo")
    rng = random.Random(seed)
    order = rng.sample(demo, len(demo))
    filler = [p.text for p in demo if not p.symptoms]
    half = len(order) // 2
    train_posts = synthetic_posts(n_train, order[:half], filler, rng, "train_")
    val_posts = synthetic_posts(n_val, order[half:], filler, rng, "val_")
    return build_examples(train_posts, "multilabel"), build_examples(val_posts, "multilabel")


@dataclass
class Result:
    run: str
    samples_per_second: float
    padding_efficiency: float
    macro_f1: float
    micro_f1: float
    seconds: float
    probabilities: list[torch.Tensor]  # one per training seed
    tokens_per_second: float = 0.0  # processed (padded) tokens: what a step costs on a GPU


@dataclass
class CountingCollator:
    """Wraps a data collator; counts the samples and the real and processed tokens."""

    inner: Callable[[list[dict]], dict[str, torch.Tensor]]
    samples: int = 0
    real: int = 0
    processed: int = 0

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.inner(features)
        mask = batch["attention_mask"]
        self.samples += mask.shape[0]
        self.real += int(mask.sum())
        self.processed += mask.numel()
        return batch


@dataclass(frozen=True)
class Bench:
    """What every run shares: settings, device, model store, the data, the loss weight."""

    args: argparse.Namespace
    device: Device
    store: ModelStore
    tokenizer: transformers.PreTrainedTokenizerBase
    train_examples: list[Example]
    val_examples: list[Example]
    train_data: Encoded
    val: Encoded
    pos_weight: torch.Tensor | None

    def score(self, run: str, model: torch.nn.Module, samples: int, seconds: float,
              efficiency: float, processed: int) -> Result:
        pad_id = self.tokenizer.pad_token_id or 0
        probabilities = predict(model, self.val, EVAL_BATCH, self.device, self.args.precision,
                                pad_id)
        scores = f1_scores(probabilities >= 0.5, self.val.labels, SYMPTOMS)
        return Result(run, samples / seconds, efficiency, scores.macro_f1, scores.micro_f1,
                      seconds, [probabilities], processed / seconds)


def run_ours(b: Bench, run: str) -> Result:
    plan = Plan(precision=b.args.precision, effective_batch=b.args.batch,
                physical_batch=b.args.batch, eval_batch=EVAL_BATCH,
                learning_rate=b.args.learning_rate,
                weight_decay=WEIGHT_DECAY, warmup_ratio=WARMUP, max_grad_norm=MAX_GRAD_NORM,
                epochs=b.args.epochs, seed=b.args.training_seed, pos_weight=b.args.pos_weight)
    model = prepare(b.store.build(b.args.model, len(SYMPTOMS), seed=0), plan, b.device)
    started = time.perf_counter()
    progress = train(model, b.train_data, plan, b.device, pad_id=b.tokenizer.pad_token_id or 0,
                     hooks=Hooks(lambda _: 0.0))
    seconds = time.perf_counter() - started
    return b.score(run, model, progress.samples, seconds, progress.padding_efficiency,
                   progress.padded_tokens)


def run_trainer(b: Bench, run: str) -> Result:
    dynamic = run != TRAINER_MAX
    encoded = b.tokenizer([e.text for e in b.train_examples], truncation=True,
                          max_length=b.args.max_length, padding=False if dynamic else "max_length")
    dataset = [{**{k: v[i] for k, v in encoded.items()}, "labels": list(e.labels)}
               for i, e in enumerate(b.train_examples)]
    collator = CountingCollator(DataCollatorWithPadding(b.tokenizer))
    # Without pos_weight the model's own loss (BCEWithLogitsLoss, mean) is used, as by default;
    # with it, the same mean BCE with the same pos_weight as the hpo run.
    loss = None if b.pos_weight is None else lambda out, labels, **_: (
        torch.nn.functional.binary_cross_entropy_with_logits(
            out.logits.float(), labels, pos_weight=b.pos_weight.to(out.logits.device)))
    model = b.store.build(b.args.model, len(SYMPTOMS), seed=0)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=b.args.batch,
            learning_rate=b.args.learning_rate,
            num_train_epochs=b.args.epochs, weight_decay=WEIGHT_DECAY,
            warmup_steps=WARMUP,  # transformers 5: a float < 1 is a ratio (warmup_ratio is gone)
            max_grad_norm=MAX_GRAD_NORM, bf16=b.args.precision == "bf16",
            use_cpu=b.device.type == "cpu", optim="adamw_torch_fused",
            report_to=[], save_strategy="no", eval_strategy="no", logging_strategy="no",
            dataloader_num_workers=0, seed=b.args.training_seed, lr_scheduler_type="linear",
            disable_tqdm=True,
            train_sampling_strategy="group_by_length" if run == TRAINER_GROUPED else "random",
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                          data_collator=collator, processing_class=b.tokenizer,
                          compute_loss_func=loss)
        trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    model = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)
    return b.score(run, model, collator.samples, seconds, collator.real / collator.processed,
                   collator.processed)


def warm_up(store: ModelStore, args: argparse.Namespace, device: Device) -> None:
    """One untimed training step at a short and the full length, so that the first timed run
    does not pay the process's one-time costs (thread pools, kernel selection)."""
    model = store.build(args.model, len(SYMPTOMS), seed=0).to(device.torch_device)
    vocab = model.config.vocab_size
    for length in (32, args.max_length):
        inputs = {"input_ids": torch.randint(min(1000, vocab // 2), min(2000, vocab),
                                             (args.batch, length)),
                  "attention_mask": torch.ones((args.batch, length), dtype=torch.long)}
        inputs = {name: tensor.to(device.torch_device) for name, tensor in inputs.items()}
        with torch.autocast(device.type, torch.bfloat16, enabled=args.precision == "bf16"):
            loss = model(**inputs).logits.float().sum()
        loss.backward()


def combined(results: list[Result]) -> Result:
    """Over the repeats (one per training seed): the median speed, the mean scores, every
    repeat's probabilities in seed order (for the bootstrap)."""
    speed = ("samples_per_second", "padding_efficiency", "seconds", "tokens_per_second")
    medians = {f: statistics.median(getattr(r, f) for r in results) for f in speed}
    means = {f: statistics.mean(getattr(r, f) for r in results) for f in ("macro_f1", "micro_f1")}
    return Result(results[0].run, **medians, **means,
                  probabilities=[p for r in results for p in r.probabilities])


def paired_bootstrap(a: list[torch.Tensor], b: list[torch.Tensor], gold: torch.Tensor,
                     n: int = 2000) -> tuple[float, float]:
    """95% interval of the mean over training seeds of macro-F1(a) - macro-F1(b), each seed's
    runs paired, over validation posts resampled together."""
    generator = torch.Generator().manual_seed(0)
    diffs = []
    for _ in range(n):
        rows = torch.randint(0, len(gold), (len(gold),), generator=generator)
        diffs.append(statistics.mean(
            f1_scores(x[rows] >= 0.5, gold[rows], SYMPTOMS).macro_f1
            - f1_scores(y[rows] >= 0.5, gold[rows], SYMPTOMS).macro_f1
            for x, y in zip(a, b, strict=True)))
    diffs.sort()
    return diffs[int(0.025 * n)], diffs[int(0.975 * n) - 1]


RUNS = (OURS, TRAINER_MAX, TRAINER_DEFAULT, TRAINER_GROUPED)
ROWS = dict(zip(("hpo", "max_length", "default", "grouped"), RUNS, strict=True))


def load_bench(args: argparse.Namespace, device: Device) -> Bench:
    train_examples, val_examples = corpus(args.train, args.validation, args.seed)
    store = ModelStore()
    tokenizer = store.tokenizer(args.model)
    train_data = encode(tokenizer, train_examples, args.max_length)
    val = encode(tokenizer, val_examples, args.max_length)
    weight = balanced_pos_weight(train_data.labels) if args.pos_weight == "balanced" else None
    return Bench(args, device, store, tokenizer, train_examples, val_examples, train_data, val,
                 weight)


def measure(args: argparse.Namespace, device: Device, run: str) -> Result:
    if run != OURS:
        bench = load_bench(args, device)
        warm_up(bench.store, args, device)
        return run_trainer(bench, run)
    configure_backends(device)  # as an hpo worker sets up its process
    if args.length_noise is not None:
        batching.LENGTH_NOISE = args.length_noise
    if args.rank_blur is not None:  # the one rank blur: the finer ones would undo a 1e12
        batching.RANK_BLUR = args.rank_blur
        batching.FINE_RANK_BLURS = ()
    bench = load_bench(args, device)
    bench.store.build(args.model, len(SYMPTOMS), seed=0)
    # As a worker does once its models and tokens are loaded: what it holds for good leaves
    # the garbage collector's sight while it trains, so its full collections stay short.
    with long_lived_frozen():
        warm_up(bench.store, args, device)
        return run_ours(bench, run)


def measure_in_child(argv: list[str], run: str) -> Result:
    """One configuration in a fresh process: each pays its own one-time costs (kernel
    selection, oneDNN primitives for every new batch shape) instead of the first run paying
    them for all that follow."""
    out = subprocess.run([sys.executable, __file__, *argv, "--only", run], check=True,
                         capture_output=True, text=True).stdout
    fields = json.loads(out.strip().splitlines()[-1])
    fields["probabilities"] = [torch.tensor(p) for p in fields["probabilities"]]
    return Result(**fields)


def parser_for(device: Device) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", type=int, default=400)
    parser.add_argument("--validation", type=int, default=100)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=BATCH,
                        help="the (effective and physical) batch of both loops")
    parser.add_argument("--precision", choices=("bf16", "none"),
                        default="bf16" if "bf16" in native_precisions(device) else "none")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--pos-weight", choices=("none", "balanced"), default="balanced")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--seed", type=int, default=SEED, help="the synthetic posts' seed")
    parser.add_argument("--training-seed", type=int, default=SEED,
                        help="a child's one run; repeat k uses SEED + k")
    parser.add_argument("--length-noise", type=float,
                        help="hpo's row: batching.LENGTH_NOISE instead of its own (1e12 sorts "
                             "the epoch by noise alone: batches in random order)")
    parser.add_argument("--rank-blur", type=float,
                        help="hpo's row: batching.RANK_BLUR instead of its own, and no "
                             "finer rank blurs (1e12 with --length-noise 1e12: batches in "
                             "random order)")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS),
                        help="the rows to run, hpo's among them (default: all four)")
    parser.add_argument("--only", choices=RUNS, help=argparse.SUPPRESS)  # a child's one run
    return parser


def main() -> None:
    device = detect("cpu")
    parser = parser_for(device)
    args = parser.parse_args()
    chosen = [ROWS[key] for key in dict.fromkeys(args.rows)]
    if OURS not in chosen or len(chosen) < 2:
        parser.error("--rows: hpo and at least one Trainer row")
    quiet_transformers()
    if args.only:
        result = measure(args, device, args.only)
        print(json.dumps({**vars(result),
                          "probabilities": [p.tolist() for p in result.probabilities]}))
        return
    load_start = os.getloadavg()[0]
    bench = load_bench(args, device)
    train_data, val = bench.train_data, bench.val
    runs: dict[str, list[Result]] = {}
    for repeat in range(args.repeats):  # the order rotates, so no configuration is always first
        for k in range(len(chosen)):
            run = chosen[(k + repeat) % len(chosen)]
            argv = [*sys.argv[1:], "--training-seed", str(SEED + repeat)]
            runs.setdefault(run, []).append(measure_in_child(argv, run))
    results = {name: combined(rs) for name, rs in runs.items()}
    ours = results[OURS]
    trainers = [results[run] for run in RUNS if run in results and run != OURS]
    base = trainers[0]

    words = [len(e.text.split()) for e in bench.train_examples + bench.val_examples]
    lengths = train_data.lengths + val.lengths
    print(f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}, "
          f"transformers {transformers.__version__}, accelerate {accelerate.__version__}; "
          f"{time.strftime('%Y-%m-%d')}; load average (1 min) {load_start:.2f} at start, "
          f"{os.getloadavg()[0]:.2f} at end\n")
    print(f"Settings: {Path(args.model).name}, precision {args.precision}, "
          f"{args.train} train / {args.validation} validation synthetic posts (words: mean "
          f"{statistics.mean(words):.0f}, median {statistics.median(words):.0f}, max "
          f"{max(words)}; tokens after truncation to {args.max_length}: mean "
          f"{statistics.mean(lengths):.0f}, {sum(n == args.max_length for n in lengths)} of "
          f"{len(lengths)} truncated), batch {args.batch}, lr {args.learning_rate:g}, "
          f"{args.epochs} epochs, weight decay {WEIGHT_DECAY}, warmup {WARMUP}, max grad norm "
          f"{MAX_GRAD_NORM}, BCE with pos_weight {args.pos_weight}; {args.repeats} run(s) "
          f"each, each in a fresh process, run k with training seed {SEED} + k; samples/s, "
          "padding and train s the median over runs, scores the mean\n")
    print(f"| run | samples/s | speed-up vs {base.run} | processed tokens/s | padding "
          "efficiency | macro-F1 | micro-F1 | train s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in (ours, *trainers):
        print(f"| {r.run} | {r.samples_per_second:.1f} | "
              f"{r.samples_per_second / base.samples_per_second:.2f}x | "
              f"{r.tokens_per_second:.0f} | {r.padding_efficiency:.3f} | {r.macro_f1:.4f} | "
              f"{r.micro_f1:.4f} | {r.seconds:.1f} |")
    print()
    for other in trainers:
        low, high = paired_bootstrap(ours.probabilities, other.probabilities, val.labels)
        per_seed = [o.samples_per_second / t.samples_per_second
                    for o, t in zip(runs[OURS], runs[other.run], strict=True)]
        speedup = statistics.median(per_seed)
        per_token = [o.tokens_per_second / t.tokens_per_second
                     for o, t in zip(runs[OURS], runs[other.run], strict=True)]
        label = "equal within noise" if low <= 0 <= high else "higher" if low > 0 else "LOWER"
        goal = ""
        if other.run in GOALS:
            met = speedup >= GOALS[other.run] and label != "LOWER"
            goal = (f": goal >= {GOALS[other.run]}x at equal score "
                    f"**{'met' if met else 'NOT met'}**")
        # Three decimals: 1.146 printed as 1.15 read as a goal of 1.15 met.
        print(f"- vs {other.run}: **{speedup:.3f}x** samples/s (the median over training "
              f"seeds of {', '.join(f'{r:.3f}' for r in per_seed)}; ratio of the medians "
              f"{ours.samples_per_second / other.samples_per_second:.3f}); macro-F1 difference "
              f"{ours.macro_f1 - other.macro_f1:+.4f} (95% paired bootstrap over validation "
              f"posts, seeds paired {low:+.4f} .. {high:+.4f}: {label}){goal}")
        # Per processed token: the loops' own speed, padding aside (issue 44 item 2).
        print(f"  - per processed token: **{statistics.median(per_token):.3f}x** (the median "
              f"over training seeds of {', '.join(f'{r:.3f}' for r in per_token)}): goal >= 1 "
              f"within the pairs' spread "
              f"({min(per_token):.3f} .. {max(per_token):.3f})")
    if max(r.macro_f1 for r in (ours, *trainers)) < 0.05:
        print("- all runs score near 0: with plain BCE the model predicts no symptom yet, so "
              "equal scores say little here (try --pos-weight balanced)")
    print(f"- padding efficiency of the hpo loop **{ours.padding_efficiency:.3f}** "
          f"({base.run} {base.padding_efficiency:.3f}): goal >= 0.85 "
          f"**{'met' if ours.padding_efficiency >= 0.85 else 'NOT met'}**")


if __name__ == "__main__":
    main()
