"""Search quality per compute: the best validation macro-F1 as a function of wall time, hpo
against three peers on the demo study, each run alone on the whole machine.

    python benchmarks/search_quality.py --seeds 0 1 2 3 4            # every peer, then hpo
    python benchmarks/search_quality.py --seeds 3 4 --append         # more seeds, later
    python benchmarks/search_quality.py --variant "native=search_space.fp_precision=native" \
        --no-default --append
    python benchmarks/search_quality.py --seeds 5 6 --peers expert --no-default \
        --variant "pause=study.pruner.pause=true" --append    # a variant and the expert
    python benchmarks/search_quality.py --render benchmarks/results/search_quality.json

The peers (benchmarks/peer_trainer.py, benchmarks/peer_ray.py), each given the study's data
split, space, epochs, warm-up, clipping, loss weights, TPE start-up trials and seed:
- novice: Optuna + `Trainer.hyperparameter_search(backend="optuna")` with the Trainer's
  defaults;
- expert: Optuna + the Trainer with the fastest native precision, length-grouped batches, an
  evaluation batch of 64 and the pruner asked at epoch ends;
- ray: `Trainer.hyperparameter_search(backend="ray")` with ASHA and Optuna's TPE
  (`OptunaSearch`), the expert's switches, one trial at a time on all cores.

For each seed it runs each peer for `--n-trials` trials, then hpo (`hpo run --study demo`)
for as many, then hpo again on the same study until it has run as long as the slowest peer
(a second process, whose start-up is counted), so hpo can be read at every peer's wall time.
With `--append`, the (tool, seed) runs already in `--output` are kept and not run again
(`--rerun hpo` runs hpo again, after a change to it); hpo is run again for a seed whose new
peer ran longer than hpo did. Each
`--variant NAME=KEY=VALUE[;KEY=VALUE...]` runs hpo with those overrides per seed (trial
budget only).

Every run starts from a fresh storage and an empty tokenization cache, as on a new machine.
A trial's time is when it finished, counted from its process's start. Every tool is scored
the same way: a finished (COMPLETE) trial's best epoch's macro-F1 on the validation posts.
Runs record the machine's CPU: a seed compares runs of one machine only (the one its
hpo run was on), so seeds may come from different CPU kinds. The raw results
go to a JSON file from which `--render` writes the markdown report and the anytime plot (PNG).
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
import stored
from optuna.trial import TrialState

# The median pruner the peers' glue runs (peer_trainer.py, replay.py): the demo study's
# settings before hpo's default became successive halving (issue 43), kept so that every peer
# run stays comparable.
MEDIAN_STARTUP, MEDIAN_WARMUP = 4, 1

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


# The instructions that tell these machines' CPU kinds apart (and decide what `auto` does):
# several kinds share a model name ("AMD EPYC").
KIND_FLAGS = ("amx_bf16", "avx512_fp16", "avx512_bf16", "avx2")


def cpu_model() -> str:
    """The CPU's model name and the kind-telling instructions it has."""
    name, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return f"{name} ({', '.join(f for f in KIND_FLAGS if f in flags) or 'no AVX2'})"


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
            # hpo's precision per trial: `auto` decides by the check's timed steps.
            "precision": trial.params.get("fp_precision"),
            "start": offset + started - segment_start,
            "end": offset + ended - segment_start,
        })
    return sorted(rows, key=lambda row: row["end"])


PEERS = ("novice", "expert", "ray")
NAMES = {"hpo": "hpo run", "novice": "novice: Optuna + Trainer.hyperparameter_search",
         "expert": "expert: Optuna + Trainer, bf16 where native, grouped, eval batch 64",
         "ray": "Ray Tune: ASHA + OptunaSearch, expert switches"}


