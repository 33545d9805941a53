"""The table of learning curves that benchmarks/replay.py replays: real trials of the demo
study's space, each run to the table's epochs with no pruner, through `hpo run` itself.

    python benchmarks/learning_curves.py --seeds 0 1 2           # record (resumes)
    python benchmarks/learning_curves.py --seeds 1 --minutes 60  # a part, appended later
    python benchmarks/learning_curves.py --summary               # what the table holds,
                                                                  # stopped parts harvested
    python benchmarks/learning_curves.py --seeds 2 --pinned      # a part on another CPU kind

The grid: both models, each precision native here, effective batches 8, 16 and 32, a log
grid of learning rates over the space's range (3 a decade) and weight decay at its low, middle
and high value; every point with each training seed (`training.seed`). A seed is one study in
a storage under `--work` with every point enqueued, so a recording killed part-way goes on
where it stopped: its finished trials are harvested into the table first, the trial it was
running is run again. Each seed's study starts with an empty tokenization cache, as a new
machine does, so the table holds real first-trial costs too.

Per trial the table keeps each epoch's validation macro-F1 and seconds (steps and scoring),
and the seconds before its first epoch: model load, tokenization and the batch search, with
the probes the search made (only a study's first trial of a model, precision and batch bound
searches; later ones read the study's cache). The file records the machine, versions and
dates it was recorded with.

A part recorded on another CPU kind (`--pinned`) runs fp32 only, on two threads, with
deterministic algorithms and the AVX2 code paths of torch, oneDNN and MKL forced through
their environment settings (`PINNED_ENV`). It is gated: first `--gate` points the table holds
for that seed are recorded again. Identical to `GATE_TOLERANCE` in every epoch's F1, the part
is appended as the seed's own; otherwise it enters tagged (`parts`) as a noise draw if the
points' best F1 moved, at the median, no further than other training seeds move them (the
table's median training noise), and is refused if further. Either way its rows' seconds
are priced from the reference recording's medians at the same point, so that a replay pays
the reference machine's costs throughout; the seconds it measured are kept in `parts`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

import optuna
import yaml
from optuna.trial import TrialState
from search_quality import cpu_model, versions

from hpo import config as config_module
from hpo import study_files
from hpo.hardware import detect, native_precisions
from hpo.search.study import SPLITS

REPO = Path(__file__).resolve().parents[1]
TABLE = Path(__file__).resolve().parent / "learning_curves.json"
EPOCHS = 4
RATES_PER_DECADE = 3
STUDY_NAME = "curves"
# The kernels of an AVX2 machine on any x86 CPU: ATen's dispatch, oneDNN's ISA, MKL's code
# path and its conditional numerical reproducibility; two threads, as the reference had.
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
              "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT",
              "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
# hpo's command line with torch's deterministic algorithms on (torch has no variable for it).
DETERMINISTIC = ("import sys, torch; torch.use_deterministic_algorithms(True); "
                 "from hpo.cli import main; sys.exit(main(sys.argv[1:]))")
GATE_TOLERANCE = 1e-4
SECONDS = ("epoch_seconds", "setup_seconds", "tokenization_seconds", "batch_search_seconds",
           "model_seconds")
COLUMNS = ["model", "precision", "batch", "learning_rate", "weight_decay", "seed",
           "f1", "epoch_seconds", "setup_seconds", "tokenization_seconds",
           "batch_search_seconds", "batch_probes", "model_seconds"]


def grid(study: config_module.StudyConfig, precisions: tuple[str, ...]) -> list[dict]:
    """Every point of the table, as the parameters `hpo run` enqueues."""
    space = study.search_space
    rates = space.learning_rate
    decades = math.log10(rates.high / rates.low)
    steps = round(decades * RATES_PER_DECADE)
    lrs = [float(f"{rates.low * 10 ** (i / RATES_PER_DECADE):.3g}") for i in range(steps + 1)]
    decay = space.extras()["weight_decay"]
    decays = [decay.low, round((decay.low + decay.high) / 2, 6), decay.high]
    return [{"model_name": model, "fp_precision": precision,
             "target_effective_batch_size": batch, "learning_rate": lr, "weight_decay": wd}
            for model in space.model_name for precision in precisions
            for batch in space.target_effective_batch_size for wd in decays for lr in lrs]


def key(params: dict, seed: int) -> tuple:
    return (params["model_name"], params["fp_precision"], params["target_effective_batch_size"],
            params["learning_rate"], params["weight_decay"], seed)


def row_of(trial: optuna.trial.FrozenTrial, seed: int) -> list:
    attrs, p = trial.user_attrs, trial.params
    epochs = attrs["epoch_seconds"]
    return [p["model_name"], p["fp_precision"], p["target_effective_batch_size"],
            p["learning_rate"], p["weight_decay"], seed, attrs["epoch_scores"], epochs,
            round(attrs["trial_seconds"] - sum(epochs), 3), attrs["tokenization_seconds"],
            attrs["batch_search_seconds"], attrs["batch_probes"], attrs["model_seconds"]]


def load_table(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"format": 1, "study": "demo", "epochs": EPOCHS, "machine": cpu_model(),
            "cores": os.cpu_count(), "versions": versions(), "dates": [],
            "columns": COLUMNS, "rows": []}


def harvest(table: dict, storage: str, seed: int, requeue: bool = False) -> int:
    """Move the seed's finished trials into the table, a pinned part's priced (`priced`);
    with `requeue` (no recording is running), fail a trial a killed run left RUNNING and
    enqueue its point again. Returns how many rows were added."""
    part = part_of(table, seed)
    try:
        study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
    except KeyError:
        return 0
    # The replay needs it for the Trainer's global step (steps per epoch).
    table["train_size"] = study.user_attrs[SPLITS]["train"]["posts"]
    have = {tuple(r[:5]) + (r[5],) for r in table["rows"]}
    added = 0
    for trial in study.get_trials(deepcopy=False):
        if trial.state == TrialState.COMPLETE and key(trial.params, seed) not in have:
            row = row_of(trial, seed)
            table["rows"].append(row if part is None else priced(table, part, row))
            have.add(key(trial.params, seed))
            added += 1
        elif trial.state == TrialState.RUNNING and requeue:
            study.tell(trial.number, state=TrialState.FAIL)
            study.enqueue_trial(trial.params)
    return added


@dataclass(frozen=True)
class Recording:
    """Where a recording keeps its studies (`work`) and its table (`output`), the precisions
    it records, and whether it runs the pinned kernels (`PINNED_ENV`)."""

    work: Path
    output: Path
    precisions: tuple[str, ...]
    pinned: bool = False


def record_seed(table: dict, recording: Recording, points: list[dict], seed: int,
                seconds: float | None) -> None:
    work, output, precisions = recording.work, recording.output, recording.precisions
    directory = work / f"seed-{seed}"
    directory.mkdir(parents=True, exist_ok=True)
    storage = f"sqlite:///{directory / 'hpo.db'}"
    save(table, output, harvest(table, storage, seed, requeue=True))
    have = {tuple(r[:6]) for r in table["rows"]}
    missing = [p for p in points if key(p, seed) not in have]
    if not missing:
        return
    sets = ["study.name=" + STUDY_NAME, f"training.epochs={EPOCHS}", "study.pruner.name=none",
            f"training.seed={seed}", "study.keep_best=0",
            # Named, not `native`: a set may then name its precision.
            "search_space.fp_precision=" + json.dumps(list(precisions))]
    try:
        study = optuna.load_study(study_name=STUDY_NAME, storage=storage)
    except KeyError:
        # hpo enqueues the study file's sets once, when it creates the study.
        # YAML, whose floats keep their dot: a JSON 1e-05 would read back as a string.
        sets.append("study.enqueue=" + yaml.safe_dump(missing, default_flow_style=True,
                                                      width=math.inf).strip())
        complete = 0
    else:
        enqueue_missing(study, missing, seed)
        complete = len(study.get_trials(states=(TrialState.COMPLETE,)))
    python = ("-c", DETERMINISTIC) if recording.pinned else ("-m", "hpo.cli")
    command = [sys.executable, *python, "run", "--study", "demo", "--storage", storage,
               "--n-trials", str(complete + len(missing)),
               *[part for item in sets for part in ("--set", item)]]
    if seconds is not None:
        command += ["--timeout", f"{max(seconds, 1):.0f}"]
    env = {**os.environ, "HPO_CACHE_DIR": str(directory / "cache"),
           **(PINNED_ENV if recording.pinned else {})}
    print(f"seed {seed}: {len(missing)} points to record", flush=True)
    with (directory / "hpo.log").open("a") as log:
        done = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=log, check=False)
    save(table, output, harvest(table, storage, seed))
    if done.returncode != 0:
        raise SystemExit(f"hpo run exited with {done.returncode}; see {directory / 'hpo.log'}")


def enqueue_missing(study: optuna.Study, missing: list[dict], seed: int) -> int:
    """Enqueue the points not yet recorded nor waiting (a waiting trial's parameters are its
    enqueued ones: it has sampled none). Returns how many were enqueued."""
    waiting = {key(t.system_attrs.get("fixed_params", t.params), seed)
               for t in study.get_trials(states=(TrialState.WAITING,))}
    fresh = [params for params in missing if key(params, seed) not in waiting]
    for params in fresh:
        study.enqueue_trial(params)
    return len(fresh)


def save(table: dict, output: Path, added: int, force: bool = False) -> None:
    if not added and not force:
        return
    today = date.today().isoformat()
    if today not in table["dates"]:
        table["dates"].append(today)
    table["rows"].sort(key=lambda r: (r[5], r[0], r[1], r[2], r[4], r[3]))
    # One row per line: a compact file whose appended parts read as diffs.
    head = {k: v for k, v in table.items() if k != "rows"}
    lines = ",\n".join(json.dumps(r, separators=(",", ":")) for r in table["rows"])
    output.write_text(json.dumps(head, indent=1)[:-2] + ',\n "rows": [\n' + lines + "\n]}\n")
    print(f"  {added} rows added: {len(table['rows'])} in {output}", flush=True)


def part_of(table: dict, seed: int) -> dict | None:
    """The pinned part recording `seed` here, if there is one."""
    return next((p for p in table.get("parts", ()) if p["seed"] == seed), None)


def priced(table: dict, part: dict, row: list) -> list:
    """A pinned part's row with its seconds from the reference recording's medians at the
    same point (every epoch's, elementwise); what it measured is summed into `part`."""
    at = dict(zip(COLUMNS, row, strict=True))
    reference = [dict(zip(COLUMNS, r, strict=True)) for r in table["rows"]
                 if r[:5] == row[:5] and r[5] != part["seed"]]
    if not reference:
        raise SystemExit(f"no reference recording of {row[:5]} to price a pinned row from")
    part["measured_epoch_seconds"] = round(
        part.get("measured_epoch_seconds", 0.0) + sum(at["epoch_seconds"]), 3)
    for name in SECONDS:
        values = [r[name] for r in reference]
        at[name] = ([round(statistics.median(v), 3) for v in zip(*values, strict=True)]
                    if name == "epoch_seconds" else round(statistics.median(values), 3))
    part["priced_epoch_seconds"] = round(
        part.get("priced_epoch_seconds", 0.0) + sum(at["epoch_seconds"]), 3)
    return [at[c] for c in COLUMNS]


def gate_points(table: dict, seed: int, count: int) -> list[dict]:
    """`count` fp32 points the table holds for `seed`, spread evenly over its rows."""
    rows = sorted((r for r in table["rows"] if r[5] == seed and r[1] == "none"),
                  key=lambda r: (r[0], r[2], r[4], r[3]))
    if len(rows) < count:
        raise SystemExit(f"the gate needs {count} recorded points of seed {seed}; the table "
                         f"holds {len(rows)}")
    step = len(rows) / count
    return [{"model_name": r[0], "fp_precision": r[1], "target_effective_batch_size": r[2],
             "learning_rate": r[3], "weight_decay": r[4]}
            for r in (rows[int(i * step)] for i in range(count))]


def gate_difference(table: dict, again: dict, seed: int) -> float:
    """The largest difference of any epoch's F1 between the points recorded `again` and the
    table's rows of them."""
    held = {tuple(r[:6]): r[6] for r in table["rows"]}
    differences = [abs(a - b) for r in again["rows"]
                   for a, b in zip(r[6], held[tuple(r[:5]) + (seed,)], strict=True)]
    return max(differences)


def gate_best_differences(table: dict, again: dict, seed: int) -> list[float]:
    """Per point recorded `again`, how far its best epoch's F1 moved from the table's."""
    held = {tuple(r[:6]): r[6] for r in table["rows"]}
    return [abs(max(r[6]) - max(held[tuple(r[:5]) + (seed,)])) for r in again["rows"]]


def noise_bound(table: dict) -> float:
    """How far a noise draw may move a point's best F1 at the median: the table's median
    training noise (the range of a point's best F1 across its seeds)."""
    noise = training_noise(table)
    if noise is None:
        raise SystemExit("a pinned part needs points recorded with two seeds or more, to "
                         "know the training noise it is measured against")
    return noise[1]


def pinned_part(table: dict, recording: Recording, seed: int, count: int) -> dict:
    """The seed's pinned part, gated first where it has none: `count` of its points recorded
    again with the pinned kernels, in a study of their own."""
    part = part_of(table, seed)
    if part is not None:
        return part
    work = recording.work / "gate"
    gate = Recording(work, work / f"seed-{seed}.json", recording.precisions, pinned=True)
    again = load_table(gate.output)
    record_seed(again, gate, gate_points(table, seed, count), seed, None)
    part = gated(table, again, seed, count)
    table.setdefault("parts", []).append(part)
    save(table, recording.output, 0, force=True)
    print(f"seed {seed}: gate of {count} points, largest F1 difference "
          f"{part['gate']['max_f1_difference']:.6f}: {part['as']}", flush=True)
    return part


def gated(table: dict, again: dict, seed: int, count: int) -> dict:
    """The part's record, from its gate: the seed's own where every epoch's F1 came back
    within GATE_TOLERANCE; a tagged noise draw where the points' best F1 moved, at the
    median, no further than other training seeds move them; refused otherwise."""
    difference = gate_difference(table, again, seed)
    moved = statistics.median(gate_best_differences(table, again, seed))
    bound = noise_bound(table)
    if difference > GATE_TOLERANCE and moved > bound:
        raise SystemExit(f"the pinned kernels moved seed {seed}'s points by a median "
                         f"{moved:.4f} best F1, more than the table's training noise "
                         f"({bound:.4f}): not a part of this table")
    return {"seed": seed, "machine": cpu_model(), "versions": versions(),
            "kernels": ", ".join(f"{k}={v}" for k, v in PINNED_ENV.items())
            + ", torch.use_deterministic_algorithms(True), fp32",
            "gate": {"points": count, "max_f1_difference": round(difference, 6),
                     "identical": difference <= GATE_TOLERANCE,
                     "median_best_f1_difference": round(moved, 6),
                     "training_noise_median": round(bound, 6)},
            "as": "the seed's own" if difference <= GATE_TOLERANCE else "a tagged noise draw"}


def summary(table: dict, points: list[dict]) -> None:
    print(f"{table['machine']}, {table['cores']} cores, {table['versions']}, {table['dates']}")
    for seed in sorted({r[5] for r in table["rows"]}):
        rows = [r for r in table["rows"] if r[5] == seed]
        hours = sum(sum(r[7]) + r[8] for r in rows) / 3600
        print(f"seed {seed}: {len(rows)} of {len(points)} points, {hours:.2f} h of trials")
    for part in table.get("parts", ()):
        print(f"seed {part['seed']}: a part on {part['machine']} ({part['kernels']}), "
              f"gated on {part['gate']['points']} points (largest F1 difference "
              f"{part['gate']['max_f1_difference']}, the best F1's median "
              f"{part['gate'].get('median_best_f1_difference', '-')} against the training "
              f"noise's {part['gate'].get('training_noise_median', '-')}): {part['as']}; "
              f"epoch seconds priced "
              f"from the reference, {part.get('measured_epoch_seconds', 0)} s measured for "
              f"{part.get('priced_epoch_seconds', 0)} s priced")
    noise = training_noise(table)
    if noise is not None:
        print("training noise, the best epoch's F1 of one point across its seeds "
              "(range: max - min): over {} points, median {:.4f}, 90th percentile {:.4f}; "
              "the points' best F1 (first seed) spans {:.4f}..{:.4f}".format(*noise))


def training_noise(table: dict) -> tuple[int, float, float, float, float] | None:
    """Over the points recorded with more than one training seed: their number, the median
    and 90th percentile of the range of their best epoch's F1 across seeds, and the lowest
    and highest best F1 of any point (its first seed's) for scale."""
    best: dict[tuple, list[float]] = {}
    for row in sorted(table["rows"], key=lambda r: r[5]):
        best.setdefault(tuple(row[:5]), []).append(max(row[6]))
    ranges = sorted(max(v) - min(v) for v in best.values() if len(v) > 1)
    if not ranges:
        return None
    firsts = [v[0] for v in best.values()]
    high = (statistics.quantiles(ranges, n=10, method="inclusive")[-1] if len(ranges) > 1
            else ranges[0])
    return len(ranges), statistics.median(ranges), high, min(firsts), max(firsts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--output", type=Path, default=TABLE)
    parser.add_argument("--work", type=Path, default=REPO / "benchmarks" / ".curves")
    parser.add_argument("--minutes", type=float, help="start no trial after this long")
    parser.add_argument("--summary", action="store_true")
    parser.add_argument("--pinned", action="store_true",
                        help="record fp32 on the pinned kernels, gated (another CPU kind)")
    parser.add_argument("--gate", type=int, default=12,
                        help="points recorded again before a pinned part (default 12)")
    args = parser.parse_args(argv)
    study = study_files.load(study_files.study_path("demo"))
    table = load_table(args.output)
    if table["machine"] != cpu_model() and not (args.pinned or args.summary):
        raise SystemExit(f"{args.output} was recorded on {table['machine']}, not here "
                         f"({cpu_model()}): record a part with --pinned, or a new table "
                         f"with --output")
    precisions = ("none",) if args.pinned else native_precisions(detect())
    recording = Recording(args.work, args.output, precisions, args.pinned)
    points = grid(study, precisions)
    # What a recording stopped part-way left in its storages, first.
    had_size = "train_size" in table
    for directory in sorted(args.work.glob("seed-*")):
        seed = int(directory.name.split("-", 1)[1])
        if (directory / "hpo.db").exists():
            save(table, args.output,
                 harvest(table, f"sqlite:///{directory / 'hpo.db'}", seed))
    if not had_size and "train_size" in table:
        save(table, args.output, 0, force=True)
    if args.summary:
        summary(table, points)
        return
    began = time.monotonic()
    for seed in args.seeds:
        left = None if args.minutes is None else args.minutes * 60 - (time.monotonic() - began)
        if left is not None and left <= 0:
            break
        if args.pinned:
            pinned_part(table, recording, seed, args.gate)
        record_seed(table, recording, points, seed, left)
    summary(table, points)


if __name__ == "__main__":
    main()
