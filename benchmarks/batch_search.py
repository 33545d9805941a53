"""Batch-size search cost: probes (training steps tried) to find the largest micro-batch that fits,
on a simulated device that holds `limit` samples, for hpo and two peers run for real.

    PYTHONPATH=src python benchmarks/batch_search.py

hpo: `hpo.trial.batch_limit.search(step, 256, BatchLimit())`, then again with the limit it
returned (the study cache hit), and the micro-batch trained with, `physical_batch(limit, 256, 0.9)`.
accelerate: `find_executable_batch_size(starting_batch_size=256)` around one step.
Lightning: `Tuner.scale_batch_size(mode="binsearch", init_val=2, max_trials=25,
steps_per_trial=1)` on a tiny LightningModule on CPU with a 10,000-item dataset; its search is
bounded with max_val=257, the only value that probes 256 and nothing above it (see the notes).
Needs `pip install accelerate lightning`. The script prints a markdown report.
"""

from __future__ import annotations

import logging
import os
import platform
import tempfile
import warnings
from dataclasses import dataclass, field
from datetime import date

import accelerate
import lightning
import torch
from accelerate.utils import find_executable_batch_size
from lightning.pytorch.tuner import Tuner
from torch.utils.data import DataLoader, TensorDataset

from hpo.trial.batch_limit import BatchLimit, physical_batch, search

LIMITS = (1, 3, 7, 23, 37, 100, 200, 255, 256)
BOUND = 256
GOAL = 9  # most probes allowed for one search by hpo
SAFETY_MARGIN = 0.9
DATASET_SIZE = 10_000  # Lightning never stops its search because the data ran out
LIGHTNING_MAX_VALS = (BOUND, BOUND + 1, 8192)  # 8192 is Lightning's default


@dataclass
class Device:
    """A device that holds `limit` samples: a larger batch raises the error a GPU would."""

    limit: int
    calls: list[int] = field(default_factory=list)

    def step(self, batch: int) -> None:
        self.calls.append(batch)
        if batch > self.limit:
            # The wording of PyTorch's CUDA allocator, which all three libraries recognise.
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate a batch of {batch} "
                f"(simulated device holding {self.limit})"
            )


@dataclass
class Run:
    calls: list[int]
    result: int
    again: int = 0  # probes of a second search for the same key


def run_hpo(limit: int) -> tuple[Run, int]:
    device = Device(limit)
    first = search(device.step, BOUND, BatchLimit())
    calls = list(device.calls)
    again = search(device.step, BOUND, first.limit)
    assert first.probes == len(calls) and again.probes == len(device.calls) - len(calls)
    return Run(calls, first.limit.largest_ok, again.probes), physical_batch(
        first.limit, BOUND, SAFETY_MARGIN
    )


def run_accelerate(limit: int) -> Run:
    device = Device(limit)

    @find_executable_batch_size(starting_batch_size=BOUND)
    def train(batch_size: int) -> int:
        device.step(batch_size)
        return batch_size

    result = train()
    calls = list(device.calls)
    train()  # the decorator keeps the last batch size that worked for the next call
    return Run(calls, result, len(device.calls) - len(calls))


class TinyModule(lightning.LightningModule):
    def __init__(self, device: Device) -> None:
        super().__init__()
        self.batch_size = 2  # the attribute Lightning's tuner scales
        self.sim = device
        self.layer = torch.nn.Linear(1, 1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(DATASET_SIZE, 1)), batch_size=self.batch_size)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (x,) = batch
        self.sim.step(x.shape[0])
        return self.layer(x).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def run_lightning(limit: int, max_val: int) -> Run:
    device = Device(limit)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # num_workers hints and the like
        trainer = lightning.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, default_root_dir=root, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        result = Tuner(trainer).scale_batch_size(
            TinyModule(device), mode="binsearch", init_val=2, max_trials=25, steps_per_trial=1,
            max_val=max_val,
        )
    assert result is not None
    return Run(device.calls, result)


