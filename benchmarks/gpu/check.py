"""The GPU check (issue 42): hpo's CUDA paths run for real, each step's figures written to
OUT/gpu.json as soon as the step ends, with its status, so a step that fails or a run cut off
keeps what the earlier steps wrote.

    python benchmarks/gpu/check.py --out OUT [--seconds 450]   # on the GPU (run.sh calls it)
    python benchmarks/gpu/check.py --out OUT --rehearse        # here, every step on the CPU

The steps: (a) `hpo hardware`; (b) full-size replicas of the redsm5 study's four models and
`hpo check` over them at 512 tokens; (c) the batch search per model x precision against a
direct bisection of the true limit, and training at the batch it chose; (d) a real CUDA
out-of-memory error (the process's memory capped) turned into a pruned trial, the worker going
on and its memory given back; (e) a study of one-epoch trials by two workers on the one GPU,
bf16 and fp16, then `hpo final` and a plain pipeline; (f) hpo's loop against the Trainer's
strongest set-up on bert-base at 512 tokens, with model-FLOPs utilisation against the bf16
matrix-product rate measured in the same run; (g) `fp_precision: auto` decided by `hpo run`;
(h) (f) at steady state, 2,000 optimizer steps a side; (i) a ReDSM5-sized study of 8 bert-base
trials by one worker, then by K workers sharing the GPU (`--workers gpus:K`). The rehearsal
runs each on this CPU with tiny replicas of the same families and formats, the GPU's
out-of-memory errors injected (HPO_FAULT_OOM_ABOVE_BATCH) and one GPU mocked for
`--workers gpus:K` (HPO_FAULT_GPUS), in a few minutes.

On the GPU the steps run in STEPS' order, what the next run must show first, and a step whose
time on an H200 (ESTIMATES) no longer fits in what is left of `--seconds` is skipped, so that
the run's budget is never spent on a step the cut-off would kill.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "benchmarks"))

import replicas  # noqa: E402

SYMPTOM_CSV = ("post_id", "sentence_id", "sentence_text", "DSM5_symptom", "status",
               "explanation")


@dataclass(frozen=True)
class Setting:
    """What the check runs with: the GPU's full sizes, or the rehearsal's small ones."""

    device: str
    max_length: int
    max_batch: int  # training.max_physical_batch_size
    posts: int  # synthetic posts, each filling max_length
    trials: int  # the two-worker study's budget
    precisions: tuple[str, ...]  # the study's, where both must be searched
    rehearse: bool
    # (h): throughput.py's synthetic posts (lognormal lengths), `steady_epochs` of
    # `steady_posts` at batch `steady_batch`: posts / batch x epochs optimizer steps a side,
    # the first `warmup_steps` of them left out of the steady figures.
    steady_posts: int
    steady_epochs: int
    steady_batch: int
    warmup_steps: int
    # (i): a study of `workers_trials` trials of `workers_epochs` epochs on `workers_posts`
    # posts in the shipped sample's format, by one worker, then by `workers_per_gpu` on one GPU.
    workers_posts: int
    workers_epochs: int
    workers_trials: int
    workers_batch: int
    workers_per_gpu: int


GPU = Setting("cuda", 512, 256, 400, 12, ("bf16", "fp16"), rehearse=False,
              steady_posts=4000, steady_epochs=16, steady_batch=32, warmup_steps=100,
              workers_posts=1500, workers_epochs=5, workers_trials=8, workers_batch=32,
              workers_per_gpu=4)
REHEARSAL = Setting("cpu", 64, 16, 120, 4, ("none",), rehearse=True,
                    steady_posts=96, steady_epochs=2, steady_batch=16, warmup_steps=2,
                    workers_posts=100, workers_epochs=2, workers_trials=4, workers_batch=8,
                    workers_per_gpu=2)
# The rehearsal's stand-in for a GPU holding 6 samples of any model.
REHEARSAL_OOM_ABOVE = "6"


class Report:
    """OUT/gpu.json, rewritten whole after every step."""

    def __init__(self, out: Path, setting: Setting) -> None:
        self.path = out / "gpu.json"
        self.data: dict[str, Any] = {"rehearsal": setting.rehearse, "started": time.time(),
                                     "steps": {}}
        self._write()

    def step(self, name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        print(f"== step {name}", flush=True)
        began = time.perf_counter()
        try:
            figures = run()
            problems = figures.pop("problems", [])
            status = "ok" if not problems else "failed"
        except Exception as exc:
            traceback.print_exc()
            figures, problems, status = {}, [f"{type(exc).__name__}: {exc}"], "error"
        result = {"status": status, "seconds": round(time.perf_counter() - began, 1),
                  "problems": problems, **figures}
        if "torch" in sys.modules:
            # Steps run in this process leave the allocator's cache behind (9 GB after `loop`
            # on the H200), which the study step's workers would see as another process's.
            from hpo.training.memory import release_memory

            release_memory()
        self.data["steps"][name] = result
        self._write()
        print(f"== step {name}: {status} in {result['seconds']} s"
              + "".join(f"\n   problem: {p}" for p in problems), flush=True)
        return result

    def skip(self, name: str, why: str) -> None:
        """A step not run, and why: it stays in gpu.json, so a reader sees what is missing."""
        self.data["steps"][name] = {"status": "skipped", "seconds": 0.0, "problems": [],
                                    "why": why}
        self._write()
        print(f"== step {name}: skipped ({why})", flush=True)

    def _write(self) -> None:
        partial = self.path.with_suffix(".partial")
        partial.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        partial.replace(self.path)


def hpo(*args: str, env: dict[str, str] | None = None, prefix: list[str] | None = None,
        log: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """`hpo ARGS` by this interpreter; its output goes to the run's log."""
    command = [*(prefix or [sys.executable, "-m", "hpo.cli"]), *args]
    print("$ hpo " + " ".join(args), flush=True)
    result = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True,
                            text=True)
    print(result.stdout[-3000:] + result.stderr[-3000:], flush=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"hpo {' '.join(args)} exited {result.returncode}: "
                           f"{result.stderr.strip().splitlines()[-1:]}")
    return result


# --- data and models -----------------------------------------------------------------------