class Run:
    """One tool's search for one seed: a storage and the processes that ran in it."""

    def __init__(self, tool: str, seed: int, overrides: list[str], workdir: Path,
                 workers: int = 1) -> None:
        self.tool, self.seed, self.overrides, self.workers = tool, seed, overrides, workers
        self.storage = f"sqlite:///{workdir}/{tool}.db"
        self.ray_trials = workdir / "ray-trials.json"
        self.env = {**os.environ, "HPO_CACHE_DIR": str(workdir / "cache")}
        self.log = workdir / f"{tool}.log"
        self.segments: list[tuple[float, float]] = []

    def command(self, n_trials: int | None, timeout: float | None) -> list[str]:
        budget = ([f"--n-trials={n_trials}"] if n_trials else []) + (
            [f"--timeout={timeout:.0f}"] if timeout else [])
        if self.tool in ("novice", "expert"):
            return [sys.executable, str(HERE / "peer_trainer.py"), "--glue", self.tool,
                    "--storage", self.storage, "--study-name", "search", f"--seed={self.seed}",
                    *budget]
        if self.tool == "ray":
            return [sys.executable, str(HERE / "peer_ray.py"), f"--seed={self.seed}",
                    f"--n-trials={n_trials}", "--trials-out", str(self.ray_trials)]
        sets = [part for item in self.overrides for part in ("--set", item)]
        workers = [f"--workers={self.workers}"] if self.workers > 1 else []
        return ["hpo", "run", "--study", "demo", "--storage", self.storage, "--set",
                "study.name=search", "--set", f"study.sampler.seed={self.seed}", *sets,
                *budget, *workers]

    def go(self, n_trials: int | None = None, timeout: float | None = None) -> None:
        self.segments.append(timed(self.command(n_trials, timeout), self.env, self.log))

    @property
    def wall(self) -> float:
        return sum(wall for _, wall in self.segments)

    def trials(self) -> list[dict]:
        if self.tool != "ray":
            return trials_of(self.storage, "search", self.segments)
        (start, _), = self.segments
        rows = json.loads(self.ray_trials.read_text())["trials"]
        shifted = [{**row, "start": row["start"] - start, "end": row["end"] - start}
                   for row in rows]
        return sorted(shifted, key=lambda row: row["end"])

    def record(self, label: str, n_trials: int) -> dict:
        return {"tool": self.tool, "label": label, "seed": self.seed,
                "overrides": self.overrides, "n_trials": n_trials, "machine": cpu_model(),
                "versions": versions(), "date": date.today().isoformat(),
                "walls": [wall for _, wall in self.segments], "trials": self.trials()}


def _done(results: dict, tool: str, seed: int, label: str = "default") -> dict | None:
    return next((r for r in results["runs"] if (r["tool"], r["seed"], r["label"]) == (
        tool, seed, label) and r.get("machine", results["machine"]) == cpu_model()), None)


def measure(args: argparse.Namespace) -> dict:
    results = {"machine": cpu_model(), "cores": os.cpu_count(), "date": date.today().isoformat(),
               "versions": versions(), "n_trials": args.n_trials, "workers": args.workers,
               "runs": []}
    if args.append:
        results = stored.read(args.output)
        if results["n_trials"] != args.n_trials:
            raise SystemExit(f"{args.output} holds runs of {results['n_trials']} trials")
        if results.get("workers", 1) != args.workers:
            raise SystemExit(f"{args.output} holds runs of {results.get('workers', 1)} "
                             "worker(s)")
        # A tool whose code changed since its runs: they are run again for these seeds.
        results["runs"] = [r for r in results["runs"]
                           if not (r["tool"] in args.rerun and r["seed"] in args.seeds)]

    def save(record: dict) -> None:
        results["runs"] = [r for r in results["runs"] if not (
            (r["tool"], r["seed"], r["label"]) == (record["tool"], record["seed"],
                                                   record["label"])
            and r.get("machine", results["machine"]) == record["machine"])] + [record]
        stored.write_text(args.output, json.dumps(results, indent=1))

    peers = args.peers if args.peers is not None else list(PEERS) if args.default else []
    for seed in args.seeds:
        for tool in peers:
            if _done(results, tool, seed):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                run = Run(tool, seed, [], Path(tmp))
                run.go(n_trials=args.n_trials)
                print(f"seed {seed} {tool}: {args.n_trials} trials in {run.wall:.0f}s",
                      flush=True)
                record = run.record("default", args.n_trials)
                record["trial_budget_wall"] = run.wall
                save(record)
        if not args.default:
            continue
        ours = _done(results, "hpo", seed)
        if ours is None or sum(ours["walls"]) < longest_peer(results, seed):
            save(run_hpo(seed, "default", [], args.n_trials, longest_peer(results, seed)))
    for label, overrides in args.variants:
        for seed in args.seeds:
            if not _done(results, "hpo", seed, label):
                save(run_hpo(seed, label, overrides, args.n_trials,
                             longest_peer(results, seed), args.workers))
    return results


def longest_peer(results: dict, seed: int) -> float:
    return max((_done(results, tool, seed)["trial_budget_wall"] for tool in PEERS
                if _done(results, tool, seed)), default=0.0)


