"""optuna-dashboard over a study's storage, read-only unless asked otherwise.

The dashboard can tell a running trial COMPLETE or FAIL, edit attributes and delete a study,
and it has no authentication: a fleet's results are one click from gone. By default every
write is refused at the storage (HTTP 403 with the reason, shown in the page);
`--allow-writes` serves the storage as it is.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

import bottle
from optuna.artifacts.exceptions import ArtifactNotFound
from optuna.storages import RDBStorage

from hpo.search.resilience import ResilientRDBStorage

if TYPE_CHECKING:
    from optuna.artifacts._protocol import ArtifactStore

REFUSAL = "this dashboard is read-only; restart it with `hpo dashboard --allow-writes` to edit"


_WRITE = re.compile(r"_?(create_new|delete|set|record)_")


def _writes(cls: type) -> Iterator[str]:
    """Every method of the RDB storage that changes the database, public or private: the
    names Optuna gives its writes (create_new_*, delete_*, set_*, record_*)."""
    for klass in cls.__mro__:
        for name, attribute in vars(klass).items():
            if inspect.isfunction(attribute) and _WRITE.match(name):
                yield name


def _refused(name: str) -> Callable[..., Any]:
    def refuse(self: ReadOnlyStorage, *args: Any, **kwargs: Any) -> Any:
        # optuna-dashboard turns bottle's HTTPError into the status and reason it shows.
        raise bottle.HTTPError(403, f"{REFUSAL} ({name} refused)")

    return functools.update_wrapper(refuse, getattr(RDBStorage, name))


class ReadOnlyStorage(ResilientRDBStorage):
    """The storage with every write refused."""


# `upgrade` migrates the schema; optuna-dashboard offers it for an old one.
for _name in sorted({*_writes(RDBStorage), "upgrade"}):
    setattr(ReadOnlyStorage, _name, _refused(_name))


class DashboardArtifactStore:
    """The artifact store of the kept models as the dashboard gets it: writes and removals
    refused unless writes are allowed (optuna-dashboard removes a study's artifacts before
    it deletes the study, so a read-only dashboard would lose them even though the study
    stays); and removing a model already removed from the store (one that fell out of the
    best, still listed on its trial) is no error."""

    def __init__(self, store: ArtifactStore, *, writable: bool) -> None:
        self._store = store
        self._writable = writable

    def open_reader(self, artifact_id: str) -> BinaryIO:
        return self._store.open_reader(artifact_id)

    def write(self, artifact_id: str, content_body: BinaryIO) -> None:
        self._refuse_unless_writable("writing an artifact")
        self._store.write(artifact_id, content_body)

    def remove(self, artifact_id: str) -> None:
        self._refuse_unless_writable("removing an artifact")
        with contextlib.suppress(ArtifactNotFound):
            self._store.remove(artifact_id)

    def _refuse_unless_writable(self, what: str) -> None:
        if not self._writable:
            raise bottle.HTTPError(403, f"{REFUSAL} ({what} refused)")