def long_posts(out: Path, n: int, words: int, seed: int = 0) -> Path:
    """A ReDSM5-format directory of `n` posts of about `words` words each, each the demo's
    posts strung together, with their annotations: long enough to fill max_length tokens."""
    demo = REPO / "data" / "demo"
    with (demo / "redsm5_posts.csv").open(encoding="utf-8", newline="") as handle:
        posts = list(csv.DictReader(handle))
    with (demo / "redsm5_annotations.csv").open(encoding="utf-8", newline="") as handle:
        notes: dict[str, list[dict]] = {}
        for row in csv.DictReader(handle):
            notes.setdefault(row["post_id"], []).append(row)
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    rows, annotations = [], []
    for k in range(n):
        post_id, text, parts = f"gpu_{k:05d}", [], []
        while sum(len(t.split()) for t in text) < words:
            part = rng.choice(posts)
            text.append(part["text"])
            parts.append(part["post_id"])
        rows.append({"post_id": post_id, "text": " ".join(text)})
        for index, row in enumerate(r for p in dict.fromkeys(parts) for r in notes.get(p, [])):
            annotations.append({**row, "post_id": post_id, "sentence_id": f"{post_id}_{index}"})
    _write_csv(out / "redsm5_posts.csv", ("post_id", "text"), rows)
    _write_csv(out / "redsm5_annotations.csv", SYMPTOM_CSV, annotations)
    return out


def data_dir(work: Path, setting: Setting) -> Path:
    """The steps' posts, written by the first step that needs them."""
    data = work / "data"
    if not (data / "redsm5_annotations.csv").exists():
        long_posts(data, setting.posts, words=setting.max_length)
    return data


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def models(work: Path, setting: Setting) -> dict[str, Path]:
    """The four replicas by name: full size on the GPU, tiny in the rehearsal."""
    made = {}
    for name in replicas.FAMILIES:
        dest = work / "models" / name
        weights = [*dest.glob("*.safetensors"), *dest.glob("pytorch_model.bin")]
        if not weights:  # built once per run, by the first step that needs them
            (replicas.tiny if setting.rehearse else replicas.build)(name, dest)
        made[name] = dest
    return made


def study_file(path: Path, data: Path, model_dirs: list[Path], setting: Setting,
               **changes: Any) -> Path:
    """A study like redsm5.yaml over local models and data, one epoch per trial."""
    spec = {
        "study": {"name": path.stem, "sampler": {"name": "random", "seed": 0},
                  "pruner": {"name": "none"}, "keep_best": 0},
        "data": {"dir": str(data), "max_length": setting.max_length,
                 "validation_fraction": 0.15, "test_fraction": 0.15},
        "search_space": {"model_name": [str(m) for m in model_dirs],
                         "fp_precision": list(setting.precisions),
                         "target_effective_batch_size": [16, 32],
                         "learning_rate": {"low": 2.0e-5, "high": 1.0e-4, "log": True}},
        "training": {"epochs": 1, "max_physical_batch_size": setting.max_batch,
                     "device": setting.device},
    }
    for dotted, value in changes.items():
        section, key = dotted.split("__")
        spec[section][key] = value
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


# --- the steps -------------------------------------------------------------------------------

