"""Best checkpoints during the search: the model of each of the study's best `keep_best`
COMPLETE trials (weights, tokenizer and resolved settings, one zip), kept in an Optuna artifact
store, so optuna-dashboard lists it on its trial and any worker or machine can fetch it.

The store is a directory (a volume shared by the fleet) or an S3-compatible bucket through
Optuna's Boto3 store (`s3://BUCKET`; the endpoint from AWS_ENDPOINT_URL, credentials as boto3
finds them). The study's user attribute `kept_models` says which trials' models are kept;
one that falls out of the top K has its file removed from the store. Optuna does not let a
finished trial's attributes change, so the dashboard still lists a removed model on its trial
(its download then fails); `kept_models` and `hpo best` tell what is there.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import uuid
import zipfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
import sqlalchemy
from optuna.artifacts.exceptions import ArtifactNotFound

from hpo.config import StudyConfig
from hpo.errors import ConfigError, one_line

if TYPE_CHECKING:
    from optuna.artifacts._protocol import ArtifactStore

KEPT = "kept_models"


def location(configured: str | None, storage_url: str) -> str | None:
    """The store's location: as configured (study.artifacts, HPO_ARTIFACTS), else a directory
    beside a SQLite storage file (`hpo.db` -> `hpo-artifacts/`), else none."""
    if configured:
        return configured
    url = sqlalchemy.engine.make_url(storage_url)
    if url.get_backend_name() != "sqlite" or not url.database or url.database == ":memory:":
        return None
    database = Path(url.database)
    return str(database.with_name(f"{database.stem}-artifacts"))


def open_store(where: str, *, writable: bool = True) -> ArtifactStore:
    """The artifact store at `where`, checked writable (a probe written and removed) unless
    only read: a store that cannot be written is bad input, found before any trial runs."""
    if where.startswith("s3://"):
        bucket = where.removeprefix("s3://").strip("/")
        if not bucket or "/" in bucket:
            raise ConfigError(f"study.artifacts {where}: expected s3://BUCKET (no prefix)")
        try:
            import boto3
        except ImportError:
            raise ConfigError(f"study.artifacts {where}: an S3 store needs boto3 "
                              f"(pip install boto3)") from None
        # avoid_buf_copy: a model of a few GB is streamed, not first copied into memory.
        store: ArtifactStore = optuna.artifacts.Boto3ArtifactStore(
            bucket, client=boto3.client("s3"), avoid_buf_copy=True)
    else:
        try:
            Path(where).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"study.artifacts {where}: cannot create the directory "
                              f"({exc.strerror or exc})") from None
        store = optuna.artifacts.FileSystemArtifactStore(where)
    if not writable:
        return store
    # Its own name: workers starting at once each write and remove theirs.
    probe = f"hpo-write-check-{uuid.uuid4()}"
    try:
        store.write(probe, io.BytesIO(b"ok"))
        store.remove(probe)
    except Exception as exc:
        raise ConfigError(f"study.artifacts {where}: the artifact store cannot be written "
                          f"({one_line(exc)})") from None
    return store


def open_existing(where: str | None, *, writable: bool = True) -> ArtifactStore | None:
    """The store at `where` if there is one: a bucket, or a directory that exists (one that
    does not has no model to list or remove)."""
    if where is None or not (where.startswith("s3://") or Path(where).is_dir()):
        return None
    return open_store(where, writable=writable)


@dataclass(frozen=True)
class Keeper:
    """Where and how many of the best trials' models to keep."""

    store: ArtifactStore
    where: str
    best: int


def keeper_for(config: StudyConfig, storage_url: str) -> Keeper | None:
    """The study's keeper: None with keep_best 0, or with no store configured for a server
    storage."""
    if config.study.keep_best == 0:
        return None
    where = location(config.study.artifacts, storage_url)
    if where is None:
        return None
    return Keeper(open_store(where), where, config.study.keep_best)


def with_pause_decided(config: StudyConfig, storage_url: str
                       ) -> tuple[StudyConfig, str | None]:
    """`study.pruner.pause: auto` decided for this storage, and the line that says how: pause
    where a rung can (successive halving, not cross-validated), the checkpoints in the
    study's store, or, where it has none, without checkpoints (`max_checkpoints` 0: a
    promoted trial trains again from its start); else stop. Any other setting as it is (and
    no line)."""
    pruner = config.study.pruner
    if pruner.pause != "auto":
        return config, None
    where = location(config.study.artifacts, storage_url)
    pauses = pruner.name == "successive_halving" and not config.data.cv_folds
    update: dict[str, Any] = {"pause": pauses}
    if pauses and where is None:
        update["max_checkpoints"] = 0
    study = config.study.model_copy(update={"pruner": pruner.model_copy(update=update)})
    decided = config.model_copy(update={"study": study})
    if pruner.name != "successive_halving":
        return decided, None  # its pruner never pauses: nothing to say
    if config.data.cv_folds:
        return decided, ("  study.pruner.pause auto: trials its rungs would stop are stopped: "
                         "a cross-validated trial cannot pause (data.cv_folds)")
    if where is None or pruner.max_checkpoints == 0:
        return decided, ("  study.pruner.pause auto: a trial its rung would stop pauses, "
                         "without a checkpoint (no study.artifacts): promoted, it trains "
                         "again from its start")
    kept = ("" if pruner.max_checkpoints is None
            else f" (at most {pruner.max_checkpoints}, study.pruner.max_checkpoints)")
    return decided, (f"  study.pruner.pause auto: a trial its rung would stop pauses, its "
                     f"checkpoint in {where}{kept}")


