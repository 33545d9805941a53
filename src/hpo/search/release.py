"""Which release of hpo a study was created by, and whether this one can read it.

Workers of different releases may join one study (a fleet upgraded one machine at a time).
Each study records the release that created it and the format of what hpo stores in it
(pinned space, check verdicts, batch limits, trial attributes). A release reads every format up
to its own; when a change would make older workers misread a study, STORE_FORMAT goes up, and
an older worker then stops with one line saying to upgrade instead of failing inside a trial.
"""

from __future__ import annotations

from importlib import metadata
from typing import TYPE_CHECKING

from hpo.errors import StudyFormatError

if TYPE_CHECKING:  # the CLI asks for the version before it loads optuna
    import optuna

ATTR = "hpo_release"

# What hpo stores in a study, version 1: everything up to and including this release. Added
# keys do not need a new format (readers leave out what they do not know); a renamed or
# reinterpreted one does.
STORE_FORMAT = 1


def version() -> str:
    try:
        return metadata.version("hpo")
    except metadata.PackageNotFoundError:  # run from a source tree without installing it
        return "unknown"


def record(study: optuna.Study) -> dict:
    """Record this release on a study that holds no record yet (a new study, or one created
    before releases were recorded: it gets the first release that joined it, marked so), then
    check the one it holds. Called under the study lock."""
    found = study.user_attrs.get(ATTR)
    if found is None:
        found = {"created_by": version(), "format": STORE_FORMAT}
        if study.trials:
            found["created_by"] = f"before {found['created_by']}"
        study.set_user_attr(ATTR, found)
    validate(study.study_name, found)
    return found


def validate(name: str, found: object) -> None:
    """Raise StudyFormatError unless this release reads the format recorded in `found`."""
    record = found if isinstance(found, dict) else {}
    stored = record.get("format")
    if not isinstance(stored, int) or isinstance(stored, bool):
        raise StudyFormatError(
            f"study {name!r} holds an unreadable {ATTR} record ({found!r}): it was not "
            "written by hpo; use another study name")
    if stored > STORE_FORMAT:
        raise StudyFormatError(
            f"study {name!r} was written by hpo {record.get('created_by', '?')} in store format "
            f"{stored}; this hpo {version()} reads formats up to {STORE_FORMAT}: upgrade hpo "
            "on this machine (pip install -U hpo, or the fleet's newer image)")
