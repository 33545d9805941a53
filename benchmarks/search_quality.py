"""Search quality per compute: the best validation macro-F1 as a function of wall time, hpo
against Optuna + transformers' Trainer (benchmarks/peer_trainer.py), on the demo study.

    python benchmarks/search_quality.py                       # 3 seeds, 20 trials, both tools
    python benchmarks/search_quality.py --variant "enqueue=study.enqueue=[...]" --no-peer
    python benchmarks/search_quality.py --render benchmarks/search_quality.json

For each seed (the sampler's seed of both tools) it runs, one process at a time:
1. the peer for `--n-trials` trials, then hpo (`hpo run --study demo`) for as many: the same
   trial budget;
2. then the faster of the two again on the same study until it has run as long as the slower
   one (a second process, whose start-up is counted): both are compared at the same wall
   time T, the slower one's wall time for the trial budget;
3. after all seeds, each `--variant NAME=KEY=VALUE[;KEY=VALUE...]`: hpo with those overrides
   for each seed, trial budget only.

Every run starts from a fresh storage and an empty tokenization cache, as on a new machine.
A trial's time is when it finished, counted from its process's start. Both tools are scored
the same way: a finished (COMPLETE) trial's best epoch's macro-F1 on the validation posts
(hpo's default `objective_epoch: best`; the Trainer reports its last epoch, so the peer is
read from its per-epoch reports). The raw results go to a JSON file from which `--render`
writes the markdown report and the anytime plot (PNG) again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import optuna
from optuna.trial import TrialState

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def timed(command: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run `command` from the repository root; its start (epoch seconds) and wall time."""
    started = time.time()
    with log.open("a") as errors:
        done = subprocess.run(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=errors,
                              env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {done.returncode}; see {log}")
    return started, time.time() - started


def trials_of(storage: str, name: str, segments: list[tuple[float, float]]) -> list[dict]:
    """Each finished trial: state, best epoch's score, and when it started and finished on
    the run's clock (the processes' wall times laid end to end)."""
    study = optuna.load_study(study_name=name, storage=storage)
    rows = []
    for trial in study.get_trials(deepcopy=False, states=FINISHED):
        started, ended = trial.datetime_start.timestamp(), trial.datetime_complete.timestamp()
        offset = 0.0
        for segment_start, wall in segments:
            if segment_start <= started <= segment_start + wall:
                break
            offset += wall
        else:
            raise SystemExit(f"trial {trial.number} of {name} ran outside the timed processes")
        epochs = list(trial.intermediate_values.values())
        rows.append({
            "number": trial.number,
            "state": trial.state.name,
            "value": max(epochs) if trial.state == TrialState.COMPLETE and epochs else (
                trial.value if trial.state == TrialState.COMPLETE else None),
            "model": trial.params.get("model_name", "").rsplit("/", 1)[-1],
            "start": offset + started - segment_start,
            "end": offset + ended - segment_start,
        })
    return sorted(rows, key=lambda row: row["end"])


class Run:
    """One tool's search for one seed: a storage and the processes that ran in it."""

    def __init__(self, tool: str, seed: int, overrides: list[str], workdir: Path) -> None:
        self.tool, self.seed, self.overrides = tool, seed, overrides
        self.storage = f"sqlite:///{workdir}/{tool}.db"
        self.env = {**os.environ, "HPO_CACHE_DIR": str(workdir / "cache")}
        self.log = workdir / f"{tool}.log"
        self.segments: list[tuple[float, float]] = []

    def command(self, n_trials: int | None, timeout: float | None) -> list[str]:
        budget = ([f"--n-trials={n_trials}"] if n_trials else []) + (
            [f"--timeout={timeout:.0f}"] if timeout else [])
        if self.tool == "peer":
            return [sys.executable, str(HERE / "peer_trainer.py"), "--storage", self.storage,
                    "--study-name", "search", f"--seed={self.seed}", *budget]
        sets = [part for item in self.overrides for part in ("--set", item)]
        return ["hpo", "run", "--study", "demo", "--storage", self.storage, "--set",
                "study.name=search", "--set", f"study.sampler.seed={self.seed}", *sets,
                *budget]

    def go(self, n_trials: int | None = None, timeout: float | None = None) -> None:
        self.segments.append(timed(self.command(n_trials, timeout), self.env, self.log))

    @property
    def wall(self) -> float:
        return sum(wall for _, wall in self.segments)

    def record(self, label: str, n_trials: int) -> dict:
        return {"tool": self.tool, "label": label, "seed": self.seed,
                "overrides": self.overrides, "n_trials": n_trials,
                "walls": [wall for _, wall in self.segments],
                "trials": trials_of(self.storage, "search", self.segments)}


def measure(args: argparse.Namespace) -> dict:
    results = {"machine": cpu_model(), "cores": os.cpu_count(), "date": date.today().isoformat(),
               "versions": versions(), "n_trials": args.n_trials, "runs": []}
    if args.append:
        results = json.loads(args.output.read_text())
        if results["n_trials"] != args.n_trials:
            raise SystemExit(f"{args.output} holds runs of {results['n_trials']} trials")
    for seed in args.seeds if args.default else ():
        with tempfile.TemporaryDirectory() as tmp:
            runs = {}
            for tool in ("peer", "hpo") if args.peer else ("hpo",):
                (Path(tmp) / tool).mkdir()
                runs[tool] = Run(tool, seed, [], Path(tmp) / tool)
                runs[tool].go(n_trials=args.n_trials)
                print(f"seed {seed} {tool}: {args.n_trials} trials in {runs[tool].wall:.0f}s",
                      flush=True)
            trial_budget = {tool: run.wall for tool, run in runs.items()}
            if args.peer:
                faster, slower = sorted(runs.values(), key=lambda run: run.wall)
                faster.go(timeout=slower.wall - faster.wall)
                print(f"seed {seed} {faster.tool}: extended to {faster.wall:.0f}s", flush=True)
            for tool, run in runs.items():
                record = run.record("default", args.n_trials)
                record["trial_budget_wall"] = trial_budget[tool]
                results["runs"].append(record)
        args.output.write_text(json.dumps(results, indent=1))
    for label, overrides in args.variants:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                run = Run("hpo", seed, overrides, Path(tmp))
                run.go(n_trials=args.n_trials)
                print(f"seed {seed} hpo {label}: {run.wall:.0f}s", flush=True)
                record = run.record(label, args.n_trials)
                record["trial_budget_wall"] = run.wall
                results["runs"].append(record)
            args.output.write_text(json.dumps(results, indent=1))
    return results


def versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "optuna": optuna.__version__}


