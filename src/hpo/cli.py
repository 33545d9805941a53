"""The `hpo` command: parse arguments, call plain functions, map known errors to exit codes.

Exit codes: 0 done; 2 bad input (usage, study file, data, models, storage at start), one line
on stderr naming the culprit; 1 anything unexpected (`--debug` shows its traceback); 130 after
Ctrl-C and 143 after SIGTERM, each once the running trial was freed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from hpo import config as config_module
from hpo.config import StudyConfig
from hpo.errors import BAD_INPUT, ConfigError, DataError, SpaceError, Terminated

if TYPE_CHECKING:  # the real imports load torch; `hpo --help` should not wait for it
    from hpo.data.splits import Splits
    from hpo.hardware import Device
    from hpo.storage import ResilientRDBStorage

EXIT_OK, EXIT_UNEXPECTED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        # argparse prints the whole usage block; one line naming the problem is enough.
        raise UsageError(f"{self.prog}: {message}")


def _int_at_least(low: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least `low`, called `what` in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_trial_number = _int_at_least(0, "a trial number")


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value:g}")
    return value


DESCRIPTION = """\
hpo searches the hyperparameters of a Hugging Face sequence classifier with Optuna: every
trial fine-tunes the model at the largest batch that fits, in a precision the device runs
natively. A study is one YAML file; any number of workers (`hpo run`, one GPU each) share it
through a storage: the embedded SQLite file hpo.db, or PostgreSQL for many machines."""

EPILOG = """\
examples:
  hpo run --study demo --n-trials 20     run trials of configs/studies/demo.yaml
  hpo status --study demo                what the study holds so far
  hpo best --study demo                  the best trial's settings, to train it again
  hpo dashboard                          optuna-dashboard on http://127.0.0.1:8080/dashboard

`hpo COMMAND --help` tells more. Exit codes: 0 done, 1 unexpected error, 2 bad input."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpo", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="join (or create) a study and run trials")
    _study_options(run, required=True)
    run.add_argument("--n-trials", type=_positive_int, default=None,
                     help="study-wide total of finished (COMPLETE + PRUNED) trials")
    run.add_argument("--timeout", type=_positive_float, default=None,
                     help="claim no new trial after this many seconds")

    create = commands.add_parser("create", help="create the study and pin its search space")
    _study_options(create, required=True)
    for command in (run, create):
        command.add_argument("--skip-check", action="store_true",
                             help="no step per model x precision before the search")

    check = commands.add_parser(
        "check", help="one real training step per model x precision of the study")
    _study_options(check, required=True)

    status = commands.add_parser("status", help="trial counts, best trial, running trials")
    _study_options(status, required=True, overrides=False)
    _format_option(status, default="text")

    best = commands.add_parser("best", help="the best trial's parameters and runtime settings")
    _study_options(best, required=True, overrides=False)
    _format_option(best, default="yaml")

    final = commands.add_parser(
        "final", help="train the best trial again, score it on the test split, export it")
    _study_options(final, required=True)
    final.add_argument("--trial", type=_trial_number, default=None,
                       help="this trial instead of the best (a COMPLETE one)")
    final.add_argument("--seeds", type=_positive_int, default=3,
                       help="training runs, seeds training.seed, +1, ... (default 3)")
    final.add_argument("--refit", action="store_true",
                       help="train on the training and validation splits together")
    final.add_argument("--thresholds", choices=("tuned", "0.5"), default=None,
                       help="per-symptom thresholds tuned on the validation split (the "
                            "default) or 0.5 (the default with --refit)")
    final.add_argument("--output", type=Path, default=None,
                       help="the model directory (default final/STUDY)")

    studies = commands.add_parser("studies", help="the studies in a storage")
    studies.add_argument("--storage", help="storage URL (else HPO_STORAGE, else hpo.db)")
    _format_option(studies, default="text")
    delete = commands.add_parser("delete", help="delete a study and all its trials")
    _study_options(delete, required=True, overrides=False)
    delete.add_argument("--yes", action="store_true", help="delete without asking")

    dashboard = commands.add_parser("dashboard", help="optuna-dashboard on the storage")
    dashboard.add_argument("--storage", help="storage URL (else HPO_STORAGE, else hpo.db)")
    dashboard.add_argument("--host", default="127.0.0.1",
                           help="interface to bind (the dashboard has no authentication)")
    dashboard.add_argument("--port", type=_port, default=8080)
    dashboard.add_argument("--artifacts", default=None,
                           help="the artifact store of kept models (else HPO_ARTIFACTS, else "
                                "the directory beside a SQLite storage file)")
    dashboard.add_argument("--allow-writes", action="store_true",
                           help="let the dashboard tell trials, edit attributes and delete "
                                "studies (read-only without it)")

    hardware = commands.add_parser(
        "hardware", help="what the device supports, measured step time per precision")
    hardware.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    hardware.add_argument("--steps", type=_positive_int, default=3,
                          help="timed training steps per precision")
    for command in (run, create, check, status, best, final, studies, delete, dashboard,
                    hardware):
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return parser


