"""The GPU check (issue 42): hpo's CUDA paths run for real, each step's figures written to
OUT/gpu.json as soon as the step ends, with its status, so a step that fails or a run cut off
keeps what the earlier steps wrote.

    python benchmarks/gpu/check.py --out OUT              # on the GPU (run.sh calls it)
    python benchmarks/gpu/check.py --out OUT --rehearse   # here, every step on the CPU

The steps: (a) `hpo hardware`; (b) full-size replicas of the redsm5 study's four models and
`hpo check` over them at 512 tokens; (c) the batch search per model x precision against a
direct bisection of the true limit, and training at the batch it chose; (d) a real CUDA
out-of-memory error (the process's memory capped) turned into a pruned trial, the worker going
on and its memory given back; (e) a study of one-epoch trials by two workers on the one GPU,
bf16 and fp16, then `hpo final` and a plain pipeline; (f) hpo's loop against the Trainer's
strongest set-up on bert-base at 512 tokens, with model-FLOPs utilisation against the bf16
matrix-product rate measured in the same run. The rehearsal runs each on this CPU with tiny
replicas of the same families and formats, the GPU's out-of-memory errors injected
(HPO_FAULT_OOM_ABOVE_BATCH), in a few minutes.
"""

from __future__ import annotations

import argparse
import csv
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


GPU = Setting("cuda", 512, 256, 400, 12, ("bf16", "fp16"), rehearse=False)
REHEARSAL = Setting("cpu", 64, 16, 120, 4, ("none",), rehearse=True)
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
            from hpo.memory import release_memory

            release_memory()
        self.data["steps"][name] = result
        self._write()
        print(f"== step {name}: {status} in {result['seconds']} s"
              + "".join(f"\n   problem: {p}" for p in problems), flush=True)
        return result

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

    from hpo import hardware_check
    from hpo.hardware import configure_backends, detect

    device = detect(setting.device)
    configure_backends(device)
    # The rehearsal times one step: an emulated precision's takes seconds on some CPUs.
    report = hardware_check.inspect(device, steps=1 if setting.rehearse else 3)
    print(hardware_check.render(report), flush=True)
    tf32 = {"matmul_precision": torch.get_float32_matmul_precision(),
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32}
    figures = {
        "device": device.describe(), "name": device.name,
        "compute_capability": device.compute_capability,
        "memory_gib": round(device.total_memory / 2**30, 1), "support": report.support,
        "ms_per_step": {m.precision: round(1000 * m.step_seconds, 2)
                        for m in report.measurements},
        "tf32": tf32,
    }
    problems = [] if report.measurements else ["no step was timed"]
    if not setting.rehearse:
        problems += [f"{p} is not native" for p in ("bf16", "fp16")
                     if report.support[p] != "native"]
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

    from hpo import check
    from hpo.hardware import detect

    stored = optuna.load_study(study_name="check", storage=storage)
    verdicts = check.stored(stored, detect(setting.device)) or []
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

    from hpo.study import PIN_ATTR

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
    from hpo.memory import fits

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

    from hpo import memory
    from hpo.hardware import detect
    from hpo.models import ModelStore
    from hpo.train import Plan, prepare, probe_step

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
        probe_step(holder["model"], plan, device, batch, setting.max_length,
                   holder["model"].config.vocab_size)

    found = memory.search(step, setting.max_batch, memory.BatchLimit(),
                          memory.device_memory_probe(device))
    physical = memory.physical_batch(found.limit, setting.max_batch, 0.9)
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
    return {"trials": rows, "problems": problems}


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
                 "trial_seconds", "worker")}}
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
    final = _final_and_pipeline(work, study, storage)
    return {"trials": rows, "final": final, "gpu_memory_mib": _memory_trace(trace),
            "problems": problems + final.pop("problems")}


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
    from hpo.metrics import f1_scores

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


STEPS = ("hardware", "check", "batch_search", "oom", "study", "loop", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rehearse", action="store_true")
    parser.add_argument("--steps", nargs="+", default=None, choices=STEPS,
                        help="a subset, by name, in the order to run them")
    args = parser.parse_args()
    setting = REHEARSAL if args.rehearse else GPU
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"
    work.mkdir(exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HPO_CACHE_DIR", str(work / "cache"))
    report = Report(args.out, setting)
    steps = {
        "hardware": lambda: step_hardware(setting),
        "check": lambda: step_check(work, setting),
        "batch_search": lambda: step_batch_search(work, setting),
        "oom": lambda: step_oom(work, setting),
        "study": lambda: step_study(work, setting),
        "loop": lambda: step_loop(work, setting),
        "auto": lambda: step_auto(work, setting),
    }
    assert list(steps) == list(STEPS)
    # In the order named: a rerun puts first what matters.
    for name in dict.fromkeys(args.steps or STEPS):
        report.step(name, steps[name])
    statuses = {name: s["status"] for name, s in report.data["steps"].items()}
    print(json.dumps(statuses), flush=True)
    sys.exit(0 if all(s == "ok" for s in statuses.values()) else 1)


if __name__ == "__main__":
    main()