def step_hardware(setting: Setting) -> dict[str, Any]:
    import torch

    from hpo.app import hardware_report
    from hpo.hardware import configure_backends, detect

    device = detect(setting.device)
    configure_backends(device)
    # The rehearsal times one step: an emulated precision's takes seconds on some CPUs.
    report = hardware_report.inspect(device, steps=1 if setting.rehearse else 3)
    print(hardware_report.render(report), flush=True)
    tf32 = {"matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}
    figures = {
        "device": device.describe(), "name": device.name,
        "compute_capability": device.compute_capability,
        "memory_gib": round(device.total_memory / 2**30, 1), "support": report.support,
        # What was timed: on a GPU a base-size BERT at 8 x 512 (the small one only where
        # that ran out of memory), each precision's median step, its peak memory and spread.
        "shape": report.shape.describe(),
        "ms_per_step": {m.precision: round(1000 * m.step_seconds, 2)
                        for m in report.measurements},
        "speedup_over_fp32": {m.precision: round(m.speedup, 3) for m in report.measurements},
        "peak_mib": {m.precision: round(m.peak_memory_mb, 1) for m in report.measurements},
        "spread": {m.precision: round(m.spread, 3) for m in report.measurements},
        "auto_hint": None if report.by_cost is None else {
            "kept": list(report.by_cost.kept), "dropped": report.by_cost.dropped},
        "tf32": tf32,
    }
    problems = [] if report.measurements else ["no step was timed"]
    if not setting.rehearse:
        problems += [f"{p} is not native" for p in ("bf16", "fp16")
                     if report.support[p] != "native"]
        if report.shape != hardware_report.SHAPES["cuda"]:
            problems.append(f"`hpo hardware` timed the {report.shape.describe()}, not the "
                            f"base-size BERT (it ran out of memory)")
        if tf32["matmul_precision"] == "highest" or not tf32["cudnn_allow_tf32"]:
            problems.append(f"TF32 is off: {tf32}")
    return {**figures, "problems": problems}


def step_check(work: Path, setting: Setting) -> dict[str, Any]:
    made = models(work, setting)
    data = data_dir(work, setting)
    study = study_file(work / "check.yaml", data, list(made.values()), setting,
                       search_space__fp_precision="native")
    storage = f"sqlite:///{work / 'check.db'}"
    hpo("check", "--config", str(study), "--storage", storage)
    import optuna

    from hpo.hardware import detect
    from hpo.trial import step_check

    stored = optuna.load_study(study_name="check", storage=storage)
    verdicts = step_check.stored(stored, detect(setting.device)) or []
    rows = [{"model": Path(v.model).name, "precision": v.precision, "usable": v.usable,
             "step_seconds": v.step_seconds, "peak_mib": v.peak_mib, "why": v.why}
            for v in verdicts]
    expected = len(made) * (len(setting.precisions) + (0 if setting.rehearse else 1))
    problems = [f"{r['model']} {r['precision']}: {r['why']}" for r in rows if not r["usable"]]
    if len(rows) < expected:
        problems.append(f"{len(rows)} verdicts, expected {expected}")
    return {"verdicts": rows, "problems": problems}


def step_auto(work: Path, setting: Setting) -> dict[str, Any]:
    """`fp_precision: auto` decided on this device as `hpo run` decides it, over the four
    models at redsm5.yaml's smallest effective batch (32), and one trial run."""
    import optuna

    from hpo.search.study import PIN_ATTR

    made = models(work, setting)
    study = study_file(work / "auto.yaml", data_dir(work, setting), list(made.values()),
                       setting, search_space__fp_precision="auto",
                       search_space__target_effective_batch_size=[32, 64])
    storage = f"sqlite:///{work / 'auto.db'}"
    hpo("run", "--config", str(study), "--storage", storage, "--n-trials", "1")
    stored = optuna.load_study(study_name="auto", storage=storage)
    pinned = json.loads(stored.user_attrs[PIN_ATTR]) if isinstance(
        stored.user_attrs[PIN_ATTR], str) else stored.user_attrs[PIN_ATTR]
    kept = pinned.get("fp_precision")
    problems = []
    if not kept or (pinned.get("decided") or {}).get("by") != "cost":
        problems.append(f"auto decided nothing from the check's timings: {pinned}")
    elif not setting.rehearse and list(kept) == ["none"]:
        problems.append(f"auto kept fp32 alone on a device with native bf16 and fp16: {pinned}")
    return {"pinned": pinned, "problems": problems}


def largest_fitting(step: Callable[[int], None], bound: int) -> tuple[int, int]:
    """The true largest batch in [1, bound], by plain bisection (no memory model), and the
    steps it took: the reference the batch search is judged against."""
    from hpo.training.memory import fits

    if fits(step, bound):
        return bound, 1
    low, high, steps = 0, bound, 1
    while high - low > 1:
        mid = (low + high) // 2
        steps += 1
        low, high = (mid, high) if fits(step, mid) else (low, mid)
    return low, steps


def _search_one(name: str, path: Path, precision: str, setting: Setting) -> dict[str, Any]:
    import torch

    from hpo.hardware import detect
    from hpo.training import memory
    from hpo.training.models import ModelStore
    from hpo.training.train import Plan, prepare, probe_step
    from hpo.trial import batch_limit

    device = detect(setting.device)
    plan = Plan(precision=precision, effective_batch=setting.max_batch, physical_batch=1,
                eval_batch=1, learning_rate=5e-5, weight_decay=0.01, warmup_ratio=0.0,
                max_grad_norm=1.0, epochs=1, seed=0)
    store = ModelStore()
    holder: dict[str, torch.nn.Module] = {}

    def step(batch: int) -> None:
        if "model" not in holder:
            holder["model"] = prepare(store.build(str(path), 9, seed=0), plan, device)
        holder["model"].zero_grad(set_to_none=True)
        probe_step(holder["model"], plan, device, batch, setting.max_length)

    found = batch_limit.search(step, setting.max_batch, batch_limit.BatchLimit(),
                               memory.device_memory_probe(device))
    physical = batch_limit.physical_batch(found.limit, setting.max_batch, 0.9)
    true, bisection_steps = largest_fitting(step, setting.max_batch)
    mark = memory.device_memory(device)
    for _ in range(3):  # training at the chosen batch: an OOM here is the check's failure
        step(physical)
    peak = memory.after_trial(device, mark)
    holder.clear()
    memory.release_memory()
    row = {"model": name, "precision": precision, "found_limit": found.limit.largest_ok,
           "probes": found.probes, "physical_batch": physical, "true_largest": true,
           "bisection_steps": bisection_steps,
           "peak_mib_at_physical": None if peak is None else round(peak.peak, 1)}
    row["ok"] = physical >= int(0.9 * true) and found.limit.largest_ok <= true
    return row


def step_batch_search(work: Path, setting: Setting) -> dict[str, Any]:
    from hpo.hardware import detect, native_precisions

    made = models(work, setting)
    precisions = [p for p in native_precisions(detect(setting.device)) if p != "none"]
    precisions = precisions or ["none"]
    if setting.rehearse:
        os.environ["HPO_FAULT_OOM_ABOVE_BATCH"] = REHEARSAL_OOM_ABOVE
    try:
        rows = [_search_one(name, path, precision, setting)
                for name, path in made.items() for precision in precisions]
    finally:
        os.environ.pop("HPO_FAULT_OOM_ABOVE_BATCH", None)
    problems = [f"{r['model']} {r['precision']}: chose {r['physical_batch']} for a true "
                f"limit of {r['true_largest']}" for r in rows if not r["ok"]]
    return {"searches": rows, "problems": problems}


# A memory cap under which bert-base cannot hold its weights, gradients and AdamW state
# (about 1.8 GB in fp32), while a tiny model trains.
OOM_CAP_BYTES = 1 << 30


def step_oom(work: Path, setting: Setting) -> dict[str, Any]:
    import optuna

    made = models(work, setting)
    # Around the model that cannot fit, one that can: a tiny BERT on the GPU (in the
    # rehearsal, where every model "runs out of memory", another replica), trained before
    # and after it.
    tiny = made["roberta-base"] if setting.rehearse else replicas.tiny(
        "bert-base-uncased", work / "models" / "tiny-bert")
    data = data_dir(work, setting)
    big = {"model_name": str(made["bert-base-uncased"]), "fp_precision":
           setting.precisions[0], "target_effective_batch_size": 16, "learning_rate": 5e-5}
    small = {**big, "model_name": str(tiny)}
    study = study_file(work / "oom.yaml", data, [made["bert-base-uncased"], tiny], setting,
                       search_space__fp_precision=[setting.precisions[0]],
                       study__enqueue=[small, big, small])
    storage = f"sqlite:///{work / 'oom.db'}"
    if setting.rehearse:  # a "GPU" that holds no sample: every trial ends out of memory
        env, prefix = {"HPO_FAULT_OOM_ABOVE_BATCH": "0"}, None
    else:
        env, prefix = {}, [sys.executable, "-c", (
            "import sys, torch; torch.cuda.set_per_process_memory_fraction("
            f"{OOM_CAP_BYTES} / torch.cuda.get_device_properties(0).total_memory); "
            "from hpo.cli import main; sys.exit(main(sys.argv[1:]))")]
    hpo("run", "--config", str(study), "--storage", storage, "--n-trials", "3", "--skip-check",
        env=env, prefix=prefix)
    trials = optuna.load_study(study_name="oom", storage=storage).trials
    rows = [{"trial": t.number, "model": Path(t.params["model_name"]).name,
             "state": t.state.name, "prune_reason": t.user_attrs.get("prune_reason"),
             **{k: t.user_attrs.get(k) for k in ("memory_before_mib", "peak_memory_mib",
                                                 "memory_after_mib", "error")}}
            for t in trials]
    problems = oom_problems(rows, setting.rehearse)
    # The three-trial criterion's figures side by side: what trial 0 (tiny), 1 (bert-base,
    # OOM) and 2 (tiny) left allocated; 1 and 2 may not exceed 0 (None on a CPU).
    return {"trials": rows, "memory_after_mib": [r["memory_after_mib"] for r in rows],
            "problems": problems}


def oom_problems(rows: list[dict[str, Any]], rehearse: bool) -> list[str]:
    """Trial 1 (bert-base) pruned as out of memory and the worker on to trial 2; on the GPU,
    the tiny model's trials 0 and 2 complete, and the OOM leaves no more memory allocated
    than a completed trial does. A process keeps some memory for good from its first trial
    on (benchmarks/README.md, "On a GPU"), which trial 0 measures: a leak would show as more
    after trial 1 or trial 2 than after trial 0."""
    if len(rows) != 3:
        return [f"3 trials expected (the worker goes on after the OOM): {len(rows)}"]
    problems = []
    if rows[1]["state"] != "PRUNED" or rows[1]["prune_reason"] != "oom":
        problems.append(f"bert-base's trial did not end PRUNED (oom): {rows[1]}")
    if rehearse:
        return problems
    problems += [f"the tiny model's trial {k}: {rows[k]}" for k in (0, 2)
                 if rows[k]["state"] != "COMPLETE"]
    normal = rows[0]["memory_after_mib"]
    for k in (1, 2):
        after = rows[k]["memory_after_mib"]
        if normal is None or after is None or after > normal + 1.0:
            problems.append(f"memory not given back: {after} MiB left after trial {k}, "
                            f"against {normal} MiB after trial 0")
    return problems


def _workers(study: Path, storage: str, n: int, setting: Setting) -> list[int]:
    """Two `hpo run` workers on one study at once; their exit codes."""
    command = [sys.executable, "-m", "hpo.cli", "run", "--config", str(study), "--storage",
               storage, "--n-trials", str(n), "--skip-check"]
    logs = [(study.parent / f"worker{k}.log").open("w") for k in range(2)]
    processes = []
    for log in logs:
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT))
        time.sleep(2)  # the first creates the study; the second joins it
    codes = [p.wait() for p in processes]
    for log in logs:
        log.close()
        print(Path(log.name).read_text()[-2000:], flush=True)
    return codes


