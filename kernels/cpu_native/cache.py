"""Where the native kernels' machine code is cached on disk: a directory keyed by a hash of every source
the kernels compile from.

Why: numba's own cache (`cache=True`) keys a kernel's entry on its own file's timestamp and its own
bytecode, but the machine code also holds every njit helper it calls (inlined from other files) and the
global arrays it freezes (sparse_decode.py's tables, built from reference.py and format.py). Editing
`quantize.e2m1_code` would leave kv.py's, grouped_mm.py's and sparse_decode.py's cached kernels running
the old helper in every later process. Here every kernel of a registered directory is cached under
`__pycache__/numba-<key>/`, key = sha256 over the directory's *.py files and the listed extra sources
(names and bytes, not timestamps): any change to any of them starts a fresh directory, so all kernels
compile once again, and an unchanged tree (a checkout that only touched timestamps, a fresh process)
loads what is there.

A locator class put in front of numba's (numba.core.caching); it answers only for files of a registered
directory and leaves every other numba user alone. Where `__pycache__` is not writable it uses numba's
user-wide cache directory (or NUMBA_CACHE_DIR when set), still keyed. Old key directories are left in
place (a few MB each; delete `__pycache__/numba-*` to reclaim them). NUMBA_CACHE_LOCATOR_CLASSES
replaces numba's locator list and so bypasses this one: the hazard is back then.

A kernel must reach the njit helpers it calls as module globals, never through a closure cell: numba keys
a cache entry also on the pickled closure, where a dispatcher pickles with a uuid drawn anew in every
process, so such a kernel never finds its entry and compiles again in every process (sparse_encode's
`encode_many` did until stop 43: ~70 LLVM modules at the engine's first take, 19 index entries). Globals
are resolved at compile time and their source is in the directory key. tests/kernels/
test_cpu_native_cache.py checks every njit function of a registered directory for free variables.
"""

import hashlib
import os
from pathlib import Path

HERE = Path(__file__).resolve().parent
# sources whose values the kernels freeze into machine code besides their own directory's files
EXTRA = (HERE.parent / "format.py", HERE.parent / "reference.py")

_DIRS: dict[Path, tuple[Path, ...]] = {}  # registered directory -> extra sources keyed with its *.py
_KEYS: dict[Path, str] = {}


def source_key(paths) -> str:
    """16 hex digits of sha256 over each file's name and bytes, in the order given."""
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def keyed_sources(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob("*.py")) + list(_DIRS[Path(directory)])


def key(directory: Path = HERE) -> str:
    """The cache key of a registered directory's kernels (computed once per process)."""
    directory = Path(directory)
    if directory not in _KEYS:
        _KEYS[directory] = source_key(keyed_sources(directory))
    return _KEYS[directory]


def register(directory, extra=()) -> None:
    """Cache the njit kernels of files in `directory` under a key of its *.py files and `extra`."""
    _DIRS[Path(directory).resolve()] = tuple(Path(p) for p in extra)


def _candidate_dirs(directory: Path) -> list[str]:
    from numba.core import config
    from numba.misc.appdirs import AppDirs

    sub = f"numba-{key(directory)}"
    tag = f"trace_fp4_{hashlib.sha1(str(directory).encode()).hexdigest()[:12]}"
    out = [] if not config.CACHE_DIR else [os.path.join(config.CACHE_DIR, tag, sub)]
    out.append(os.path.join(directory, "__pycache__", sub))
    out.append(os.path.join(AppDirs(appname="numba", appauthor=False).user_cache_dir, tag, sub))
    return out


_LOCATOR = None


def install() -> None:
    """Put the keyed locator in front of numba's own (once per process); before any `njit(cache=True)`."""
    global _LOCATOR
    if _LOCATOR is not None:
        return
    from numba.core import caching

    class SourceKeyedLocator(caching._CacheLocator):
        def __init__(self, py_func, path, stamp):
            self._lineno = py_func.__code__.co_firstlineno
            self._path = path
            self._stamp = stamp

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return self._stamp  # the key, not a timestamp: the directory already is per key

        def get_disambiguator(self):
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func, py_file):
            directory = Path(py_file).resolve().parent
            if directory not in _DIRS:
                return None
            for path in _candidate_dirs(directory):
                self = cls(py_func, path, key(directory))
                try:
                    self.ensure_cache_path()
                    return self
                except OSError:
                    continue
            return None

    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    impl._locator_classes.insert(0, SourceKeyedLocator)
    _LOCATOR = SourceKeyedLocator


register(HERE, EXTRA)
