"""Record stores: records travel by handle, byte-identical, consumed once, counted; a writer killed
mid-write leaves nothing a reader can take. The Ray store runs on a real local Ray instance."""

import multiprocessing as mp
import os
import pickle
import signal
import time

import pytest

import trace_kernels as tk
from record_factory import captured_builder
from trace_kernels import stores

FULL = tk.TraceConfig(guidance="full", guided_layers="all")


def _record(seed=0, prompt=5, steps=(5, 1, 1), **ident):
    b = captured_builder(FULL, steps=steps, seed=seed)
    b.set_identity(token_ids=list(range(seed, seed + sum(steps))), num_prompt_tokens=prompt, weights_version=1, **ident)
    return b.build()


def _group(n=4, P=130):
    """n samples of one prompt: the same prompt rows, different completions (like a GRPO group)."""
    import torch

    base = _record(seed=0, prompt=P, steps=(P, 1, 1))
    out = []
    for i in range(n):
        other = _record(seed=100 + i, prompt=P, steps=(P, 1, 1))
        tensors = {k: torch.cat([base.tensors[k][:P], other.tensors[k][P:]]) for k in base.tensors}
        out.append(tk.GuidanceRecord(base.shape, base.config, base.num_tokens, base.modes, tensors, other.identity))
    return out


def _check_store(store, tmp_path=None):
    group = _group()
    handles = [store.put(r) for r in group]
    assert all(isinstance(h, str) and len(h) < 200 and pickle.loads(pickle.dumps(h)) == h for h in handles)
    assert store.stats()["outstanding"] == 4
    assert store.stats()["prefix_parts_put"] == 1 and store.stats()["prefix_parts_reused"] == 3
    # Any process resolves a handle by itself; the record is byte-identical to the inline one.
    assert stores.get(handles[0], consume=False).to_bytes() == group[0].to_bytes()
    for h, r in zip(handles[:3], group[:3]):
        assert stores.get(h).to_bytes() == r.to_bytes()
    with pytest.raises(tk.RecordError, match=f"{handles[0]}: no such record .*already taken"):
        stores.get(handles[0])
    assert store.stats()["outstanding"] == 1  # a leak unless someone takes or deletes it
    stores.delete(handles[3])
    s = store.stats()
    assert (s["put"], s["taken"], s["deleted"], s["outstanding"]) == (4, 3, 1, 0)
    # A whole record (no prompt length) is stored as it is.
    whole = _record(prompt=None)
    h = store.put(whole)
    assert stores.get(h).to_bytes() == whole.to_bytes()
    with pytest.raises(tk.RecordError, match="not a trace-fp4 record handle"):
        stores.get("/tmp/x.safetensors")
    return s


def test_local_store(tmp_path):
    store = stores.open_store(f"file:{tmp_path}")
    assert stores.open_store(str(tmp_path)) is store
    _check_store(store)
    assert store.stats()["prompt_parts"] == 0  # the last user removed the shared prompt part
    assert not list(tmp_path.iterdir())


def test_prompt_part_saves_bytes(tmp_path):
    group = _group(n=8, P=256)
    shared, whole = stores.LocalStore(tmp_path / "a"), stores.LocalStore(tmp_path / "b", share_prefixes=False)
    for r in group:
        shared.put(r), whole.put(r)
    ratio = whole.stats()["bytes_put"] / shared.stats()["bytes_put"]
    assert ratio > 3, ratio  # 8 x (256 + 2) rows vs 256 + 8 x 2 rows, plus 9 headers vs 8


def test_damaged_stored_record_is_refused_naming_the_handle(tmp_path):
    store = stores.LocalStore(tmp_path)
    h = store.put(_record(prompt=None))
    path = tmp_path / (h.rsplit("#", 1)[1] + ".rec")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(tk.RecordError, match=f"{h}: .*checksum mismatch"):
        stores.get(h)


def _slow_writer(directory, data: bytes, ready):
    import trace_kernels.stores.local as local

    real_open = open

    class Slow:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            self.f.write(b[: len(b) // 2])
            self.f.flush()
            ready.set()
            time.sleep(60)  # killed here, half written

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.__exit__(*a)

    local.open = lambda *a, **k: Slow(real_open(*a, **k))
    stores.LocalStore(directory).put(tk.GuidanceRecord.from_bytes(data))


def test_writer_killed_mid_write_leaves_nothing_to_read(tmp_path):
    record = _record(prompt=None)
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_slow_writer, args=(str(tmp_path), record.to_bytes(), ready))
    p.start()
    assert ready.wait(120), "the writer never started writing"
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    store = stores.LocalStore(tmp_path)
    s = store.stats()
    assert s["outstanding"] == 0 and s["partial_writes"] == 1  # only the hidden temporary file
    partial = next(tmp_path.glob(".tmp-*"))
    assert 0 < partial.stat().st_size < len(record.to_bytes())
    with pytest.raises(tk.RecordError, match="truncated"):
        tk.GuidanceRecord.from_bytes(partial.read_bytes(), source=str(partial))


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="trace_fp4_test",
             object_store_memory=80 << 20, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


def test_ray_store(ray_cluster):
    store = stores.open_store("ray:records_test")
    s = _check_store(store)
    assert s["store"]["outstanding"] == 0 and s["store"]["prompt_parts"] == 0
    # A record put by a worker process outlives that worker (the detached owner actor holds it).
    record = _record(seed=3, prompt=None)

    def put_in_a_task(data):  # nested: Ray ships it by value (the test module is not importable there)
        import trace_kernels

        store = trace_kernels.stores.open_store("ray:records_test")
        return store.put(trace_kernels.GuidanceRecord.from_bytes(data))

    task = ray_cluster.remote(max_retries=0)(put_in_a_task)
    handle = ray_cluster.get(task.remote(record.to_bytes()))
    assert handle.startswith("trace-fp4:ray:records_test#")
    assert stores.get(handle).to_bytes() == record.to_bytes()
