"""Does `fp_precision: auto` decide the same on a busy machine as on an idle one?

    python benchmarks/precision_decision.py [--repeats 5] [--load 1] [--output FILE.json]

Creates the demo study `--repeats` times in fresh SQLite storages (`hpo run --study demo
--n-trials 1`, each a new process, as a user's first worker is), first on the idle machine
and then with `--load` busy processes beside it (each a Python loop that keeps one core
busy, as another job on a shared host does). For each creation it keeps what the worker said:
the check's table (seconds per step and the batch they were timed at, per model x precision)
and the decision ("precisions searched: ..."), then prints a markdown report for
benchmarks/README.md and writes the runs to `--output`.

Goal (issue 44 item 3): every decision agrees, idle and loaded, or the decision itself says
why it cannot (a precision within the spread of the repeats of the tolerance's edge).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import date
from pathlib import Path

from search_quality import cpu_model, versions

REPO = Path(__file__).resolve().parents[1]
DECISION = re.compile(r"precisions searched: .*")
ROW = re.compile(r"^(\S+)\s+(fp32|bf16|fp16)\s+(\d+\.\d+)\s+(\d+)\s")


def busy() -> None:
    while True:
        pass


def create(work: Path, index: int) -> dict:
    """One creation of the demo study by a new worker: its check's rows and its decision."""
    env = {**os.environ, "HPO_CACHE_DIR": str(work / f"cache{index}")}
    command = [sys.executable, "-m", "hpo.cli", "run", "--study", "demo", "--n-trials", "1",
               "--storage", f"sqlite:///{work / f'study{index}.db'}"]
    began = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr}")
    lines = done.stdout.splitlines()
    decision = next((m.group(0) for line in lines if (m := DECISION.search(line))), None)
    rows = [{"model": Path(m.group(1)).name, "precision": m.group(2),
             "seconds": float(m.group(3)), "batch": int(m.group(4))}
            for line in lines if (m := ROW.match(line.strip()))]
    return {"decision": decision, "rows": rows, "wall": round(time.perf_counter() - began, 1)}


def condition(repeats: int, load: int) -> list[dict]:
    workers = [multiprocessing.Process(target=busy, daemon=True) for _ in range(load)]
    for worker in workers:
        worker.start()
    try:
        with tempfile.TemporaryDirectory() as work:
            runs = []
            for index in range(repeats):
                runs.append(create(Path(work), index))
                print(f"load {load}, creation {index + 1}: {runs[-1]['decision']}",
                      file=sys.stderr, flush=True)
            return runs
    finally:
        for worker in workers:
            worker.terminate()


def ratios(run: dict) -> str:
    """Each model's fp32 step time over bf16's, as the check timed them."""
    by = {(r["model"], r["precision"]): r["seconds"] / r["batch"] for r in run["rows"]}
    models = sorted({model for model, _ in by})
    return ", ".join(f"{model} {by[model, 'fp32'] / by[model, 'bf16']:.2f}x"
                     for model in models if (model, "fp32") in by and (model, "bf16") in by)


def report(results: dict[str, list[dict]]) -> str:
    lines = ["| machine state | creation | wall | batch timed | fp32 / bf16 step | decision |",
             "| --- | ---: | ---: | ---: | --- | --- |"]
    for state, runs in results.items():
        for index, run in enumerate(runs, 1):
            batches = sorted({r["batch"] for r in run["rows"]})
            lines.append(f"| {state} | {index} | {run['wall']:.0f} s | "
                         f"{', '.join(map(str, batches))} | {ratios(run)} | "
                         f"{run['decision']} |")
    decisions = Counter(run["decision"].split(";")[0] for runs in results.values()
                        for run in runs)
    agree = len(decisions) == 1
    lines.append("")
    lines.append(f"Decisions: {', '.join(f'{d!r} x{n}' for d, n in decisions.items())}: "
                 f"**{'all agree' if agree else 'they differ'}**.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load", type=int, default=1,
                        help="busy processes beside the loaded creations")
    parser.add_argument("--output", type=Path,
                        default=REPO / "benchmarks" / "results" / "precision_decision.json")
    args = parser.parse_args()
    results = {"idle": condition(args.repeats, 0),
               f"{args.load} busy core{'s' if args.load != 1 else ''}":
                   condition(args.repeats, args.load)}
    args.output.write_text(json.dumps(
        {"machine": cpu_model(), "cores": os.cpu_count(), "versions": versions(),
         "date": date.today().isoformat(), "results": results}, indent=1) + "\n")
    print(f"{cpu_model()}, {os.cpu_count()} cores; {versions()}; {date.today()}")
    print(report(results))


if __name__ == "__main__":
    main()