def step_study(work: Path, setting: Setting) -> dict[str, Any]:
    import optuna

    made = models(work, setting)
    study = study_file(work / "gpu-study.yaml", data_dir(work, setting), list(made.values()),
                       setting)
    storage = f"sqlite:///{work / 'gpu-study.db'}"
    trace = work / "gpu-memory.csv"
    used_before = device_used_mib(setting)
    with trace.open("w") as sink:
        sampler = None if setting.rehearse else subprocess.Popen(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits", "-lms", "500"], stdout=sink,
            stderr=subprocess.DEVNULL)
        try:
            codes = _workers(study, storage, setting.trials, setting)
        finally:
            if sampler is not None:
                sampler.terminate()
                sampler.wait()
    trials = optuna.load_study(study_name="gpu-study", storage=storage).trials
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    rows = [{"trial": t.number, "model": Path(t.params.get("model_name", "?")).name,
             "precision": t.params.get("fp_precision"), "state": t.state.name,
             "value": t.value, **{k: t.user_attrs.get(k) for k in (
                 "physical_batch_size", "grad_accum_steps", "fused_adamw", "grad_scale",
                 "peak_memory_mib", "samples_per_second", "flops_per_second", "mfu",
                 "trial_seconds", "worker", "device_shared_gib", "prune_reason")}}
            for t in trials]
    problems = [] if codes == [0, 0] else [f"worker exit codes {codes}"]
    if len(finished) != setting.trials or len(trials) != setting.trials:
        problems.append(f"{len(finished)} finished of {len(trials)} trials, budget "
                        f"{setting.trials}")
    for row in rows:
        if row["state"] != "COMPLETE":
            continue
        if row["precision"] == "fp16" and not row["grad_scale"]:
            problems.append(f"trial {row['trial']}: fp16 without a GradScaler scale")
        if not setting.rehearse and (not row["fused_adamw"] or not row["peak_memory_mib"]):
            problems.append(f"trial {row['trial']}: fused AdamW or peak memory missing")
        if not setting.rehearse and not row["mfu"]:  # the lent H100s and H200s are known
            problems.append(f"trial {row['trial']}: no MFU recorded")
    searched = {r["precision"] for r in rows}
    if not set(setting.precisions) <= searched:
        problems.append(f"precisions searched {sorted(searched)}, not {setting.precisions}")
    shared = shared_gpu(optuna.load_study(study_name="gpu-study", storage=storage), rows,
                        [study.parent / f"worker{k}.log" for k in range(2)], setting)
    problems += shared.pop("problems")
    final = _final_and_pipeline(work, study, storage)
    return {"trials": rows, "shared_gpu": {"device_used_mib_before": used_before, **shared},
            "final": final, "gpu_memory_mib": _memory_trace(trace),
            "problems": problems + final.pop("problems")}


# planning.shared_device_warning's words: a worker found memory held outside it.
SHARED_WARNING = "is held outside this worker"


def shared_gpu(study: Any, rows: list[dict[str, Any]], logs: list[Path],
               setting: Setting) -> dict[str, Any]:
    """Step (e)'s two workers share the GPU undeclared (no `--workers gpus:2`): whether they
    warned of it, which trials were planned beside the other's memory (`device_shared_gib`),
    the study's cached batch limits and any put there under contention, and `oom` prunes."""
    from hpo.hardware import detect
    from hpo.trial.batch_limit import StudyBatchCache

    warnings = sum(log.read_text(errors="replace").count(SHARED_WARNING)
                   for log in logs if log.exists())
    cached = {key[len(StudyBatchCache.PREFIX):]: value
              for key, value in study.user_attrs.items()
              if key.startswith(StudyBatchCache.PREFIX)}
    total_mib = detect(setting.device).total_memory / 2**20
    contended, unjudged = contended_limits(cached, rows, total_mib)
    figures = {
        "warnings": warnings,
        "shared_trials": {r["trial"]: r["device_shared_gib"] for r in rows
                          if r.get("device_shared_gib")},
        "cached_limits": cached,
        "cached_under_contention": contended,
        "unjudged_limits": unjudged,
        "oom_prunes": [r["trial"] for r in rows if r.get("prune_reason") == "oom"],
    }
    problems = []
    if not setting.rehearse and not warnings and not figures["shared_trials"]:
        problems.append("no worker warned of the GPU's other worker (no trial recorded "
                        "device_shared_gib)")
    problems += [f"batch limit cached under contention: {key}: {why}"
                 for key, why in contended.items()]
    if figures["oom_prunes"]:
        problems.append(f"trials pruned out of memory: {figures['oom_prunes']}")
    return {**figures, "problems": problems}


