"""LocalStore: records as files in one directory (one machine, or a shared filesystem).

  <dir>/<key>.rec                      a record (or its rest, see prefix.py)
  <dir>/prompt-<sha256>.part           a prompt part shared by several records
  <dir>/prompt-<sha256>.refs/<key>     one marker per record that uses that prompt part

Writes are atomic: the bytes go to a hidden temporary file in the same directory, are fsynced, then
renamed onto the final name (rename is atomic on POSIX filesystems). A writer killed mid-write leaves
only a `.tmp-*` file, which no reader ever opens. Taking a record is a rename to a hidden name first,
so across processes each record is taken exactly once (the loser gets RecordError "already taken").
The last record that uses a prompt part removes it (rmdir of its empty refs directory decides who is
last). Not supported: putting a record of a prompt part while the last record using that part is
being taken (the part can disappear under it; the reader then gets RecordError naming it).
"""

import os
import uuid
from pathlib import Path

from ..records import RecordError
from .base import RecordStore
from .trust import remember

RECORD_SUFFIX = ".rec"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class LocalStore(RecordStore):
    """`create=False` (a store opened to read) never makes the directory: a reader that names a
    directory that is not there gets RecordError, and nothing appears on disk."""

    def __init__(self, directory, *, share_prefixes: bool = True, create: bool = True, read_only: bool = False):
        super().__init__(share_prefixes=share_prefixes, read_only=read_only)
        self.dir = Path(directory).resolve()
        self.spec = f"file:{self.dir}"
        if create and not read_only:
            self.ensure_writable()

    def ensure_writable(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        remember(self.spec)  # a store this process writes to is one it configured

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{RECORD_SUFFIX}"

    def _write(self, key: str, data: bytes) -> None:
        _atomic_write(self._path(key), data)

    def _read(self, key: str, handle: str, *, consume: bool) -> bytes:
        if not self.dir.is_dir():
            raise RecordError(f"{handle}: no such record store directory {self.dir} (nothing was created)")
        path = self._path(key)
        if consume:
            claimed = self.dir / f".taken-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(path, claimed)  # atomic: one taker wins
            except FileNotFoundError:
                raise RecordError(f"{handle}: no such record in {self.dir} (already taken or deleted, or never put)") from None
            path = claimed
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise RecordError(f"{handle}: no such record in {self.dir} (already taken or deleted, or never put)") from None
        except OSError as e:
            raise RecordError(f"{handle}: cannot read {path} ({e})") from e
        if consume:
            path.unlink()
        return data

    def _put_prefix(self, prefix_key: str, data: bytes, record_key: str) -> bool:
        refs = self.dir / f"{prefix_key}.refs"
        refs.mkdir(exist_ok=True)
        (refs / record_key).touch()  # the reference first, so a concurrent last taker keeps the part
        part = self.dir / f"{prefix_key}.part"
        if part.exists():
            return True
        _atomic_write(part, data)
        return False

    def _read_prefix(self, prefix_key: str, handle: str) -> bytes:
        part = self.dir / f"{prefix_key}.part"
        try:
            return part.read_bytes()
        except OSError as e:
            raise RecordError(f"{handle}: its prompt part {part} cannot be read ({e})") from e

    def _release_prefix(self, prefix_key: str, record_key: str) -> None:
        refs = self.dir / f"{prefix_key}.refs"
        try:
            (refs / record_key).unlink()
        except FileNotFoundError:
            pass
        try:
            refs.rmdir()  # succeeds only for the last user
        except OSError:
            return
        try:
            (self.dir / f"{prefix_key}.part").unlink()
        except FileNotFoundError:
            pass

    def _outstanding(self) -> int:
        if not self.dir.is_dir():
            return 0
        return sum(1 for p in self.dir.glob(f"*{RECORD_SUFFIX}") if not p.name.startswith("."))

    def partial_writes(self) -> int:
        """Temporary files left by writers that died mid-write (never read; `clean()` removes them)."""
        return sum(1 for _ in self.dir.glob(".tmp-*"))

    def stats(self) -> dict:
        out = super().stats()
        out["partial_writes"] = self.partial_writes()
        out["prompt_parts"] = sum(1 for _ in self.dir.glob("prompt-*.part"))
        return out