def _study_options(command: argparse.ArgumentParser, *, required: bool,
                   overrides: bool = True) -> None:
    where = command.add_mutually_exclusive_group(required=required)
    where.add_argument("--study", help="read configs/studies/NAME.yaml (here, else hpo's own)")
    where.add_argument("--config", type=Path, help="read this study file")
    command.add_argument("--storage", help="storage URL (else HPO_STORAGE, the file, hpo.db)")
    if overrides:
        command.add_argument("--set", dest="overrides", action="append", default=[],
                             metavar="KEY=VALUE", help="override a key: training.epochs=2")


def _format_option(command: argparse.ArgumentParser, *, default: str) -> None:
    command.add_argument("--format", choices=("text", "yaml", "json"), default=default)


def load_config(args: argparse.Namespace) -> StudyConfig:
    path = args.config or config_module.study_path(args.study)
    overrides = config_module.environment_overrides() + getattr(args, "overrides", [])
    return config_module.load(path, overrides, name=args.study)


@dataclass(frozen=True)
class Prepared:
    """A validated study: config, data splits, device, and the storage it lives in."""

    config: StudyConfig
    splits: Splits
    device: Device
    url: str
    storage: ResilientRDBStorage


def prepare(args: argparse.Namespace, *, runs_trials: bool = True) -> Prepared:
    """Everything checked before any compute: the study file, data, models, the device's
    precisions (on a host that runs trials), then the storage. What needs no torch is checked
    before torch is loaded, so those mistakes are reported at once."""
    from hpo import faults
    from hpo.data.redsm5 import read_redsm5
    from hpo.data.splits import split_posts

    config = load_config(args)
    faults.check_environment()
    data = config.data
    posts = read_redsm5(data.dir, special_case=data.special_case)
    splits = split_posts(posts, validation=data.validation_fraction, test=data.test_fraction,
                         seed=data.split_seed)
    pooled = len(splits.train) + len(splits.validation)
    if data.cv_folds and pooled < data.cv_folds:
        raise DataError(f"data.cv_folds {data.cv_folds}: only {pooled} training and "
                        f"validation posts, fewer than one per fold")

    import optuna

    from hpo import hardware, models, space, storage

    models.quiet_transformers()
    models.check_loadable(config.search_space.model_name, data.max_length)
    device = hardware.detect(config.training.device)
    if runs_trials:
        space.declare(config.search_space, device)  # refuses emulated precisions before I/O
        if config.training.base_dtype == "bfloat16" and not device.native_bf16:
            raise SpaceError(f"training.base_dtype bfloat16: {device.describe()} runs bf16 "
                             f"only by emulation; use float32")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage.storage_url(args.storage, config.study.storage)
    opened = storage.open_storage(
        url, heartbeat_interval=config.study.heartbeat_interval,
        grace_period=config.study.grace_period, max_retry=config.study.max_retry,
    )
    return Prepared(config, splits, device, url, opened)