def contended_limits(cached: dict[str, dict[str, Any]], rows: list[dict[str, Any]],
                     total_mib: float) -> tuple[dict[str, str], list[str]]:
    """The cached limits a search beside another process's memory put there: an OOM at a
    batch that fits in 90% of the device by a completed trial of the same model and precision,
    its peak memory scaled linearly to that batch (an overestimate: weights and optimizer
    state do not grow with the batch, so a limit so judged is surely the neighbour's doing).
    Returns those keys with why, and the keys with an OOM but no such trial (not judged)."""
    contended, unjudged = {}, []
    for key, limit in cached.items():
        fail = limit.get("smallest_fail")
        if fail is None:
            continue
        model, precision = key.split("|")[:2]
        needs = [r["peak_memory_mib"] * fail / r["physical_batch_size"] for r in rows
                 if r["state"] == "COMPLETE" and r["model"] == Path(model).name
                 and r["precision"] == precision and r.get("peak_memory_mib")
                 and r.get("physical_batch_size")]
        if not needs:
            unjudged.append(key)
        elif max(needs) < 0.9 * total_mib:
            contended[key] = (f"out of memory at {fail}, where about {max(needs):,.0f} MiB "
                              f"of the device's {total_mib:,.0f} would do")
    return contended, unjudged


def device_used_mib(setting: Setting) -> float | None:
    """The GPU's memory in use by every process (this one's context and cache included), before
    the workers start: what they would see as another process's; None on a CPU, and where
    this process has no CUDA context (asking would make one)."""
    if setting.rehearse or "torch" not in sys.modules:
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 2**20, 1)


def _memory_trace(trace: Path) -> dict[str, float]:
    """Each compute process's peak GPU memory (the driver's count: its allocator's reserve
    and its context) over the sampled study, by pid: the two workers and this one."""
    peaks: dict[str, float] = {}
    if trace.exists():
        for line in trace.read_text().splitlines():
            pid, _, used = line.partition(",")
            if used.strip().isdigit():
                peaks[pid.strip()] = max(peaks.get(pid.strip(), 0.0), float(used))
    return peaks


PIPELINE = """
import json, sys
from transformers import pipeline
model, texts = sys.argv[1], json.load(open(sys.argv[2]))
classify = pipeline("text-classification", model=model, top_k=None, truncation=True,
                    device=0 if sys.argv[3] == "cuda" else -1)
thresholds = classify.model.config.decision_thresholds
print(json.dumps([[s["label"] for s in scores if s["score"] > thresholds[s["label"]]]
                  for scores in classify(texts, batch_size=32)]))
"""


def _final_and_pipeline(work: Path, study: Path, storage: str) -> dict[str, Any]:
    """`hpo final` on the study's best trial, and its export scored by a plain pipeline on
    the test posts: the same macro-F1 as its report, within rounding."""
    output = work / "final"
    hpo("final", "--config", str(study), "--storage", storage, "--seeds", "1",
        "--output", str(output))
    report = json.loads((output / "report.json").read_text())
    ids = report["data"]["test_post_ids"]
    import torch

    from hpo.data.redsm5 import SYMPTOMS, read_redsm5
    from hpo.training.metrics import f1_scores

    posts = {p.post_id: p for p in read_redsm5(report["data"]["dir"])}
    (work / "texts.json").write_text(json.dumps([posts[i].text for i in ids]))
    device = "cuda" if "cuda" in report["device"] else "cpu"
    out = subprocess.run([sys.executable, "-c", PIPELINE, str(output), str(work / "texts.json"),
                          device], capture_output=True, text=True, check=True).stdout
    predicted = json.loads(out.strip().splitlines()[-1])
    grid = [[name in labels for name in SYMPTOMS] for labels in predicted]
    gold = [[name in posts[i].symptoms for name in SYMPTOMS] for i in ids]
    pipeline_f1 = f1_scores(torch.tensor(grid), torch.tensor(gold), SYMPTOMS).macro_f1
    reported = report["exported"]["test"]["macro_f1"]
    # On a GPU hpo scored with TF32 matmuls and the pipeline in full fp32: a post whose
    # probability sits at a threshold may fall either side.
    tolerance = 2e-3 if device == "cpu" else 0.02
    problems = [] if abs(pipeline_f1 - reported) <= tolerance else [
        f"the pipeline's test macro-F1 {pipeline_f1:.4f} is not the report's {reported:.4f}"]
    return {"trial": report["trial"], "test_macro_f1": reported,
            "pipeline_macro_f1": round(pipeline_f1, 4), "problems": problems}


def matmul_rate(device_name: str, size: int) -> float:
    """A large bf16 (fp32 on a CPU) matrix product's FLOP/s, on random data: MFU's peak."""
    import torch

    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    repeats, began = 10, time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - began)


def training_flops_per_token(model: Any, width: float) -> float:
    """nanoGPT's estimate (`estimate_mfu`, after PaLM's appendix B): 6 FLOPs per parameter
    per token for the forward and backward matrix products, plus attention's 12 x layers x
    hidden x sequence length; position embeddings left out, as nanoGPT does."""
    config = model.config
    parameters = sum(p.numel() for name, p in model.named_parameters()
                     if "position_embeddings" not in name)
    return 6 * parameters + 12 * config.num_hidden_layers * config.hidden_size * width