def batch(result: int, limit: int) -> str:
    return f"{result}" if result <= limit else f"{result} (OOM)"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(name).setLevel(logging.ERROR)

    hpo_runs = {limit: run_hpo(limit) for limit in LIMITS}
    acc_runs = {limit: run_accelerate(limit) for limit in LIMITS}
    pl_runs = {(limit, mv): run_lightning(limit, mv) for limit in LIMITS
               for mv in LIGHTNING_MAX_VALS}
    pl_main = BOUND + 1

    print("# Batch-size search cost, simulated device, search bounded by 256\n")
    print(f"Machine: {cpu_name()}, {os.cpu_count()} cores; Python {platform.python_version()}, "
          f"torch {torch.__version__}, accelerate {accelerate.__version__}, "
          f"lightning {lightning.__version__}; {date.today().isoformat()}\n")
    print("| limit | hpo probes (first search) | hpo probes (cache hit) | hpo physical batch "
          "| accelerate probes | accelerate result batch | Lightning probes "
          "| Lightning result batch |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for limit in LIMITS:
        (h, phys), a, p = hpo_runs[limit], acc_runs[limit], pl_runs[limit, pl_main]
        print(f"| {limit} | {len(h.calls)} | {h.again} | {phys} | {len(a.calls)} "
              f"| {batch(a.result, limit)} | {len(p.calls)} | {batch(p.result, limit)} |")
    print("\nhpo's search returns the exact limit (largest batch that fits, capped at 256); the "
          "physical batch keeps a 0.9 margin below a limit met under 256. accelerate multiplies "
          "by 0.9 after each OOM; Lightning returns its binary search's result less 5% (margin "
          f"0.05). Lightning: max_val={pl_main}.\n")

    print("Lightning's bound: probes / result batch for each max_val\n")
    print("| limit | " + " | ".join(f"max_val={mv}" for mv in LIGHTNING_MAX_VALS) + " |")
    print("| ---: |" + " ---: |" * len(LIGHTNING_MAX_VALS))
    for limit in LIMITS:
        cells = [f"{len(pl_runs[limit, mv].calls)} / {batch(pl_runs[limit, mv].result, limit)}"
                 for mv in LIGHTNING_MAX_VALS]
        print(f"| {limit} | " + " | ".join(cells) + " |")
    print("\nLightning stops, without probing it, at the first size >= max_val and returns that "
          "size less its margin; 1 is assumed to fit and never probed.")

    print("\nBatch sizes probed, in order (first search)\n")
    for limit in LIMITS:
        print(f"- limit {limit}: hpo {hpo_runs[limit][0].calls}; "
              f"accelerate {acc_runs[limit].calls}; Lightning {pl_runs[limit, pl_main].calls}; "
              f"Lightning max_val=8192 {pl_runs[limit, 8192].calls}")

    again = sorted({run.again for run in acc_runs.values()})
    print(f"\naccelerate, second call of the same decorated function: {again} probe(s) "
          "(it retries the last batch size that worked).")
    firsts = [len(run.calls) for run, _ in hpo_runs.values()]
    hits = [run.again for run, _ in hpo_runs.values()]
    holds = max(firsts) <= GOAL and max(hits) == 0
    print(f"\nGoal: at most {GOAL} probes per search, 0 on a cache hit. hpo: {min(firsts)} to "
          f"{max(firsts)} probes, {max(hits)} on a cache hit: **{'met' if holds else 'NOT met'}**. "
          f"accelerate: {min(len(r.calls) for r in acc_runs.values())} to "
          f"{max(len(r.calls) for r in acc_runs.values())}; Lightning (max_val={pl_main}): "
          f"{min(len(pl_runs[lim, pl_main].calls) for lim in LIMITS)} to "
          f"{max(len(pl_runs[lim, pl_main].calls) for lim in LIMITS)}.")


if __name__ == "__main__":
    main()