def command_create(args: argparse.Namespace) -> int:
    prepared = prepare(args, runs_trials=False)

    from hpo import study
    from hpo.storage import redact

    # "Once, anywhere": this host may have no GPU, so `auto` is left to the first worker.
    optuna_study, pinned = study.join(prepared.config, prepared.storage, None,
                                     prepared.splits)
    print(f"study '{optuna_study.study_name}' ready on {redact(prepared.url)}; pinned "
          f"fp_precision {pinned.describe_precisions()}; "
          f"{study.finished_count(optuna_study)} finished trials")
    if not args.skip_check:
        _check(prepared, optuna_study, pinned, fresh=False)
    return EXIT_OK


def command_check(args: argparse.Namespace) -> int:
    prepared = prepare(args)

    from hpo import study

    # Like create, this may run on a host other than the fleet's: `auto` stays open.
    optuna_study, pinned = study.join(prepared.config, prepared.storage, None,
                                     prepared.splits)
    _check(prepared, optuna_study, pinned, fresh=True)
    return EXIT_OK


def _check(prepared: Prepared, optuna_study, pinned, *, fresh: bool) -> None:
    """The study's check on this host's device, for the pinned precisions it runs natively;
    `fresh` runs it even if a worker on this kind of device already has."""
    from hpo import check
    from hpo.hardware import native_precisions
    from hpo.report import ConsoleReporter
    from hpo.resources import load_resources
    from hpo.space import PinnedSpace

    device = prepared.device
    native = native_precisions(device)
    precisions = tuple(p for p in (pinned.fp_precision or native) if p in native)
    if not precisions:
        print(f"no pinned precision runs natively on {device.describe()}: nothing to check "
              f"here")
        return
    here = PinnedSpace(pinned.declared, precisions)
    resources = load_resources(prepared.config, here, device, prepared.splits)
    if fresh:
        optuna_study.set_user_attr(check.key(device), None)
    verdicts = check.ensure(optuna_study, resources, precisions, ConsoleReporter())
    usable = sum(v.usable for v in verdicts)
    print(f"{usable} of {len(verdicts)} model x precision combinations usable on "
          f"{device.describe()}; the study keeps the verdicts for this kind of device")


def command_run(args: argparse.Namespace) -> int:
    if args.n_trials is None and args.timeout is None:
        raise UsageError("hpo run: give --n-trials, --timeout or both")
    prepared = prepare(args)

    from hpo import worker

    try:
        worker.work(
            prepared.config, prepared.splits, prepared.device, prepared.url, prepared.storage,
            n_trials=args.n_trials if args.n_trials is not None else math.inf,
            timeout=args.timeout, run_check=not args.skip_check,
        )
    except worker.WorkerStopped as exc:
        print(f"hpo: worker stopped: {exc}", file=sys.stderr)
        return EXIT_UNEXPECTED
    return EXIT_OK


def _open_for_reading(args: argparse.Namespace, **options):
    """The storage of an existing study: --storage, HPO_STORAGE, the study file, hpo.db."""
    import optuna

    from hpo import storage

    from_file = None
    path = getattr(args, "config", None) or (
        config_module.find_study(args.study) if getattr(args, "study", None) else None)
    if path is not None and path.is_file():
        from_file = config_module.load(path, name=getattr(args, "study", None)).study.storage
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = storage.storage_url(args.storage, from_file)
    missing = storage.missing_sqlite_file(url)
    if missing is not None:
        raise ConfigError(f"no storage at {missing}: nothing has run there yet (`hpo run` "
                          f"creates it; --storage or HPO_STORAGE names another)")
    return storage.open_storage(url, **options), url


def _load_study(args: argparse.Namespace, opened=None, url: str | None = None):
    import optuna

    if opened is None:
        opened, url = _open_for_reading(args)
    name = args.study or config_module.load(args.config).study.name
    try:
        return optuna.load_study(study_name=name, storage=opened)
    except KeyError:
        from hpo.storage import redact

        raise ConfigError(f"no study '{name}' in {redact(url)}") from None