def run_hpo(seed: int, label: str, overrides: list[str], n_trials: int,
            longest: float, workers: int = 1) -> dict:
    """hpo for `n_trials`, then on the same study until it has run as long as the slowest
    peer: a setting is read at every peer's wall time, as the defaults are."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Run("hpo", seed, overrides, Path(tmp), workers)
        run.go(n_trials=n_trials)
        budget_wall = run.wall
        print(f"seed {seed} hpo {label}: {n_trials} trials in {run.wall:.0f}s", flush=True)
        if run.wall < longest:
            run.go(timeout=longest - run.wall)
            print(f"seed {seed} hpo {label}: extended to {run.wall:.0f}s", flush=True)
        record = run.record(label, n_trials)
        record["trial_budget_wall"] = budget_wall
        return record


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


def against(ours: dict, peer: dict, n: int) -> tuple[bool, float]:
    """G1's and G2's reading of one seed: whether hpo's best at the peer's wall for its
    trials is at least the peer's best, and when hpo reached that best, as a share of that
    wall (inf: never)."""
    wall = peer["trial_budget_wall"]
    final = best_by(first_n(peer["trials"], n), float("inf")) or 0.0
    at = reached(ours["trials"], final)
    return (best_by(ours["trials"], wall) or 0.0) >= final, (
        at / wall if at is not None else float("inf"))


def shown(best: float | None) -> str:
    return "-" if best is None else f"{best:.4f}"


def _runs(results: dict) -> list[dict]:
    """The runs, with the names and fields of today (earlier files called the novice peer
    "peer" and kept the machine only once)."""
    return [{**r, "tool": "novice" if r["tool"] == "peer" else r["tool"],
             "machine": r.get("machine", results["machine"])} for r in results["runs"]]


def compared(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """Each seed's default runs on the machine its hpo run was on: a seed compares tools on
    one machine, and different seeds may come from different CPU kinds."""
    machine_of = {r["seed"]: r["machine"] for r in runs
                  if r["tool"] == "hpo" and r["label"] == "default"}
    return {(r["tool"], r["seed"]): r for r in runs
            if r["label"] == "default" and machine_of.get(r["seed"]) == r["machine"]}


def head_to_head(variant: dict, default: dict, n: int) -> bool:
    """Whether a variant's best, when hpo's default had run its `n` trials, is at least the
    default's best then."""
    theirs = best_by(first_n(default["trials"], n), float("inf")) or 0.0
    return (best_by(variant["trials"], default["trial_budget_wall"]) or 0.0) >= theirs


