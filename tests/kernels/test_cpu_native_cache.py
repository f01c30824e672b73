"""The native kernels' disk cache is keyed by a hash of all their sources (kernels/cpu_native/cache.py):
editing an njit helper in one file gives the kernels of every file that calls it a fresh cache, where
numba's own per-file cache keeps serving the stale machine code; an unchanged tree loads from the cache
in a fresh process."""

import ast
import json
import os
import subprocess
import sys
import types
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


def _njit_functions_with_free_variables(path: Path) -> list[str]:
    """Names of functions decorated with njit (or njit(...)) in `path` whose code has free variables."""
    tree = ast.parse(path.read_text())
    decorated = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                f = d.func if isinstance(d, ast.Call) else d
                if getattr(f, "id", getattr(f, "attr", None)) == "njit":
                    # a decorated function's code starts at its first decorator's line
                    decorated.add((node.name, node.decorator_list[0].lineno))
    found = []
    stack = [compile(tree, str(path), "exec")]
    while stack:
        code = stack.pop()
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
        if (code.co_name, code.co_firstlineno) in decorated and code.co_freevars:
            found.append(f"{path.name}:{code.co_name} reads {', '.join(code.co_freevars)} from a closure")
    return found


def test_no_native_kernel_reads_a_closure_cell():
    """numba keys a cached kernel also on its pickled closure, and a helper dispatcher pickles differently in
    every process: a kernel that reached a helper through a closure cell compiled again in every process
    (sparse_encode's encode_many until stop 43). Kernels must read their helpers as module globals."""
    files = [f for d in cache._DIRS for f in cache.keyed_sources(d)]
    assert any(f.name == "sparse_encode.py" for f in files) and any(f.name == "reference.py" for f in files)
    found = [x for f in files for x in _njit_functions_with_free_variables(f)]
    assert found == [], found


def test_the_closure_check_sees_a_closure(tmp_path):
    """The check above can fail: a kernel built in a function over a helper it closes over is found."""
    f = tmp_path / "closed.py"
    f.write_text("from x import njit\n\ndef _build():\n    @njit\n    def helper(v):\n        return v\n\n"
                 "    @njit\n    def kernel(v):\n        return helper(v)\n\n    return kernel\n")
    assert _njit_functions_with_free_variables(f) == ["closed.py:kernel reads helper from a closure"]


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
