"""The client store's index on disk: which file holds each client's state, commit by commit.

A million clients' index does not fit in a checkpoint written every round, so it lives in
an SQLite database beside the states (``clients/index.sqlite``, each commit synced to
disk before the checkpoint that names it is written). A commit adds one row per client
whose state changed since the previous one, so a round writes in proportion to the
clients it trained, never the whole index; a checkpoint names its commit's number, and
the view of commit ``k`` (each client's newest row at or before ``k``) is what a resume
from it reads.

Rows stay while a kept checkpoint's view needs them: :meth:`StoreIndex.collect` deletes
the rows a newer row has replaced at or before the oldest kept checkpoint's commit,
looking only at the commits since the last collection (again in proportion to the clients
trained), and :meth:`StoreIndex.rollback` deletes the commits after the one a resume
starts from. A row's file ``NULL`` means the client has no state (it was reset); ``""``
means an empty state, which needs no file.

One process writes the database (rank 0 of a run over ranks; the others are handed the
entries they need). Its journal is SQLite's rollback journal, not the write-ahead log: the
log's readers meet in shared memory, which a filesystem that the ranks of several
machines share over a network does not provide; a round writes one small transaction, so
the log's speed is not needed (``benchmarks/scale.py`` measures a round's cost).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

#: A client's entry: its state's file (relative to the store) and the file's checksum;
#: None: no state.
Entry = tuple[str, str] | None

SCHEMA = """
CREATE TABLE IF NOT EXISTS states (
    cid INTEGER NOT NULL, version INTEGER NOT NULL, file TEXT, checksum TEXT,
    PRIMARY KEY (cid, version)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS states_by_version ON states (version);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class StoreIndex:
    """``cid -> (file, checksum)`` per commit, in ``directory/index.sqlite``."""

    FILE = "index.sqlite"

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / self.FILE
        # autocommit (isolation_level None): every write below opens its own transaction
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        for pragma in ("journal_mode=TRUNCATE", "synchronous=FULL"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.executescript(SCHEMA)
        self.newest = self.get("commit")  # the last commit's number (0: none yet)

    def close(self) -> None:
        self.db.close()

    # ----- the numbers kept beside the rows
    def get(self, key: str, default: int = 0) -> int:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else int(row[0])

    def _set(self, **values: int) -> None:
        self.db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)", values.items())

    # ----- reading
    def entry(self, cid: int, at: int | None = None) -> Entry:
        """Client ``cid``'s entry in the view of commit ``at`` (default: the newest)."""
        row = self.db.execute(
            "SELECT file, checksum FROM states WHERE cid = ? AND version <= ? ORDER BY version DESC LIMIT 1",
            (int(cid), self.newest if at is None else at),
        ).fetchone()
        return None if row is None or row[0] is None else (row[0], row[1] or "")

    def view(self) -> Iterator[tuple[int, str, str]]:
        """``(cid, file, checksum)`` of every client with a state in the newest view."""
        rows = self.db.execute(
            "SELECT s.cid, s.file, s.checksum FROM states s JOIN "
            "(SELECT cid, MAX(version) AS v FROM states GROUP BY cid) newest "
            "ON s.cid = newest.cid AND s.version = newest.v WHERE s.file IS NOT NULL ORDER BY s.cid"
        )
        for cid, name, digest in rows:
            yield int(cid), name, digest or ""

    def files(self) -> set[str]:
        """Every file any row names (what a kept checkpoint may still read)."""
        return {name for (name,) in self.db.execute("SELECT file FROM states WHERE file != ''")}

    # ----- writing
    def commit(self, entries: dict[int, Entry], **meta: int) -> int:
        """A new commit of ``entries`` (and ``meta``, numbers kept with it); its number."""
        version = self.newest + 1
        with self.db:  # one transaction: all of it, or none after a crash
            self.db.execute("BEGIN")
            self.db.executemany(
                "INSERT OR REPLACE INTO states VALUES (?, ?, ?, ?)",
                [(int(cid), version, *(e or (None, None))) for cid, e in sorted(entries.items())],
            )
            self._set(commit=version, **meta)
        self.newest = version
        return version

    def rollback(self, version: int) -> list[str]:
        """Forget the commits after ``version`` (a resume from its checkpoint); the files
        only they named, which may be deleted."""
        if version > self.newest:
            raise LookupError(
                f"{self.path}: the checkpoint names commit {version} of the store's index, which has only "
                f"{self.newest}: the index was replaced or lost since"
            )
        with self.db:
            self.db.execute("BEGIN")
            later = self.db.execute("SELECT file FROM states WHERE version > ?", (version,))
            gone = [name for (name,) in later if name]
            self.db.execute("DELETE FROM states WHERE version > ?", (version,))
            self._set(commit=version, collected=min(self.get("collected"), version))
        self.newest = version
        return gone

    def collect(self, oldest: int) -> list[str]:
        """Delete the rows no view from commit ``oldest`` on needs (each replaced by a newer
        row at or before ``oldest``), looking at the commits since the last call; the files
        they named, which may be deleted."""
        since = self.get("collected")
        if oldest <= since:
            return []
        replaced = (
            "SELECT old.cid, old.version, old.file FROM states new JOIN states old "
            "ON old.cid = new.cid AND old.version < new.version WHERE new.version > ? AND new.version <= ?"
        )
        with self.db:
            self.db.execute("BEGIN")
            rows = self.db.execute(replaced, (since, oldest)).fetchall()
            self.db.executemany("DELETE FROM states WHERE cid = ? AND version = ?", [r[:2] for r in rows])
            # a "no state" row with nothing older left says what no row says
            self.db.execute(
                "DELETE FROM states WHERE file IS NULL AND version > ? AND version <= ?", (since, oldest)
            )
            self._set(collected=oldest)
        return [name for _, _, name in rows if name]