def checkpoint_store(config: StudyConfig, storage_url: str) -> ArtifactStore | None:
    """Where a study that pauses trials (`study.pruner.pause`) keeps their checkpoints: its
    artifact store, which every worker that may resume them must reach. None where it does
    not pause or keeps no checkpoints (`max_checkpoints: 0`); bad input where it has no
    store. `auto` is decided here as `with_pause_decided` decides it."""
    config, _ = with_pause_decided(config, storage_url)
    if not config.study.pruner.pause or config.study.pruner.max_checkpoints == 0:
        return None
    where = location(config.study.artifacts, storage_url)
    if where is None:
        raise ConfigError("study.pruner.pause keeps paused trials' checkpoints in the "
                          "artifact store: set study.artifacts (a directory every worker "
                          "shares, or s3://BUCKET), or study.pruner.max_checkpoints to 0 "
                          "(a promoted trial then trains again from its start)")
    return open_store(where)


def kept(study: optuna.Study) -> dict[int, dict[str, Any]]:
    """The trials whose models are in the store: number -> artifact id and value."""
    return {int(k): v for k, v in study.user_attrs.get(KEPT, {}).items()}


def floor(study: optuna.Study, best: int) -> float:
    """The value a trial must beat to rank among the study's `best` COMPLETE trials now
    (earlier results win ties, as `keep` ranks them): -inf while fewer have completed."""
    values = sorted((t.value for t in study.get_trials(
        deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)) if t.value is not None),
        reverse=True)
    return values[best - 1] if len(values) >= best else -math.inf


def ranks(trial: optuna.Trial, value: float, keeper: Keeper) -> bool:
    """Whether a result of `value` ranks in the study's top K now (earlier results win
    ties: a later equal one would only replace it), so its model is worth saving."""
    finished = trial.study.get_trials(deepcopy=False,
                                      states=(optuna.trial.TrialState.COMPLETE,))
    better = sum(t.value is not None and t.value >= value for t in finished
                 if t.number != trial.number)
    return better < keeper.best


def keep(trial: optuna.Trial, value: float, keeper: Keeper, model_dir: Path,
         lock: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
         ) -> str | None:
    """Upload the trial's model, saved in `model_dir`, and remove the models that fall out
    of the study's top K (the caller saves it only where it `ranks`). Called before the trial
    is told, while its attributes may still be written. Returns the artifact id, or None
    when the trial no longer ranks once the list is updated. The upload runs outside the
    study `lock` (a large model takes a while, and other workers claim trials under it); the
    list of kept models is updated under it, so workers finishing at once end with the best
    K whatever their order."""
    study = trial.study
    archive = model_dir.with_suffix(".zip")
    # Stored, not deflated: weights hardly compress, and the trial is still running.
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as bundle:
        for path in sorted(model_dir.rglob("*")):
            bundle.write(path, path.relative_to(model_dir))
    artifact_id = optuna.artifacts.upload_artifact(
        artifact_store=keeper.store, file_path=str(archive), study_or_trial=trial)
    archive.unlink()
    with lock():
        models = kept(study)
        models[trial.number] = {"artifact_id": artifact_id, "value": value}
        ranked = sorted(models.items(), key=lambda item: (-item[1]["value"], item[0]))
        for _, entry in ranked[keeper.best:]:
            with contextlib.suppress(ArtifactNotFound):
                keeper.store.remove(entry["artifact_id"])
        study.set_user_attr(KEPT, {str(n): e for n, e in ranked[:keeper.best]})
    return artifact_id if trial.number in dict(ranked[:keeper.best]) else None


def remove_all(study: optuna.Study, storage: optuna.storages.BaseStorage,
               store: ArtifactStore) -> int:
    """Remove the files of every artifact of the study's trials from the store (the study is
    about to be deleted); returns how many were there."""
    removed = 0
    for trial in study.get_trials(deepcopy=False):
        for meta in optuna.artifacts.get_all_artifact_meta(trial, storage=storage):
            with contextlib.suppress(ArtifactNotFound):
                store.remove(meta.artifact_id)
                removed += 1
    return removed


def settings(trial: optuna.Trial, value: float, value_epoch: float,
             training: dict[str, Any]) -> str:
    """What the kept model is: enough to load it and to train it again."""
    return json.dumps({
        "study": trial.study.study_name, "trial": trial.number, "value": value,
        "value_epoch": value_epoch, "params": trial.params, "training": training,
    }, indent=2) + "\n"
