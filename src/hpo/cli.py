"""The `hpo` command: parse arguments, call plain functions, map known errors to exit codes.

Exit codes: 0 done; 2 bad input (usage, study file, data, models, storage at start), one line
on stderr naming the culprit; 1 anything unexpected (`--debug` shows its traceback).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from hpo import config as config_module
from hpo import faults
from hpo.config import ConfigError, StudyConfig
from hpo.data.errors import DataError
from hpo.faults import FaultConfigError
from hpo.models import ModelError
from hpo.space import SpaceError
from hpo.study import StorageError

BAD_INPUT = (ConfigError, DataError, FaultConfigError, ModelError, SpaceError, StorageError)
EXIT_OK, EXIT_UNEXPECTED, EXIT_BAD_INPUT = 0, 1, 2
BASELINE = "every symptom predicted for every post"


class UsageError(ValueError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        # argparse prints the whole usage block; one line naming the problem is enough.
        raise UsageError(f"{self.prog}: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpo", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="join (or create) a study and run trials")
    _study_options(run)
    run.add_argument("--n-trials", type=_positive_int, default=None,
                     help="study-wide total of finished (COMPLETE + PRUNED) trials")
    run.add_argument("--timeout", type=_positive_float, default=None,
                     help="start no new trial after this many seconds")
    run.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return parser


def _study_options(command: argparse.ArgumentParser) -> None:
    where = command.add_mutually_exclusive_group(required=True)
    where.add_argument("--study", help="read configs/studies/NAME.yaml")
    where.add_argument("--config", type=Path, help="read this study file")
    command.add_argument("--storage", help="storage URL (else HPO_STORAGE, the file, hpo.db)")
    command.add_argument("--set", dest="overrides", action="append", default=[],
                         metavar="KEY=VALUE", help="override a study-file key: training.epochs=2")


def load_config(args: argparse.Namespace) -> StudyConfig:
    path = args.config or config_module.study_path(args.study)
    if args.study and not path.is_file():
        raise ConfigError(f"unknown study '{args.study}': {path} not found")
    return config_module.load(path, args.overrides, name=args.study)


def command_run(args: argparse.Namespace) -> int:
    # Imported here so `hpo --help` and bad arguments answer without loading torch.
    import optuna

    from hpo import hardware, models, space, study
    from hpo.data.redsm5 import label_names, read_redsm5
    from hpo.data.splits import split_posts
    from hpo.data.tasks import build_examples
    from hpo.executor import Worker
    from hpo.report import ConsoleReporter

    config = load_config(args)
    faults.check_environment()
    if args.n_trials is None:
        raise UsageError("hpo run: --n-trials is required")
    data = config.data
    posts = read_redsm5(data.dir, special_case=data.special_case)
    splits = split_posts(posts, validation=data.validation_fraction, test=data.test_fraction,
                         seed=data.split_seed)
    models.quiet_transformers()
    models.check_loadable(config.search_space.model_name, data.max_length)
    device = hardware.detect(config.training.device)
    space.declare(config.search_space, device)  # refuses emulated precisions before any I/O
    hardware.configure_backends(device)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = study.storage_url(args.storage, config)
    storage = study.open_storage(url)
    optuna_study, pinned = study.join(config, storage, device)

    reporter = ConsoleReporter()
    names = label_names(data.special_case)
    worker = Worker(
        config=config,
        pinned=pinned,
        device=device,
        train_examples=build_examples(splits.train, data.task, special_case=data.special_case),
        validation_examples=build_examples(
            splits.validation, data.task, special_case=data.special_case
        ),
        label_names=names,
    )
    finished = study.finished_count(optuna_study)
    reporter.message(
        f"study '{config.study.name}' on {study.redact(url)}: {finished}/{args.n_trials} "
        f"finished; device {device.describe()}; fp_precision searched: "
        f"{', '.join(pinned.fp_precision)}; data {len(splits.train)} train / "
        f"{len(splits.validation)} validation posts, task {data.task}, "
        f"max_length {data.max_length}"
    )
    if finished >= args.n_trials:
        reporter.message(f"study '{config.study.name}' already has {finished} finished trials "
                         f"(asked for {args.n_trials}); nothing to do")
        reporter.best(optuna_study)
        return EXIT_OK
    baseline = worker.baseline()
    optuna_study.set_user_attr(
        "baseline", {"name": BASELINE, config.study.objective: baseline.get(config.study.objective)}
    )
    try:
        result = study.run_worker(
            optuna_study, worker, reporter, n_trials=args.n_trials, timeout=args.timeout,
            max_consecutive_failures=config.study.max_consecutive_failures,
        )
    except study.WorkerStopped as exc:
        print(f"hpo: worker stopped: {exc}", file=sys.stderr)
        return EXIT_UNEXPECTED
    reporter.message(f"this worker ran {result.ran} trials; the study has "
                     f"{result.finished_after} finished")
    reporter.best(optuna_study)
    reporter.message(
        f"trivial baseline ({BASELINE}): {config.study.objective} "
        f"{baseline.get(config.study.objective):.4f} on the validation split"
    )
    return EXIT_OK


COMMANDS = {"run": command_run}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
    except KeyboardInterrupt:
        print("hpo: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        print(f"hpo: unexpected error: {type(exc).__name__}: {exc} (run with --debug for "
              f"the traceback)", file=sys.stderr)
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    sys.exit(main())
