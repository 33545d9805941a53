"""The `hpo` command: arguments in, exit codes out. Each command is a plain function in
`commands`; this module parses, calls it and maps known errors to exit codes.

Exit codes: 0 done; 2 bad input (usage, study file, data, models, storage at start), one line
on stderr naming the culprit; 1 anything unexpected (`--debug` shows its traceback); 130 after
Ctrl-C and 143 after SIGTERM, each once the running trial was freed.
"""

from __future__ import annotations

import argparse
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from hpo import interrupts

# Both light: `hpo --help` and a mistyped study file do not wait for torch.
from hpo.app import commands, launcher
from hpo.app.preflight import StudyRef
from hpo.errors import BAD_INPUT, Terminated, WorkerStopped
from hpo.search import release

EXIT_OK, EXIT_UNEXPECTED, EXIT_BAD_INPUT = 0, 1, 2
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM


class UsageError(ValueError):
    """A command line that cannot run; the message names the command (`run: ...`)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage block; one line naming the problem is enough, with
        # the prefix every other error has.
        command = self.prog.removeprefix("hpo").strip()
        raise UsageError(f"{command}: {message}" if command else message)


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


def _workers(text: str) -> tuple[int | None, int]:
    """`--workers`: a number of workers and 1, or (None, K) for `gpus:K` (K per visible GPU;
    `gpus`: one)."""
    if text == "gpus" or text.startswith("gpus:"):
        per_gpu = text.removeprefix("gpus").removeprefix(":") or "1"
        if not per_gpu.isdigit() or int(per_gpu) < 1:
            raise argparse.ArgumentTypeError(f"expected gpus:K, K workers per GPU (1 or "
                                             f"more), got {text!r}")
        return None, int(per_gpu)
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of workers, 'gpus' or "
                                         f"'gpus:K', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of workers (1 or more), 'gpus' "
                                         f"or 'gpus:K', got {value}")
    return value, 1


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

`hpo COMMAND --help` tells more. Exit codes: 0 done; 1 unexpected error; 2 bad input (one
line naming it); 130 interrupted (Ctrl-C), 143 terminated (SIGTERM), the running trial
re-queued at once."""