def _dump(data, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, indent=2, default=str)
    return yaml.safe_dump(data, sort_keys=False).rstrip()


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _columns(rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def command_status(args: argparse.Namespace) -> int:
    from hpo import summary

    info = summary.status(_load_study(args))
    if args.format != "text":
        print(_dump(info, args.format))
        return EXIT_OK
    counts = ", ".join(f"{n} {state}" for state, n in info["counts"].items())
    lines = [f"study '{info['study']}': {counts}"]
    best = info["best"]
    if best:
        lines.append(f"best: trial {best['trial']}, {best['objective']} {best['value']:.4f}")
        lines += ["  " + line for line in _columns(
            [[name, _number(value)] for name, value in best["params"].items()])]
    spent = info["compute"]
    if spent["by_model_precision"]:
        lines.append(f"compute: {spent['device_seconds']:.0f} device-seconds, "
                     f"{100 * spent['pruned_share']:.0f}% on pruned and "
                     f"{100 * spent['failed_share']:.0f}% on failed trials")
        rows = [["model", "precision", "trials", "device-s", "pruned-s", "failed-s"]]
        rows += [[r["model_name"], r["fp_precision"], str(r["trials"]),
                  f"{r['device_seconds']:.0f}", f"{r['pruned_seconds']:.0f}",
                  f"{r['failed_seconds']:.0f}"] for r in spent["by_model_precision"]]
        lines += ["  " + line for line in _columns(rows)]
    if info["running"]:
        names = sorted({name for trial in info["running"] for name in trial["params"]})
        rows = [["running", "worker", "for", *names]]
        rows += [[f"trial {t['trial']}", t["worker"], f"{t['age_seconds']} s",
                  *(_number(t["params"].get(name, "-")) for name in names)]
                 for t in info["running"]]
        lines += _columns(rows)
    print("\n".join(lines))
    return EXIT_OK


def command_best(args: argparse.Namespace) -> int:
    from hpo import summary

    info = summary.best(_load_study(args))
    if info is None:
        raise ConfigError(f"study '{args.study or args.config}' has no completed trial yet")
    print(_dump(info, "yaml" if args.format == "text" else args.format))
    return EXIT_OK


def command_final(args: argparse.Namespace) -> int:
    if args.refit and args.thresholds == "tuned":
        raise UsageError("hpo final: --thresholds tuned needs the validation split, which "
                         "--refit trains on; use --thresholds 0.5")
    # The trial's precision is what must be native here (final.check_precision), not all
    # of the study file's.
    prepared = prepare(args, runs_trials=False)

    from hpo import export, final
    from hpo.report import ConsoleReporter
    from hpo.resources import load_resources
    from hpo.space import PinnedSpace, declare
    from hpo.study import check_splits, shared_batch_cache

    config = prepared.config
    if not prepared.splits.test:
        raise ConfigError(f"data.test_fraction is {config.data.test_fraction:g}: there is no "
                          f"held-out test split to score the final model on")
    optuna_study = _load_study(args, prepared.storage, prepared.url)
    reporter = ConsoleReporter()
    if not check_splits(optuna_study, prepared.splits):
        reporter.warning(f"study '{optuna_study.study_name}' recorded no data split (its "
                         f"workers predate that): the test split is taken to be the one its "
                         f"search held out")
    output = args.output or Path("final") / optuna_study.study_name
    export.check_output(output)
    pinned = PinnedSpace(declare(config.search_space, None).declared, None)
    resources = load_resources(config, pinned, prepared.device, prepared.splits)
    options = final.Options(number=args.trial, seeds=args.seeds, refit=args.refit,
                            tuned=not args.refit and args.thresholds != "0.5")
    report, model = final.final(optuna_study, resources, prepared.splits, options, reporter,
                                shared_batch_cache(optuna_study, prepared.storage))
    export.write(output, model, report, resources.label_names)
    print(final.render(report))
    print(f"model, report.json and model card written to {output}")
    return EXIT_OK


def command_studies(args: argparse.Namespace) -> int:
    from hpo import summary

    opened, url = _open_for_reading(args)
    rows = summary.studies(opened)
    if args.format != "text":
        print(_dump(rows, args.format))
        return EXIT_OK
    if not rows:
        from hpo.storage import redact

        print(f"no studies in {redact(url)}")
    for row in rows:
        best = f"{row['best_value']:.4f}" if row["best_value"] is not None else "-"
        print(f"{row['study']}\t{row['trials']} trials\tbest {best}\tstarted {row['started']}")
    return EXIT_OK


def command_delete(args: argparse.Namespace) -> int:
    import optuna

    from hpo import artifacts
    from hpo.storage import redact

    opened, url = _open_for_reading(args)
    study = _load_study(args, opened, url)
    name = study.study_name
    what = f"study '{name}' with {len(study.get_trials(deepcopy=False))} trials in {redact(url)}"
    if not args.yes:
        try:
            answer = input(f"delete {what}? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"hpo: {what} kept")
            return EXIT_UNEXPECTED
    where = _artifact_location(args, url)
    store = artifacts.open_existing(where)
    removed = 0 if store is None else artifacts.remove_all(study, opened, store)
    optuna.delete_study(study_name=name, storage=opened)
    print(f"deleted {what}" + (f" and its {removed} kept model(s) in {where}" if removed else ""))
    return EXIT_OK


def _artifact_location(args: argparse.Namespace, url: str) -> str | None:
    """The artifact store of the study's kept models: HPO_ARTIFACTS, the study file's
    study.artifacts, else beside a SQLite storage file."""
    from hpo import artifacts

    configured = os.environ.get("HPO_ARTIFACTS")
    path = getattr(args, "config", None) or (
        config_module.find_study(args.study) if getattr(args, "study", None) else None)
    if not configured and path is not None and path.is_file():
        configured = config_module.load(path, name=getattr(args, "study", None)).study.artifacts
    return artifacts.location(configured, url)


def command_dashboard(args: argparse.Namespace) -> int:
    import optuna_dashboard

    from hpo import artifacts
    from hpo.dashboard import DashboardArtifactStore, ReadOnlyStorage
    from hpo.storage import ResilientRDBStorage, redact

    kind = ResilientRDBStorage if args.allow_writes else ReadOnlyStorage
    opened, url = _open_for_reading(args, storage_class=kind)
    may = "read and edit" if args.allow_writes else "read"
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"hpo: warning: optuna-dashboard has no authentication and binds {args.host}; "
              f"anyone who can reach port {args.port} can {may} the studies",
              file=sys.stderr)
    mode = "edits allowed" if args.allow_writes else "read-only; --allow-writes to edit"
    print(f"optuna-dashboard for {redact(url)} on http://{args.host}:{args.port}/dashboard "
          f"({mode}; Ctrl-C stops it)", flush=True)
    where = args.artifacts or _artifact_location(args, url)
    if args.artifacts and not args.artifacts.startswith("s3://") and not Path(
            args.artifacts).is_dir():
        raise ConfigError(f"--artifacts {args.artifacts}: no such directory")
    store = artifacts.open_existing(where, writable=False)
    if store is not None:
        store = DashboardArtifactStore(store, writable=args.allow_writes)
        print(f"kept models from the artifact store {where}", flush=True)
    optuna_dashboard.run_server(opened, host=args.host, port=args.port, artifact_store=store)
    return EXIT_OK


def command_hardware(args: argparse.Namespace) -> int:
    from hpo import hardware, hardware_check

    device = hardware.detect(args.device)
    print(hardware_check.render(hardware_check.inspect(device, steps=args.steps)))
    return EXIT_OK


COMMANDS = {
    "run": command_run,
    "create": command_create,
    "check": command_check,
    "status": command_status,
    "best": command_best,
    "final": command_final,
    "studies": command_studies,
    "delete": command_delete,
    "dashboard": command_dashboard,
    "hardware": command_hardware,
}


def _terminate(signum: int, frame) -> None:
    raise Terminated("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        build_parser().print_help()
        return EXIT_OK
    # SIGTERM unwinds like Ctrl-C, so a stopped worker frees its trial at once.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        return _main(argv)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str]) -> int:
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"{exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BAD_INPUT as exc:
        if debug:
            traceback.print_exc()
        print(f"hpo: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Terminated:
        print("hpo: terminated (SIGTERM)", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("hpo: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            traceback.print_exc()
        print(f"hpo: unexpected error: {type(exc).__name__}: {exc} (run with --debug for "
              f"the traceback)", file=sys.stderr)
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