def best_by(trials: list[dict], moment: float) -> float | None:
    values = [t["value"] for t in trials if t["state"] == "COMPLETE" and t["end"] <= moment]
    return max(values) if values else None


def first_n(trials: list[dict], n: int) -> list[dict]:
    return sorted(trials, key=lambda t: t["number"])[:n]


def reached(trials: list[dict], target: float) -> float | None:
    """When the best so far first reached `target`."""
    for trial in trials:
        if trial["state"] == "COMPLETE" and trial["value"] >= target:
            return trial["end"]
    return None


def wasted_share(trials: list[dict]) -> float:
    spent = sum(t["end"] - t["start"] for t in trials)
    lost = sum(t["end"] - t["start"] for t in trials if t["state"] != "COMPLETE")
    return lost / spent if spent else 0.0


def shown(best: float | None) -> str:
    return "-" if best is None else f"{best:.4f}"


def render(results: dict, plot: Path) -> str:
    runs = results["runs"]
    n = results["n_trials"]
    default = {(r["tool"], r["seed"]): r for r in runs if r["label"] == "default"}
    seeds = sorted({seed for _, seed in default})
    v = results["versions"]
    lines = [
        f"Result ({results['machine']}, {results['cores']} cores; torch {v['torch']}, "
        f"transformers {v['transformers']}, optuna {v['optuna']}; {results['date']}; "
        f"{n} trials per run; seeds {', '.join(map(str, seeds))}):", "",
    ]
    if any(tool == "peer" for tool, _ in default):
        lines += [
            "| seed | tool | wall for the trial budget | best after the trial budget | "
            "equal wall time T | best by T | pruned + failed compute | "
            "hpo reaches the peer's final best at |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        ratios, wins = [], []
        for seed in seeds:
            peer, ours = default[("peer", seed)], default[("hpo", seed)]
            budget = max(peer["trial_budget_wall"], ours["trial_budget_wall"])
            peer_final = best_by(first_n(peer["trials"], n), float("inf"))
            at = reached(ours["trials"], peer_final) if peer_final is not None else None
            share = at / peer["trial_budget_wall"] if at is not None else None
            ratios.append(share if share is not None else float("inf"))
            wins.append((best_by(ours["trials"], budget) or 0) >= (
                best_by(peer["trials"], budget) or 0))
            for record in (ours, peer):
                own = first_n(record["trials"], n)
                reach = (f"{at:.0f} s ({share:.1%} of the peer's {peer['trial_budget_wall']:.0f} s)"
                         if record is ours and at is not None else
                         "never" if record is ours else "")
                lines.append(
                    f"| {seed} | {record['tool']} | {record['trial_budget_wall']:.0f} s | "
                    f"{shown(best_by(own, float('inf')))} | {budget:.0f} s | "
                    f"{shown(best_by(record['trials'], budget))} | {wasted_share(own):.0%} | "
                    f"{reach} |")
        median = statistics.median(ratios)
        lines += [
            "",
            f"- Goal 1, at equal wall time hpo's best is at least the peer's in every seed: "
            f"**{'met' if all(wins) else 'missed'}** ({sum(wins)} of {len(wins)} seeds).",
            f"- Goal 2, hpo reaches the peer's final best in at most half the peer's wall time "
            f"(median over seeds): **{'met' if median <= 0.5 else 'missed'}** (median "
            f"{'never' if median == float('inf') else f'{median:.1%}'}).",
            "",
        ]
    variants = [r for r in runs if r["tool"] == "hpo"]
    labels = list(dict.fromkeys(r["label"] for r in variants))
    if len(labels) > 1:
        lines += ["hpo's settings, each against the study file's defaults (trial budget):", "",
                  "| setting | overrides | best per seed | mean best | mean wall | "
                  "pruned + failed compute | mean time to the defaults' mean best |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        base = statistics.mean(best_by(first_n(r["trials"], n), float("inf")) or 0
                               for r in variants if r["label"] == "default")
        for label in labels:
            chosen = [r for r in variants if r["label"] == label]
            bests = [best_by(first_n(r["trials"], n), float("inf")) or 0 for r in chosen]
            times = [reached(first_n(r["trials"], n), base) for r in chosen]
            reach = (f"{statistics.mean(times):.0f} s" if all(t is not None for t in times)
                     else f"{sum(t is not None for t in times)} of {len(times)} seeds reach it")
            lines.append(
                f"| {label} | {'; '.join(chosen[0]['overrides']) or '-'} | "
                f"{' / '.join(f'{b:.4f}' for b in bests)} | {statistics.mean(bests):.4f} | "
                f"{statistics.mean(r['trial_budget_wall'] for r in chosen):.0f} s | "
                f"{statistics.mean(wasted_share(first_n(r['trials'], n)) for r in chosen):.0%} | "
                f"{reach} |")
        lines.append("")
    draw(default, seeds, plot)
    lines.append(f"![anytime curves]({plot.name})")
    return "\n".join(lines)


def draw(default: dict, seeds: list[int], plot: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    colours = {"hpo": "tab:blue", "peer": "tab:orange"}
    names = {"hpo": "hpo run", "peer": "Optuna + Trainer.hyperparameter_search"}
    for (tool, seed), record in sorted(default.items()):
        xs, ys, best = [0.0], [0.0], 0.0
        for trial in record["trials"]:
            if trial["state"] == "COMPLETE" and trial["value"] > best:
                best = trial["value"]
            xs.append(trial["end"])
            ys.append(best)
        xs.append(sum(record["walls"]))
        ys.append(best)
        axes.step(xs, ys, where="post", color=colours[tool], alpha=0.85,
                  linestyle=("-", "--", ":", "-.")[seeds.index(seed) % 4],
                  label=f"{names[tool]}, seed {seed}")
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel("best validation macro-F1 so far")
    axes.set_title("Demo study: best score over wall time (1 worker, 2 CPU cores)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(plot, dpi=110)


def variant(text: str) -> tuple[str, list[str]]:
    label, _, overrides = text.partition("=")
    if not label or not overrides:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY=VALUE[;KEY=VALUE...], got {text!r}")
    return label, overrides.split(";")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--variant", dest="variants", type=variant, action="append",
                        default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE...]")
    parser.add_argument("--no-peer", dest="peer", action="store_false")
    parser.add_argument("--no-default", dest="default", action="store_false",
                        help="run only the variants (with --append: add them to --output)")
    parser.add_argument("--append", action="store_true",
                        help="add this invocation's runs to those already in --output")
    parser.add_argument("--output", type=Path, default=HERE / "search_quality.json")
    parser.add_argument("--plot", type=Path, default=HERE / "search_quality.png")
    parser.add_argument("--render", type=Path, default=None,
                        help="write the report again from this JSON; run nothing")
    args = parser.parse_args()
    results = (json.loads(args.render.read_text()) if args.render is not None
               else measure(args))
    print(render(results, args.plot))


if __name__ == "__main__":
    main()
