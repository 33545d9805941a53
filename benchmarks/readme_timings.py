"""The README's timings, measured as a newcomer meets them: hpo installed by the README's
command into a fresh virtual environment, then, `--runs` times, the demo search, `hpo final`
and the README's pipeline snippet, each run in an empty directory with a cold tokenization
cache.

    python benchmarks/readme_timings.py [--runs 3] [--n-trials 20] [--keep-output DIR]

Prints a markdown table (the range over the runs of each command's wall time, and of the
MiniLM trials' `trial_seconds`) and the CPU it ran on; `--keep-output` keeps each run's
printed output there, for the README's sample. Run it alone: it trains models for minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MINILM = "sentence-transformers/all-MiniLM-L6-v2"


def readme_snippet() -> str:
    """The README's pipeline snippet, the Python between `python - <<'EOF'` and `EOF`."""
    text = (REPO / "README.md").read_text()
    return text.split("python - <<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def cpu_kind() -> str:
    """The CPU kinds DESIGN.md names, from the flags that decide which precisions are native."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if "amx_bf16" in flags:
        return "AMX-BF16 Xeon"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    return "AVX2" if "avx2" in flags else "other"


def install(where: Path) -> Path:
    """The README's install command in a fresh virtual environment; returns its bin directory."""
    venv.create(where, with_pip=True)
    bin_dir = where / "bin"
    began = time.perf_counter()
    subprocess.run([bin_dir / "pip", "install", "-q", "torch==2.13.0", "-e", str(REPO)],
                   check=True)
    print(f"installed in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return bin_dir


def timed(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> float:
    began = time.perf_counter()
    with log.open("w") as out:
        subprocess.run(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                       check=True)
    return time.perf_counter() - began


def minilm_trial_seconds(database: Path) -> list[float]:
    """`trial_seconds` of the finished MiniLM trials, read from the SQLite file directly."""
    query = """
        SELECT a.value_json FROM trial_user_attributes a
        JOIN trials t ON t.trial_id = a.trial_id
        JOIN trial_params p ON p.trial_id = t.trial_id
        WHERE a.key = 'trial_seconds' AND p.param_name = 'model_name'
          AND t.state IN ('COMPLETE', 'PRUNED')"""
    with sqlite3.connect(database) as connection:
        rows = connection.execute(query + " AND p.param_value = ?", (
            models(connection).index(MINILM),)).fetchall()
    return [float(json.loads(value)) for (value,) in rows]


def models(connection: sqlite3.Connection) -> list[str]:
    """The categorical choices of model_name, in their order: trial_params store indices."""
    (distribution,) = connection.execute(
        "SELECT distribution_json FROM trial_params WHERE param_name = 'model_name' "
        "LIMIT 1").fetchone()
    return json.loads(distribution)["attributes"]["choices"]


def one_run(bin_dir: Path, root: Path, n_trials: int) -> dict[str, float | list[float]]:
    work, cache = root / "work", root / "cache"
    work.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "HPO_CACHE_DIR": str(cache), "VIRTUAL_ENV": str(bin_dir.parent)}
    env.pop("HPO_STORAGE", None)
    run = timed(["hpo", "run", "--study", "demo", "--n-trials", str(n_trials)], work, env,
                root / "run.log")
    final = timed(["hpo", "final", "--study", "demo"], work, env, root / "final.log")
    snippet = timed([bin_dir / "python", "-c", readme_snippet()], work, env, root / "snippet.log")
    return {"run": run, "final": final, "snippet": snippet,
            "minilm": minilm_trial_seconds(work / "hpo.db")}


def span(values: list[float], unit: float = 1.0, digits: int = 0) -> str:
    low, high = min(values) / unit, max(values) / unit
    return f"{low:.{digits}f}-{high:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n-trials", type=int, default=20)
    parser.add_argument("--keep-output", type=Path, default=None)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="hpo-readme-") as scratch:
        bin_dir = install(Path(scratch) / "venv")
        for k in range(args.runs):
            root = Path(scratch) / f"run{k}"
            root.mkdir()
            results.append(one_run(bin_dir, root, args.n_trials))
            print(f"run {k + 1}: {results[-1]}", file=sys.stderr)
            if args.keep_output:
                args.keep_output.mkdir(parents=True, exist_ok=True)
                for log in ("run", "final", "snippet"):
                    (args.keep_output / f"{log}{k + 1}.log").write_text(
                        (root / f"{log}.log").read_text())
    minilm = [s for r in results for s in r["minilm"]]
    print(f"CPU: {cpu_model()} ({cpu_kind()}), {os.cpu_count()} cores; {args.runs} runs, "
          f"each from an empty directory with a cold tokenization cache, in one fresh venv\n")
    print("| command | wall time over the runs |")
    print("|---|---|")
    print(f"| `hpo run --study demo --n-trials {args.n_trials}` | "
          f"{span([r['run'] for r in results], 60, 1)} min |")
    print(f"| `hpo final --study demo` | {span([r['final'] for r in results])} s |")
    print(f"| the README's pipeline snippet | {span([r['snippet'] for r in results])} s |")
    print(f"| one MiniLM trial (`trial_seconds`, {len(minilm)} trials) | {span(minilm, 1, 1)} s |")


if __name__ == "__main__":
    main()