def step_loop(work: Path, setting: Setting) -> dict[str, Any]:
    """hpo's training loop against the Trainer (bf16, group_by_length, fused AdamW), through
    benchmarks/throughput.py's two runs, at the same effective batch."""
    import throughput

    from hpo.hardware import detect

    made = models(work, setting)
    device = detect(setting.device)
    args = throughput.parser_for(device).parse_args([
        "--model", str(made["bert-base-uncased"]), "--max-length", str(setting.max_length),
        "--train", str(setting.posts), "--validation", "40", "--epochs", "1",
        "--batch", "32"])
    rows = {}
    for run in (throughput.OURS, throughput.TRAINER_GROUPED):
        result = throughput.measure(args, device, run)
        rows[run] = {"samples_per_second": round(result.samples_per_second, 2),
                     "padding_efficiency": round(result.padding_efficiency, 4),
                     "macro_f1": round(result.macro_f1, 4)}
    peak = matmul_rate(setting.device, 1024 if setting.rehearse else 8192)
    bench = throughput.load_bench(args, device)
    real = sum(bench.train_data.lengths) / len(bench.train_data.lengths)
    model = bench.store.build(args.model, 9, seed=0)
    for row in rows.values():
        width = real / row["padding_efficiency"]  # tokens processed per sample, padding too
        flops = width * training_flops_per_token(model, width) * row["samples_per_second"]
        row["tflops"] = round(flops / 1e12, 3)
        row["mfu"] = round(flops / peak, 4)
    ours, theirs = rows[throughput.OURS], rows[throughput.TRAINER_GROUPED]
    ratio = ours["samples_per_second"] / theirs["samples_per_second"]
    return {"rows": rows, "hpo_over_trainer": round(ratio, 3),
            "matmul_tflops": round(peak / 1e12, 2), "precision": args.precision,
            "problems": []}