def render(results: dict, plot: Path) -> str:
    runs = _runs(results)
    n = results["n_trials"]
    if not any(r["tool"] == "hpo" and r["label"] == "default" for r in runs):
        # --no-default: the variants against the first.
        return render_variants(runs, n, plot, results.get("workers", 1))
    default = compared(runs)
    seeds = sorted({seed for tool, seed in default if tool == "hpo"})
    peers = [t for t in PEERS if any((t, seed) in default for seed in seeds)]
    machines = list(dict.fromkeys(default[("hpo", seed)]["machine"] for seed in seeds))
    lines = [f"Result ({results['cores']} cores; {n} trials per run; seeds "
             f"{', '.join(map(str, seeds))}; each seed's tools ran on one machine, one after "
             "another, alone):", ""]
    for machine in machines:
        on = [seed for seed in seeds if default[("hpo", seed)]["machine"] == machine]
        v = default[("hpo", on[0])].get("versions", results["versions"])
        day = default[("hpo", on[0])].get("date", results["date"])
        lines.append(f"- {machine}: seed{'s' if len(on) > 1 else ''} "
                     f"{', '.join(map(str, on))} (torch {v['torch']}, transformers "
                     f"{v['transformers']}, optuna {v['optuna']}; {day})")
    lines.append("")
    goals: dict[str, tuple[list[bool], list[float]]] = {t: ([], []) for t in peers}
    for seed in seeds:
        ours = default[("hpo", seed)]
        ran = sum(ours["walls"])
        lines += [f"Seed {seed} ({ours['machine']}):", "",
                  f"| tool | wall for {n} trials | best after {n} trials | pruned + failed "
                  f"compute | hpo's best at this wall | hpo reaches this tool's best at |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for tool in ("hpo", *peers):
            record = default.get((tool, seed))
            if record is None:
                continue
            own = first_n(record["trials"], n)
            wall = record["trial_budget_wall"]
            final = best_by(own, float("inf"))
            ours_then, reach = "", ""
            if tool != "hpo":
                then = best_by(ours["trials"], wall)
                short = f" (hpo ran only {ran:.0f} s)" if ran < wall else ""
                ours_then = f"{shown(then)}{short}"
                at = reached(ours["trials"], final) if final is not None else None
                reach = f"{at:.0f} s ({at / wall:.0%})" if at is not None else "never"
                win, ratio = against(ours, record, n)
                goals[tool][0].append(win)
                goals[tool][1].append(ratio)
            lines.append(f"| {NAMES[tool]} | {wall:.0f} s | {shown(final)} | "
                         f"{wasted_share(own):.0%} | {ours_then} | {reach} |")
        lines.append("")
    lines += ["Goals per peer (G1: at the peer's wall time for its trials, hpo's best is at "
              "least the peer's in at least 4 of 5 seeds; G2: the median time hpo needs to "
              "reach the peer's final best is at most half the peer's wall time):", ""]
    for tool in peers:
        wins, ratios = goals[tool]
        median = statistics.median(ratios)
        shown_median = "never" if median == float("inf") else f"{median:.0%}"
        g1 = ("met" if sum(wins) >= 4 else
              "open" if sum(wins) + max(0, 5 - len(wins)) >= 4 else "not met")
        lines.append(
            f"- {NAMES[tool]}: G1 **{g1}** ({sum(wins)} of {len(wins)} seeds"
            f"{'' if len(wins) >= 5 else ', of 5 planned'});"
            f" G2 **{'met' if median <= 0.5 else 'not met'}** (median {shown_median}; per seed "
            f"{', '.join('never' if r == float('inf') else f'{r:.0%}' for r in ratios)}).")
    lines.append("")
    variants = [r for r in runs if r["tool"] == "hpo"
                and default.get(("hpo", r["seed"]), {}).get("machine") == r["machine"]]
    labels = list(dict.fromkeys(r["label"] for r in variants))
    if len(labels) > 1:
        lines += ["hpo's settings, each run as the defaults are (the trial budget, then on to "
                  "the slowest peer's wall time), on the seeds each ran:", "",
                  "| " + " | ".join(
                      ["setting", "overrides", "seeds", "best after the trial budget",
                       "pruned + failed compute", "vs default at its wall: as good or better",
                       *(f"vs {t}: G1 wins, G2 median" for t in peers)]) + " |",
                  "| --- | --- | --- | ---: | ---: | ---: |" + " ---: |" * len(peers)]
        for label in labels:
            chosen = sorted((r for r in variants if r["label"] == label),
                            key=lambda r: r["seed"])
            bests = [best_by(first_n(r["trials"], n), float("inf")) or 0 for r in chosen]
            heads = [head_to_head(r, default[("hpo", r["seed"])], n) for r in chosen]
            cells = ["-" if label == "default" else f"{sum(heads)} of {len(heads)}"]
            for tool in peers:
                pairs = [against(r, default[(tool, r["seed"])], n) for r in chosen
                         if (tool, r["seed"]) in default]
                median = statistics.median(ratio for _, ratio in pairs) if pairs else None
                cells.append(f"{sum(win for win, _ in pairs)} of {len(pairs)}, "
                             + ("-" if median is None else "never" if median == float("inf")
                                else f"{median:.0%}"))
            lines.append(
                f"| {label} | {'; '.join(chosen[0]['overrides']) or '-'} | "
                f"{', '.join(str(r['seed']) for r in chosen)} | "
                f"{' / '.join(f'{b:.4f}' for b in bests)} | "
                f"{statistics.mean(wasted_share(first_n(r['trials'], n)) for r in chosen):.0%} | "
                + " | ".join(cells) + " |")
        lines.append("")
    others = sorted({(r["tool"], r["seed"], r["machine"]) for r in runs
                     if r["label"] == "default" and default.get((r["tool"], r["seed"])) is not r})
    if others:
        lines += ["Runs on another machine than their seed's hpo run, not compared here: "
                  + "; ".join(f"{NAMES[t]} seed {s} ({m})" for t, s, m in others) + ".", ""]
    draw(default, seeds, plot)
    lines.append(f"![anytime curves]({plot.name})")
    return "\n".join(lines)


def render_variants(runs: list[dict], n: int, plot: Path, workers: int = 1) -> str:
    """hpo's variants alone (--no-default), each seed's against the first variant's run of
    that seed on the same machine: as `render` compares a variant with the defaults."""
    labels = list(dict.fromkeys(r["label"] for r in runs if r["tool"] == "hpo"))
    by = {(r["label"], r["seed"]): r for r in runs if r["tool"] == "hpo"}
    base = labels[0]
    seeds = sorted(seed for label, seed in by if label == base)
    on = f" on {workers} workers" if workers > 1 else ""
    lines = [f"hpo's variants, {n} trials each{on}, against {base} ({', '.join(labels)}):", "",
             "| seed | machine | " + " | ".join(
                 f"{label}: wall, best, pruned + failed compute" for label in labels)
             + " | " + " | ".join(f"{label}: best at {base}'s wall, reaches {base}'s best at"
                                  for label in labels[1:]) + " |",
             "| ---: | --- |" + " ---: |" * (2 * len(labels) - 1)]
    for seed in seeds:
        ref = by[(base, seed)]
        target = best_by(first_n(ref["trials"], n), float("inf")) or 0.0
        cells = []
        for label in labels:
            run = by.get((label, seed))
            cells.append("-" if run is None else
                         f"{run['trial_budget_wall']:.0f} s, "
                         f"{best_by(first_n(run['trials'], n), float('inf')) or 0:.4f}, "
                         f"{wasted_share(first_n(run['trials'], n)):.0%}")
        for label in labels[1:]:
            run = by.get((label, seed))
            if run is None or run["machine"] != ref["machine"]:
                cells.append("-")
                continue
            then = best_by(run["trials"], ref["trial_budget_wall"]) or 0.0
            at = reached(sorted(run["trials"], key=lambda t: t["end"]), target)
            cells.append(f"{then:.4f}, " + ("never" if at is None else
                                             f"{at:.0f} s ({at / ref['trial_budget_wall']:.0%})"))
        lines.append(f"| {seed} | {ref['machine']} | " + " | ".join(cells) + " |")
    lines.append("")
    draw({(label, seed): run for (label, seed), run in by.items()}, seeds, plot)
    lines.append(f"![anytime curves]({plot.name})")
    return "\n".join(lines)


def draw(default: dict, seeds: list[int], plot: Path) -> None:
    """Each run's best so far over wall time; keyed (tool, seed), or (variant, seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9, 5))
    colours = {"hpo": "tab:blue", "novice": "tab:orange", "expert": "tab:green",
               "ray": "tab:red"}
    spare = iter(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
    for (tool, seed), record in sorted(default.items()):
        if seed not in seeds:
            continue
        if tool not in colours:
            colours[tool] = next(spare, "tab:gray")
        xs, ys, best = [0.0], [0.0], 0.0
        for trial in record["trials"]:
            if trial["state"] == "COMPLETE" and trial["value"] > best:
                best = trial["value"]
            xs.append(trial["end"])
            ys.append(best)
        xs.append(sum(record["walls"]))
        ys.append(best)
        axes.step(xs, ys, where="post", color=colours[tool], alpha=0.8,
                  linestyle=("-", "--", ":", "-.", (0, (1, 4)))[seeds.index(seed) % 5],
                  label=f"{NAMES.get(tool, tool)}, seed {seed}")
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel("best validation macro-F1 so far")
    axes.set_title("Demo study: best score over wall time (1 worker, all cores)")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=6, loc="lower right", ncol=2)
    figure.tight_layout()
    figure.savefig(plot, dpi=110)


def variant(text: str) -> tuple[str, list[str]]:
    label, _, overrides = text.partition("=")
    if not label or not overrides:
        raise argparse.ArgumentTypeError(f"expected NAME=KEY=VALUE[;KEY=VALUE...], got {text!r}")
    return label, overrides.split(";")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--variant", dest="variants", type=variant, action="append",
                        default=[], metavar="NAME=KEY=VALUE[;KEY=VALUE...]")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=None,
                        help="the peers to run (none: hpo only; default: every peer, none "
                             "with --no-default)")
    parser.add_argument("--no-default", dest="default", action="store_false",
                        help="run hpo's variants, not its default (the --peers a seed lacks "
                             "are still run; with --append: add them to --output)")
    parser.add_argument("--workers", type=int, default=1,
                        help="hpo's workers on this host (`hpo run --workers`), each on its "
                             "share of the cores; above 1 only with --no-default: the peers "
                             "run one trial at a time")
    parser.add_argument("--append", action="store_true",
                        help="add this invocation's runs to those already in --output")
    parser.add_argument("--rerun", nargs="*", choices=("hpo", *PEERS), default=[],
                        help="with --append: run these tools again for --seeds (their code "
                             "changed since)")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "search_quality.json")
    parser.add_argument("--plot", type=Path, default=HERE / "results" / "search_quality.png")
    parser.add_argument("--render", type=Path, default=None,
                        help="write the report again from this JSON; run nothing")
    args = parser.parse_args()
    if args.workers < 1 or (args.workers > 1 and args.default):
        parser.error("--workers must be at least 1, and above 1 needs --no-default")
    if args.workers > 1 and args.peers:
        parser.error("--workers above 1 runs no peer: the peers run one trial at a time")
    results = (stored.read(args.render) if args.render is not None
               else measure(args))
    print(render(results, args.plot))


if __name__ == "__main__":
    main()