# Per command: the line `hpo --help` lists, and the description `hpo COMMAND --help` opens
# with (what it does, what it writes).
ABOUT = {
    "run": ("join (or create) a study and run trials",
            "Join the study, creating it on first use, and run trials until the study has "
            "--n-trials finished trials in total or --timeout passes. Each trial's parameters, "
            "scores and attributes are written to the storage."),
    "create": ("create the study and pin its search space",
               "Create the study, pin its search space and data split, and run the check; "
               "runs no trial. Safe to repeat: an existing study is joined, not changed."),
    "check": ("one real training step per model x precision of the study",
              "Run one real training step per model x precision (x adapter) of the study on "
              "this device and print which are usable. The verdicts are kept in the study, "
              "created if needed, so that `hpo run` does not repeat the check."),
    "status": ("trial counts, best trial, running trials",
               "Print the study's trial counts by state (interrupted trials apart), its best "
               "trial, the device-seconds spent and the running trials. Writes nothing."),
    "best": ("the best trial's parameters and runtime settings",
             "Print the best trial's parameters and the runtime settings (precision, physical "
             "batch, accumulation steps) that train it again. Writes nothing."),
    "final": ("train the best trial again with N seeds, test them, export the best",
              "Train the best trial's configuration (or --trial's) again, once per seed "
              "(--seeds, default 3), score every run on the held-out test split, and export "
              "the run best on validation as a transformers model directory with its "
              "per-symptom thresholds, report.json and a model card."),
    "studies": ("the studies in a storage",
                "List the studies in a storage: name, trials, best value and start time. "
                "Writes nothing."),
    "delete": ("delete a study and all its trials",
               "Delete a study, its trials and its kept models in the artifact store, after "
               "asking (--yes does not ask)."),
    "dashboard": ("optuna-dashboard on the storage",
                  "Serve optuna-dashboard on the storage, with the kept models of the artifact "
                  "store. Read-only unless --allow-writes."),
    "hardware": ("what the device supports, measured step time per precision",
                 "Print the device's native precisions and memory and a measured training "
                 "step time per precision. Writes nothing."),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hpo", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    parser.add_argument("--version", action="version", version=f"hpo {release.version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add = {name: commands.add_parser(name, help=line, description=text)
           for name, (line, text) in ABOUT.items()}
    _search_options(add["run"], add["create"], add["check"], add["final"])
    _reading_options(add["status"], add["best"], add["studies"], add["delete"])
    _dashboard_options(add["dashboard"])
    hardware = add["hardware"]
    hardware.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    hardware.add_argument("--steps", type=_positive_int, default=3,
                          help="timed training steps per precision")
    for command in add.values():
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an error")
    return parser


def _search_options(run: argparse.ArgumentParser, create: argparse.ArgumentParser,
                    check: argparse.ArgumentParser, final: argparse.ArgumentParser) -> None:
    """The options of the commands that read the whole study file."""
    for command in (run, create, check, final):
        _study_options(command, required=True)
    run.add_argument("--n-trials", type=_positive_int, default=None,
                     help="study-wide total of finished (COMPLETE + PRUNED) trials")
    run.add_argument("--timeout", type=_positive_float, default=None,
                     help="claim no new trial after this many seconds")
    run.add_argument("--verbose", action="store_true",
                     help="also say how models and tokens were loaded and the rule that "
                          "chose the precisions")
    run.add_argument("--workers", type=_workers, default=argparse.SUPPRESS,
                     metavar="N|gpus|gpus:K",
                     help="start N workers on this host, or one per visible GPU (gpus), or "
                          "K per GPU each with 1/K of its memory (gpus:K), each pinned to "
                          "its GPU and a share of the cores")
    run.add_argument("--restarts", type=_int_at_least(0, "a number of restarts"), default=None,
                     help="with --workers: start a worker that died again, at most this "
                          "many times each (default 3)")
    for command in (run, create):
        command.add_argument("--skip-check", action="store_true",
                             help="no step per model x precision before the search")
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


def _reading_options(status: argparse.ArgumentParser, best: argparse.ArgumentParser,
                     studies: argparse.ArgumentParser, delete: argparse.ArgumentParser) -> None:
    """The options of the commands that only read (or delete) what a search wrote."""
    for command in (status, best, delete):
        _study_options(command, required=True, overrides=False)
    studies.add_argument("--storage", help="storage URL (else HPO_STORAGE, else hpo.db)")
    _format_option(status, default="text")
    _format_option(best, default="yaml")
    _format_option(studies, default="text")
    delete.add_argument("--yes", action="store_true", help="delete without asking")


def _dashboard_options(dashboard: argparse.ArgumentParser) -> None:
    dashboard.add_argument("--storage", help="storage URL (else HPO_STORAGE, else hpo.db)")
    dashboard.add_argument("--host", default="127.0.0.1",
                           help="interface to bind (the dashboard has no authentication)")
    dashboard.add_argument("--port", type=_port, default=8080,
                           help="port to listen on (default 8080)")
    dashboard.add_argument("--artifacts", default=None,
                           help="the artifact store of kept models (else HPO_ARTIFACTS, else "
                                "the directory beside a SQLite storage file)")
    dashboard.add_argument("--allow-writes", action="store_true",
                           help="let the dashboard tell trials, edit attributes and delete "
                                "studies (read-only without it)")


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
    # `best` has no text rendering of its own: text prints its YAML.
    about = ("yaml (the default) or json; text is the yaml" if default == "yaml" else
             f"{default} (the default) to read; yaml or json for scripts")
    command.add_argument("--format", choices=("text", "yaml", "json"), default=default,
                         help=about)


def _ref(args: argparse.Namespace) -> StudyRef:
    return StudyRef(study=getattr(args, "study", None), config=getattr(args, "config", None),
                    storage=args.storage, overrides=tuple(getattr(args, "overrides", ())))


def command_create(args: argparse.Namespace) -> int:
    commands.create(_ref(args), skip_check=args.skip_check)
    return EXIT_OK


def command_check(args: argparse.Namespace) -> int:
    commands.check(_ref(args))
    return EXIT_OK


def command_run(args: argparse.Namespace) -> int:
    if args.n_trials is None and args.timeout is None:
        raise UsageError("run: give --n-trials, --timeout or both")
    if "workers" in args:
        try:
            count, per_gpu = args.workers
            return launcher.launch(count, _worker_command(args, "run"),
                                   _worker_command(args, "create"),
                                   restarts=3 if args.restarts is None else args.restarts,
                                   on_death=commands.dead_worker_trials(_ref(args)),
                                   per_gpu=per_gpu)
        except launcher.LaunchError as exc:
            raise UsageError(f"run: {exc}") from None
    if args.restarts is not None:
        raise UsageError("run: --restarts applies to the workers of --workers; give both")
    try:
        commands.run(_ref(args), n_trials=args.n_trials, timeout=args.timeout,
                     skip_check=args.skip_check, verbose=args.verbose)
    except WorkerStopped as exc:
        print(f"hpo: worker stopped: {exc}", file=sys.stderr)
        return EXIT_UNEXPECTED
    return EXIT_OK


def _worker_command(args: argparse.Namespace, command: str) -> list[str]:
    """The argv of one `hpo run` worker of `--workers` (or of the `hpo create` before them):
    the same study, storage, overrides and budget."""
    argv = [sys.executable, "-m", "hpo.cli", command]
    argv += ["--study", args.study] if args.study is not None else ["--config", str(args.config)]
    if args.storage is not None:
        argv += ["--storage", args.storage]
    for override in args.overrides:
        argv += ["--set", override]
    if args.skip_check:
        argv.append("--skip-check")
    if getattr(args, "debug", False):
        argv.append("--debug")
    if command == "run":
        if args.n_trials is not None:
            argv += ["--n-trials", str(args.n_trials)]
        if args.timeout is not None:
            argv += ["--timeout", repr(args.timeout)]
        if args.verbose:
            argv.append("--verbose")
    return argv


def command_status(args: argparse.Namespace) -> int:
    commands.status(_ref(args), args.format)
    return EXIT_OK


def command_best(args: argparse.Namespace) -> int:
    commands.best(_ref(args), args.format)
    return EXIT_OK


def command_final(args: argparse.Namespace) -> int:
    if args.refit and args.thresholds == "tuned":
        raise UsageError("final: --thresholds tuned needs the validation split, which "
                         "--refit trains on; use --thresholds 0.5")
    commands.final(_ref(args), trial=args.trial, seeds=args.seeds, refit=args.refit,
                   tuned=not args.refit and args.thresholds != "0.5", output=args.output)
    return EXIT_OK


def command_studies(args: argparse.Namespace) -> int:
    commands.studies(_ref(args), args.format)
    return EXIT_OK


def _confirm(question: str) -> bool:
    try:
        answer = input(question)
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def command_delete(args: argparse.Namespace) -> int:
    # A declined prompt is a choice, not an error: exit 0, having said the study was kept.
    commands.delete(_ref(args), (lambda _question: True) if args.yes else _confirm)
    return EXIT_OK


def command_dashboard(args: argparse.Namespace) -> int:
    commands.dashboard(_ref(args), host=args.host, port=args.port,
                       artifacts_at=args.artifacts, allow_writes=args.allow_writes)
    return EXIT_OK


def command_hardware(args: argparse.Namespace) -> int:
    commands.hardware(args.device, args.steps)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    launcher.follow_parent()
    if not argv:
        build_parser().print_help()
        return EXIT_OK
    # SIGTERM unwinds like Ctrl-C, so a stopped worker frees its trial at once; neither
    # cuts through a database call.
    try:
        with interrupts.raised_outside_the_database():
            return _main(argv)
    finally:
        # Only a command that opened a storage has imported the module (and optuna with it).
        opened = sys.modules.get("hpo.search.resilience")
        if opened is not None:
            opened.close_opened()


def _main(argv: list[str]) -> int:
    debug = "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"hpo: error: {exc}", file=sys.stderr)
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
