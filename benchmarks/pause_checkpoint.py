"""What pausing a trial costs (`study.pruner.pause`): the size of the checkpoint a paused trial
keeps in the artifact store, and the seconds to write it and read it back, for a model after
one real training step (so AdamW's moments exist), through hpo's own code: the checkpoint
`hpo.trial.drivers.pause` stores and `hpo.search.pausing` writes to a store on local disk.

    PYTHONPATH=src python benchmarks/pause_checkpoint.py [--model NAME_OR_DIR] [--repeats 3]

Prints one markdown row per model for benchmarks/README.md. Times are the median of
`--repeats`; the disk is this machine's (a fleet's store is a shared volume or a bucket,
slower).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch

import hpo
from hpo import hardware
from hpo.data.batching import encode
from hpo.data.redsm5 import read_redsm5
from hpo.data.tasks import build_examples
from hpo.search import pausing
from hpo.training.models import ModelStore
from hpo.training.train import Hooks, Paused, PauseHere, Plan, TrainState, prepare, train
from hpo.trial.drivers import Checkpoint


def paused_state(model_name: str) -> TrainState:
    """A real paused state of `model_name`: built as a trial builds it, trained by
    `hpo.training.train.train`'s own loop on the demo posts, paused at its first evaluation
    (one epoch of one step)."""
    store, device = ModelStore(), hardware.detect("cpu")
    tokenizer = store.tokenizer(model_name)
    posts = read_redsm5(Path(hpo.__file__).parent / "demo")[:16]
    data = encode(tokenizer, build_examples(posts, "multilabel"), 64)
    plan = Plan(precision="none", effective_batch=16, physical_batch=16, eval_batch=16,
                learning_rate=1e-4, weight_decay=0.0, warmup_ratio=0.1, max_grad_norm=1.0,
                epochs=2, seed=0)
    model = prepare(store.build(model_name, data.labels.shape[1], seed=0), plan, device)

    def pause(_index: int, _score: float) -> None:
        raise PauseHere

    try:
        train(model, data, plan, device, pad_id=tokenizer.pad_token_id or 0,
              hooks=Hooks(lambda m: 0.0, pause))
    except Paused as paused:
        return paused.state
    raise RuntimeError("the run did not pause")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    state = paused_state(args.model)
    checkpoint = Checkpoint(state, [], {}, None)
    parameters = sum(t.numel() for k, t in state.model.items())
    writes, reads, size = [], [], 0
    with tempfile.TemporaryDirectory() as where:
        store = optuna.artifacts.FileSystemArtifactStore(where)
        for _ in range(args.repeats):
            began = time.perf_counter()
            key = pausing.save(store, 0, checkpoint)
            writes.append(time.perf_counter() - began)
            size = sum(p.stat().st_size for p in Path(where).iterdir())
            began = time.perf_counter()
            pausing.load(store, key, torch.device("cpu"))
            reads.append(time.perf_counter() - began)
            pausing.remove(store, key)
    print(f"{hardware.detect('cpu').describe()}; torch {torch.__version__}", file=sys.stderr)
    print("| model | parameters | checkpoint | bytes per parameter | write | read |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {args.model} | {parameters / 1e6:.1f} M | {size / 2**20:.0f} MiB | "
          f"{size / parameters:.1f} | {statistics.median(writes):.2f} s | "
          f"{statistics.median(reads):.2f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