def step_steady(work: Path, setting: Setting) -> dict[str, Any]:
    """(h): step (f) at steady state. The same two runs of benchmarks/throughput.py (hpo's
    loop; the Trainer with bf16, group_by_length, fused AdamW) on bert-base at 512 tokens,
    each `steady_posts` / `steady_batch` x `steady_epochs` optimizer steps (2,000 on the GPU),
    timed whole and from the end of step `warmup_steps` on (the steady figures). FLOPs by
    hpo's rule (hpo.training.flops: real tokens only, as a trial's `mfu`), against the bf16 8192^3
    matrix product measured here (MFU) and the datasheet's peak where hpo knows it."""
    from unittest import mock

    import throughput
    import torch
    import transformers

    from hpo.hardware import detect, peak_flops
    from hpo.training import train as hpo_train
    from hpo.training.flops import model_flops

    made = models(work, setting)
    device = detect(setting.device)
    batch, warm = setting.steady_batch, setting.warmup_steps
    # Whole batches only, so that the Trainer's steps (it keeps a short last batch) and
    # hpo's (it drops it) are the same in number and in samples.
    assert setting.steady_posts % batch == 0, "steady_posts must be a multiple of the batch"
    expected = setting.steady_posts // batch * setting.steady_epochs
    args = throughput.parser_for(device).parse_args([
        "--model", str(made["bert-base-uncased"]), "--max-length", str(setting.max_length),
        "--train", str(setting.steady_posts), "--validation", "40",
        "--epochs", str(setting.steady_epochs), "--batch", str(batch)])
    seen: dict[str, Any] = {}

    def timed_train(model: Any, train_data: Any, plan: Any, on: Any, *, pad_id: int,
                    hooks: Any) -> Any:
        """hpo.training.train.train, its counters read at the end of step `warm` (on_step)."""
        lengths = torch.tensor(train_data.lengths)
        seen["flops_per_sample"] = model_flops(model).sequences(lengths) / len(lengths)
        steps = [0]

        def on_step(progress: Any) -> None:
            steps[0] += 1
            if steps[0] == warm:
                seen["ours_mark"] = (progress.step_seconds, progress.samples,
                                     progress.model_flops)

        progress = hpo_train.train(model, train_data, plan, on, pad_id=pad_id,
                                   hooks=dataclasses.replace(hooks, on_step=on_step))
        seen["ours"] = (progress.step_seconds, progress.samples, progress.model_flops, steps[0])
        return progress

    class Timer(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            if state.global_step == warm:
                seen["trainer_mark"] = now
            seen["trainer"] = (now, state.global_step)

    class TimedTrainer(transformers.Trainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.add_callback(Timer())

    results = {}
    with mock.patch.object(throughput, "train", timed_train), \
            mock.patch.object(throughput, "Trainer", TimedTrainer):
        for run in (throughput.OURS, throughput.TRAINER_GROUPED):
            results[run] = throughput.measure(args, device, run)
    peak = matmul_rate(setting.device, 1024 if setting.rehearse else 8192)
    datasheet = peak_flops(device, args.precision)
    per_sample = seen["flops_per_sample"]
    ours_seconds, ours_samples, ours_flops, ours_steps = seen["ours"]
    mark_seconds, mark_samples, mark_flops = seen["ours_mark"]
    last, trainer_steps = seen["trainer"]
    steady = {
        throughput.OURS: (ours_steps, (ours_samples - mark_samples)
                          / (ours_seconds - mark_seconds),
                          (ours_flops - mark_flops) / (ours_seconds - mark_seconds)),
        throughput.TRAINER_GROUPED: (trainer_steps, (trainer_steps - warm) * batch
                                     / (last - seen["trainer_mark"]), None),
    }
    rows = {}
    for run, result in results.items():
        steps, rate, flops = steady[run]
        flops = flops if flops is not None else rate * per_sample
        rows[run] = {
            "steps": steps, "seconds": round(result.seconds, 1),
            "samples_per_second": round(result.samples_per_second, 2),
            "padding_efficiency": round(result.padding_efficiency, 4),
            "macro_f1": round(result.macro_f1, 4),
            "mfu_whole_run": round(result.samples_per_second * per_sample / peak, 4),
            # From the end of step `warm` to the last: the steady state.
            "steady_samples_per_second": round(rate, 2),
            "steady_tflops": round(flops / 1e12, 3),
            "mfu": round(flops / peak, 4),
            "mfu_datasheet": None if datasheet is None else round(flops / datasheet, 4),
            # The device's work, padding included (approximately: attention's share does not
            # scale with the padding as the matrices' does).
            "mfu_with_padding": round(flops / peak / result.padding_efficiency, 4),
        }
    ours, theirs = rows[throughput.OURS], rows[throughput.TRAINER_GROUPED]
    ratio = ours["steady_samples_per_second"] / theirs["steady_samples_per_second"]
    judged = not setting.rehearse
    goals = {
        "hpo_over_trainer_at_least_1": {"value": round(ratio, 3),
                                        "met": ratio >= 1.0 if judged else None},
        "hpo_mfu_at_least_0.40": {"value": ours["mfu"],
                                  "met": ours["mfu"] >= 0.40 if judged else None},
    }
    problems = [f"{run}: {row['steps']} optimizer steps, not {expected}"
                for run, row in rows.items() if row["steps"] != expected]
    problems += [f"goal {name} not met: {goal['value']}" for name, goal in goals.items()
                 if goal["met"] is False]
    return {"rows": rows, "hpo_over_trainer": round(ratio, 3),
            "hpo_over_trainer_whole_run": round(
                ours["samples_per_second"] / theirs["samples_per_second"], 3),
            "goals": goals, "batch": batch, "posts": setting.steady_posts,
            "epochs": setting.steady_epochs, "warmup_steps": warm,
            "gflops_per_sample": round(per_sample / 1e9, 2),
            "matmul_tflops": round(peak / 1e12, 2),
            "datasheet_tflops": None if datasheet is None else round(datasheet / 1e12, 1),
            "precision": args.precision, "problems": problems}


WORKERS_STUDY = "workers"


def step_workers(work: Path, setting: Setting, earlier: dict[str, Any]) -> dict[str, Any]:
    """(i): a ReDSM5-sized study (`workers_posts` posts in the shipped sample's format, each
    filling max_length; `workers_epochs` epochs) of `workers_trials` bert-base trials at one
    effective batch, run by one `hpo run`, then by `hpo run --workers gpus:K` on the same
    GPU, each from an empty storage: trials per hour, and each trial's MFU (train_flops /
    trial_seconds) against the step's, step (h)'s steady hpo loop where it ran (else the
    trial's own training steps). In the rehearsal one GPU is mocked (HPO_FAULT_GPUS=1) and
    the workers train on the CPU."""
    import optuna

    made = models(work, setting)
    data = work / "data-workers"
    if not (data / "redsm5_annotations.csv").exists():
        long_posts(data, setting.workers_posts, words=setting.max_length, seed=1)
    study = study_file(work / f"{WORKERS_STUDY}.yaml", data, [made["bert-base-uncased"]],
                       setting, search_space__fp_precision=[setting.precisions[0]],
                       search_space__target_effective_batch_size=[setting.workers_batch],
                       search_space__learning_rate={"low": 5.0e-6, "high": 1.0e-4,
                                                    "log": True},
                       training__epochs=setting.workers_epochs)
    steady = earlier.get("steady", {})
    ours = steady.get("rows", {}).get("hpo training loop", {})
    step_rate = ours["steady_tflops"] * 1e12 if ours.get("steady_tflops") else None
    peak = (steady["matmul_tflops"] * 1e12 if steady.get("matmul_tflops")
            else matmul_rate(setting.device, 1024 if setting.rehearse else 8192))
    k = setting.workers_per_gpu
    runs, problems = {}, []
    for label, extra in (("one worker", []), (f"gpus:{k}", ["--workers", f"gpus:{k}"])):
        db = work / f"{WORKERS_STUDY}-{len(runs)}.db"
        db.unlink(missing_ok=True)
        storage = f"sqlite:///{db}"
        used = device_used_mib(setting)
        began = time.perf_counter()
        done = hpo("run", "--config", str(study), "--storage", storage, "--n-trials",
                   str(setting.workers_trials), "--skip-check", *extra, check=False,
                   env={"HPO_FAULT_GPUS": "1"} if setting.rehearse and extra else None)
        wall = time.perf_counter() - began
        trials = optuna.load_study(study_name=WORKERS_STUDY, storage=storage).trials
        run = workers_run(trials, wall, peak, step_rate)
        runs[label] = {"exit_code": done.returncode, "device_used_mib_before": used, **run}
        if done.returncode != 0:
            problems.append(f"{label}: hpo run exited {done.returncode}")
        states = [row["state"] for row in run["trials"]]
        if states != ["COMPLETE"] * setting.workers_trials:
            problems.append(f"{label}: trials ended {states}, not {setting.workers_trials} "
                            f"COMPLETE")
        if extra and {row["gpu_share"] for row in run["trials"]} != {f"1/{k}"}:
            problems.append(f"{label}: trials' gpu_share "
                            f"{sorted({str(r['gpu_share']) for r in run['trials']})}, not 1/{k}")
        if not setting.rehearse and any(row["mfu"] is None for row in run["trials"]):
            problems.append(f"{label}: a trial recorded no MFU")
    one, many = runs["one worker"], runs[f"gpus:{k}"]
    over_step = one["median_trial_over_step"]
    speedup = (many["trials_per_hour"] / one["trials_per_hour"]
               if many["trials_per_hour"] and one["trials_per_hour"] else None)
    judged = not setting.rehearse
    goals = {
        "trial_mfu_at_least_0.7_of_step": {
            "value": over_step, "step": "step (h), hpo's loop at steady state" if step_rate
            else "the trial's own training steps",
            "met": (over_step is not None and over_step >= 0.7) if judged else None},
        f"gpus:{k}_at_least_2x_trials_per_hour": {
            "value": None if speedup is None else round(speedup, 3),
            "met": (speedup is not None and speedup >= 2.0) if judged else None},
    }
    problems += [f"goal {name} not met: {goal['value']}" for name, goal in goals.items()
                 if goal["met"] is False]
    return {"runs": runs, "goals": goals, "workers_per_gpu": k,
            "posts": setting.workers_posts, "epochs": setting.workers_epochs,
            "effective_batch": setting.workers_batch, "peak_tflops": round(peak / 1e12, 3),
            "step_tflops": None if step_rate is None else round(step_rate / 1e12, 3),
            "problems": problems}


def workers_run(trials: list[Any], wall: float, peak: float,
                step_rate: float | None) -> dict[str, Any]:
    """One run of step (i): its trials and their throughput. Trials per hour over the span
    from the first trial's start to the last one's end (a long study's rate: the workers'
    start-up left out) and over the command's wall time; a trial's MFU is train_flops /
    trial_seconds / peak, against the step's: `step_rate` where given, else the trial's own
    training steps (`flops_per_second`, train_flops / the steps' seconds)."""
    import statistics

    rows = []
    for t in trials:
        attrs = t.user_attrs
        row = {"trial": t.number, "state": t.state.name, **{key: attrs.get(key) for key in (
            "worker", "gpu_share", "physical_batch_size", "trial_seconds", "train_seconds",
            "train_flops", "flops_per_second", "mfu", "peak_memory_mib", "device_shared_gib",
            "prune_reason")}}
        rate = (row["train_flops"] / row["trial_seconds"]
                if row["train_flops"] and row["trial_seconds"] else None)
        row["trial_mfu"] = None if rate is None else round(rate / peak, 4)
        reference = step_rate or row["flops_per_second"]
        row["trial_over_step"] = (round(rate / reference, 3)
                                  if rate is not None and reference else None)
        # The share of the trial its training steps took, the same at any step speed.
        row["trial_over_own_steps"] = (round(rate / row["flops_per_second"], 3)
                                       if rate is not None and row["flops_per_second"]
                                       else None)
        rows.append(row)
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    span = ((max(t.datetime_complete for t in finished)
             - min(t.datetime_start for t in finished)).total_seconds() if finished else 0.0)
    flops = sum(r["train_flops"] or 0.0 for r in rows)
    ratios = [r["trial_over_step"] for r in rows if r["trial_over_step"] is not None]
    own = [r["trial_over_own_steps"] for r in rows if r["trial_over_own_steps"] is not None]
    seconds = [r["trial_seconds"] for r in rows if r["trial_seconds"]]
    return {
        "finished": len(finished), "wall_seconds": round(wall, 1),
        "span_seconds": round(span, 1),
        "trials_per_hour": round(3600 * len(finished) / span, 1) if span else None,
        "trials_per_hour_wall": round(3600 * len(finished) / wall, 1),
        "median_trial_seconds": round(statistics.median(seconds), 2) if seconds else None,
        "median_trial_mfu": (round(statistics.median(
            r["trial_mfu"] for r in rows if r["trial_mfu"] is not None), 4)
            if any(r["trial_mfu"] is not None for r in rows) else None),
        "median_trial_over_step": round(statistics.median(ratios), 3) if ratios else None,
        "median_trial_over_own_steps": round(statistics.median(own), 3) if own else None,
        # The GPU's use over the span, all workers together.
        "span_mfu": round(flops / span / peak, 4) if span else None,
        "workers": sorted({str(r["worker"]) for r in rows}),
        "trials": rows,
    }


# The run's order on the GPU: what the next run must show first ((h), (i), and the three
# items not yet run there: (a)'s base-size BERT, (d)'s three trials, (e)'s shared GPU), then
# the steps an H200 has passed (b, c, f, g), which a cut-off may drop.
STEPS = ("hardware", "oom", "steady", "workers", "study", "loop", "check", "batch_search",
         "auto")
# Each step's seconds on an H200, for the budget (`--seconds`): run 1 (2026-11-27) where it
# ran, the arithmetic otherwise. Together (a), (d), (h), (i) and (e) come to about 450 s.
ESTIMATES = {
    # Run 1: 26 s with the small BERT, mostly the process's first CUDA use; the base-size
    # BERT's 3 x 4 steps at 8 x 512 add a few seconds (three models built on the host).
    "hardware": 30,
    # Run 2: 19 s for two trials; a third, tiny, trial adds a few seconds.
    "oom": 25,
    # 2 x 2,000 steps at 32 x ~290 processed tokens (throughput.py's posts: 261 real tokens
    # a post at 512, padding efficiency ~0.9): ~4.6 TFLOP a step by hpo's rule, ~0.022 s at
    # ~210 TFLOP/s = 44 s a side (88 s; 0.039 s a step, the check's 32 x 512, would be 156 s),
    # plus ~8 s a side to tokenize 4,000 posts, build and warm up, and 2 s of matmul.
    "steady": 120,
    # One worker: ~12 s to start (run 2's two-trial `hpo run`: 19 s), 8 trials of 1,050
    # training posts x 5 epochs at 32 = 160 steps x ~0.04 s = 6.4 s, plus ~4 s each to
    # build the model, fork its loader and evaluate 5 times: ~10.5 s, so ~100 s. Four
    # workers: ~25 s to start the launcher, its study and the workers, then 8 x 6.4 s of
    # steps interleaved on the one GPU (~55-60 s), ~80 s. About 180 s together.
    "workers": 180,
    "study": 90,  # run 1: 79 s, run 2: 86 s
    "loop": 55,  # run 2: 52 s
    "check": 40,  # run 1: 37 s
    "batch_search": 50,  # run 1: 48 s
    "auto": 65,  # run 3: 65 s
}
# What a step needs beyond its estimate before the budget's end: gpu.json written, slack.
MARGIN_SECONDS = 5


def skip_reason(name: str, left: float | None) -> str | None:
    """Why step `name` is not started with `left` seconds of the budget (None: no budget)."""
    if left is None or ESTIMATES[name] + MARGIN_SECONDS <= left:
        return None
    return (f"about {ESTIMATES[name]} s on an H200, {max(left, 0):.0f} s of the budget left; "
            f"run it alone: --steps {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--steps", nargs="+", default=None, choices=STEPS,
                        help="a subset, by name, in the order to run them")
    parser.add_argument("--seconds", type=float, default=None,
                        help="the run's budget (run.sh: HPO_GPU_SECONDS): on the GPU, a step "
                             "whose ESTIMATES no longer fits in what is left is skipped")
    args = parser.parse_args()
    began = time.perf_counter()
    setting = REHEARSAL if args.rehearse else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HPO_CACHE_DIR", str(work / "cache"))
    report = Report(args.out, setting)
    steps = {
        "hardware": lambda: step_hardware(setting),
        "oom": lambda: step_oom(work, setting),
        "steady": lambda: step_steady(work, setting),
        "workers": lambda: step_workers(work, setting, report.data["steps"]),
        "study": lambda: step_study(work, setting),
        "loop": lambda: step_loop(work, setting),
        "check": lambda: step_check(work, setting),
        "batch_search": lambda: step_batch_search(work, setting),
        "auto": lambda: step_auto(work, setting),
    }
    assert list(steps) == list(STEPS) and set(ESTIMATES) == set(STEPS)
    # In the order named: a rerun puts first what matters. The estimates are an H200's: the
    # rehearsal runs every step.
    for name in dict.fromkeys(args.steps or STEPS):
        left = (None if args.seconds is None or setting.rehearse
                else args.seconds - (time.perf_counter() - began))
        why = skip_reason(name, left)
        if why is None:
            report.step(name, steps[name])
        else:
            report.skip(name, why)
    statuses = {name: s["status"] for name, s in report.data["steps"].items()}
    print(json.dumps(statuses), flush=True)
    sys.exit(0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1)


if __name__ == "__main__":
    main()
