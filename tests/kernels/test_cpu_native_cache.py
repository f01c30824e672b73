"""The native kernels' disk cache is keyed by a hash of all their sources (kernels/cpu_native/cache.py):
editing an njit helper in one file gives the kernels of every file that calls it a fresh cache, where
numba's own per-file cache keeps serving the stale machine code; an unchanged tree loads from the cache
in a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path

from trace_kernels.cpu_native import cache, quantize

REPO = Path(__file__).resolve().parents[2]

HELPER = '''
from trace_kernels.cpu_native import njit

@njit
def helper(x):
    return x + {value}
'''

# a kernel in a directory not registered: numba's own cache (the control that shows the hazard is real)
PLAIN = '''
import numba

from helper import helper


@numba.njit(cache=True)
def plain(x):
    return helper(x)
'''

# one kernel under the keyed cache (its directory registered, like kernels/cpu_native), the control beside it
USER = '''
import json, sys
from pathlib import Path

from trace_kernels.cpu_native import cache, njit
cache.register(Path(__file__).resolve().parent)
from helper import helper
from plain import plain


@njit
def keyed(x):
    return helper(x)


out = {"keyed": keyed(1), "plain": plain(1)}
out["keyed_hits"] = sum(keyed.stats.cache_hits.values())
out["plain_hits"] = sum(plain.stats.cache_hits.values())
out["keyed_dir"] = keyed._cache.cache_path
print(json.dumps(out))
'''


def _run(d: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{d}{os.pathsep}{d / 'other'}", NUMBA_CACHE_DIR="")
    env.pop("NUMBA_CACHE_LOCATOR_CLASSES", None)
    r = subprocess.run([sys.executable, str(d / "user.py")], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_changed_helper_yields_a_fresh_cache_in_the_files_that_call_it(tmp_path):
    (tmp_path / "helper.py").write_text(HELPER.format(value=1))
    (tmp_path / "user.py").write_text(USER)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "plain.py").write_text(PLAIN)
    first = _run(tmp_path)
    assert first["keyed"] == first["plain"] == 2 and first["keyed_hits"] == 0
    again = _run(tmp_path)  # a fresh process, nothing changed: both load their machine code
    assert again["keyed"] == again["plain"] == 2
    assert again["keyed_hits"] == 1 and again["plain_hits"] == 1 and again["keyed_dir"] == first["keyed_dir"]
    (tmp_path / "helper.py").write_text(HELPER.format(value=10))
    edited = _run(tmp_path)
    assert edited["plain"] == 2  # numba's own cache: user.py did not change, the stale helper runs
    assert edited["keyed"] == 11 and edited["keyed_hits"] == 0 and edited["keyed_dir"] != first["keyed_dir"]


def test_the_key_follows_content_not_timestamps(tmp_path):
    srcs = cache.keyed_sources(cache.HERE)
    assert {p.name for p in srcs} >= {"quantize.py", "kv.py", "sparse_decode.py", "format.py", "reference.py"}
    copies = []
    for p in srcs:
        c = tmp_path / p.name
        c.write_bytes(p.read_bytes())
        copies.append(c)
    assert cache.source_key(copies) == cache.key()  # same bytes, other paths and timestamps: same key
    q = tmp_path / "quantize.py"
    q.write_text(q.read_text().replace("if a > F32(0.25):", "if a >= F32(0.25):"))
    assert cache.source_key(copies) != cache.key()


def test_the_kernels_cache_under_the_key():
    quantize.tables()
    for kernel in (quantize.quantize_kernel, quantize.dequantize_kernel):
        assert Path(kernel._cache.cache_path).name == f"numba-{cache.key()}"


# a kernel built inside a function, calling a helper it closes over (sparse_encode.py's `_build` pattern)
CLOSED = '''
import json
from pathlib import Path

from trace_kernels.cpu_native import cache, njit
cache.register(Path(__file__).resolve().parent)
from helper import helper


def _build():
    @njit
    def twice(x):
        return 2 * helper(x)

    @njit
    def closed(x):
        return twice(x) + 1

    return closed


closed = _build()
print(json.dumps({"value": closed(1), "hits": sum(closed.stats.cache_hits.values()),
                  "misses": sum(closed.stats.cache_misses.values()),
                  "index": sorted(p.name for p in Path(closed._cache.cache_path).glob("*closed*"))}))
'''


def test_a_kernel_closing_over_a_helper_loads_from_the_cache_in_a_fresh_process(tmp_path):
    """numba keys an entry also on the pickled closure, where a helper dispatcher pickles with a uuid drawn
    anew in every process: without cache.py's closure key such a kernel missed in every process (the
    engine's first take compiled `encode_many` each time) and its index grew an entry per process."""
    (tmp_path / "helper.py").write_text(HELPER.format(value=1))
    (tmp_path / "user.py").write_text(CLOSED)
    first = _run(tmp_path)
    assert first["value"] == 5 and first["hits"] == 0 and first["misses"] == 1
    again = _run(tmp_path)
    assert again["value"] == 5 and again["hits"] == 1 and again["misses"] == 0
    assert again["index"] == first["index"]  # no second entry written
    (tmp_path / "helper.py").write_text(HELPER.format(value=10))  # the helper's source is still keyed
    assert _run(tmp_path)["value"] == 23

ENCODERS = '''
import json
import numpy as np
import torch
from trace_kernels.cpu_native import sparse_encode
from trace_kernels.guides.sparse.rates import rates_for

rates = rates_for("moe_fc1_in", 64)
codes = torch.randint(0, 256, (6, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
scales = torch.full((6, 4), 0x38, dtype=torch.uint8)
amax = torch.linspace(1, 2, 6, dtype=torch.float32)
sparse_encode.encode_many(codes, scales, amax, np.array([0, 2, 6]), 64, 64, rates, 1)
sparse_encode.encode_payload(codes, None, scales, amax, 64, 64, rates, 1)
print(json.dumps({name: [sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())]
                  for name, k in (("many", sparse_encode.many_kernel()), ("rows", sparse_encode.kernel()))}))
'''


def test_the_sparse_encoders_load_from_the_disk_cache_in_a_fresh_process():
    """encode_many / encode_rows read their helpers as globals, not closure cells: numba keys a cached
    kernel on its closure's pickled contents, which differ in every process for a dispatcher, so the take's
    encoder compiled again (~1.5 s) in every process until lane take10 (16 copies piled up in the cache)."""
    from trace_kernels.cpu_native import sparse_encode

    assert sparse_encode.many_kernel().py_func.__closure__ is None
    assert sparse_encode.kernel().py_func.__closure__ is None
    runs = []
    for _ in range(2):  # the first may compile and save (a fresh tree); the second must load both
        r = subprocess.run([sys.executable, "-c", ENCODERS], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, TRACE_FP4_CPU_BACKEND="native"))
        assert r.returncode == 0, r.stderr
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert runs[1] == {"many": [1, 0], "rows": [1, 0]}, runs
