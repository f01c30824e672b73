"""The capture store's host arena (kernels/engine/host_arena.py): the native kernels' capture rows written into
the store's rows of the step (host_kv_rows / host_moe_rows / put_routing), a step recorded as one ArenaStep,
and the take's gather (gather_arena_chunks). No engine: the store driven as the runner hook and the native
layer calls drive it, random bytes written where the kernels would write; every request's rows read back
(its own join, and the take's gather of many requests) equal to what was written for it."""

import gc
import random
import weakref

import numpy as np
import torch

import trace_kernels
from trace_kernels import ModelShape, TraceConfig
from trace_kernels.engine import host_arena
from trace_kernels.engine.captured_rows import ChunkJoiner, StepChunks
from trace_kernels.engine.host_arena import ArenaStep, gather_arena_chunks
from trace_vllm_plugin.capture import CaptureStore, StepLayout

SHAPE = ModelShape(num_layers=2, hidden_size=32, moe_intermediate_size=16, num_experts=4, top_k=2, num_kv_heads=1, head_dim=16)
CONFIG = TraceConfig(guidance="full", guided_layers="all")


def _store():
    store = CaptureStore(SHAPE, CONFIG)
    store.host_rows = True
    store.max_bytes = 1 << 30
    return store


class Driver:
    """Steps through the store as the native engine's layer calls make them: the arena's rows filled with random
    bytes (a key's first write, where the store has no buffers for it yet, goes through put_owned), remembering
    each request's rows at each position. `skip`: a key the next forward does not write."""

    def __init__(self, store, seed):
        self.store, self.rng = store, np.random.default_rng(seed)
        self.rows: dict = {}  # request -> {position: {key: (codes, scales, amax) or ids of one row}}
        self.arena_steps = 0

    def _fill(self, arrays):
        for a in arrays:
            a[...] = self.rng.integers(0, 256, a.nbytes, dtype=np.uint8).view(a.dtype).reshape(a.shape)

    def step(self, ids, lengths, starts, skip=None):
        store, N = self.store, sum(lengths)
        qsl = list(np.cumsum([0] + list(lengths)))
        qsl = [int(x) for x in qsl]
        store.begin_step(StepLayout(list(ids), qsl, list(starts)))
        put = {}
        H, D, k, I, Hm = SHAPE.num_kv_heads, SHAPE.head_dim, SHAPE.top_k, SHAPE.moe_intermediate_size, SHAPE.hidden_size
        for layer in range(SHAPE.num_layers):
            if skip != ("kv", layer):
                out = store.host_kv_rows(layer, N, H, D, D)
                if out is None:
                    out = tuple(torch.from_numpy(a) for a in host_arena_outputs(N, H, D))
                    self._fill([t.numpy() for t in out])
                    store.put_owned(layer, "k", trace_kernels.NVFP4Tensor(out[2], out[3], out[0]))
                    store.put_owned(layer, "v", trace_kernels.NVFP4Tensor(out[4], out[5], out[1]))
                    out = tuple(t.numpy() for t in out)
                else:
                    self._fill(out)
                    store.host_wrote(layer, "k", "v")
                ka, va, kc, ks, vc, vs = (np.array(a) for a in out)
                put[(layer, "k")], put[(layer, "v")] = (kc, ks, ka), (vc, vs, va)
            ids_t = torch.from_numpy(self.rng.integers(0, SHAPE.num_experts, (N, k)))
            store.put_routing(layer, ids_t)
            put[("routing", layer)] = ids_t.numpy().astype(np.int16)
            out = store.host_moe_rows(layer, N, Hm, k, I)
            if out is None:
                out = (np.empty((N, Hm // 2), np.uint8), np.empty((N, Hm // 16), np.uint8), np.empty(N, np.float32),
                       np.empty((N, k, I // 2), np.uint8), np.empty((N, k, I // 16), np.uint8), np.empty((N, k), np.float32))
                self._fill(out)
                t = [torch.from_numpy(a) for a in out]
                store.put_owned(layer, "moe_fc1_in", trace_kernels.NVFP4Tensor(*t[:3]))
                store.put_owned(layer, "moe_fc2_in", trace_kernels.NVFP4Tensor(*t[3:]))
            else:
                self._fill(out)
                store.host_wrote(layer, "moe_fc1_in", "moe_fc2_in")
            out = [np.array(a) for a in out]
            put[(layer, "moe_fc1_in")], put[(layer, "moe_fc2_in")] = tuple(out[:3]), tuple(out[3:])
        before = store.arena.chunk
        n_steps = _arena_steps(store)
        store.end_step()
        self.arena_steps += _arena_steps(store) - n_steps
        for r, a, b, s in zip(ids, qsl, qsl[1:], starts):
            if b > a and r not in store.requests.taken:
                per = self.rows.setdefault(r, {})
                for j in range(b - a):
                    per[s + j] = {key: (v[a + j] if not isinstance(v, tuple) else tuple(x[a + j] for x in v))
                                  for key, v in put.items()}
        return before

    def want(self, r, rows):
        """Request r's rows 0..rows-1 of every key, stacked: {("routing", layer): ids, (layer, site): 3 arrays}."""
        keys = self.rows[r][0].keys()
        out = {}
        for key in keys:
            vals = [self.rows[r][p][key] for p in range(rows)]
            out[key] = np.stack(vals) if key[0] == "routing" else tuple(np.stack(x) for x in zip(*vals))
        return out


def host_arena_outputs(T, H, D):
    from trace_kernels.cpu_native.kv_row_write import _outputs

    return _outputs(T, H, D, D)


def _arena_steps(store):
    return sum(isinstance(st, ArenaStep) for cap in store.requests.all() for st in getattr(cap, "_steps", []))


def _check_joined(d, cap, r, rows):
    """The request's own join (views of the arena's rows) equals what was written for it."""
    assert cap.num_rows == rows
    chunks = cap.record_chunks()
    joiner = ChunkJoiner()
    routing = joiner.join([x for x, _ in chunks])
    sites = joiner.join([s for _, s in chunks])
    want = d.want(r, rows)
    for key, w in want.items():
        if key[0] == "routing":
            assert np.array_equal(routing[key[1]].numpy(), w), (r, key)
        else:
            q = sites[key]
            for got, ww in zip((q.codes, q.scales, q.global_amax), w):
                assert np.array_equal(got.numpy().view(np.uint8), ww.view(np.uint8)), (r, key)


def _check_gathered(d, caps):
    """The take's gather of several requests (in the order given) equals each one's written rows back to back."""
    chunks = [c.record_chunks() for _, c, _ in caps]
    assert all(isinstance(c, StepChunks) and c.in_arena() for c in chunks)
    routing, sites = gather_arena_chunks(chunks)
    wants = [d.want(r, n) for r, _, n in caps]
    for key in wants[0]:
        if key[0] == "routing":
            assert np.array_equal(routing[key[1]].numpy(), np.concatenate([w[key] for w in wants]))
        else:
            q = sites[key]
            for i, got in enumerate((q.codes, q.scales, q.global_amax)):
                want = np.concatenate([w[key][i] for w in wants])
                assert np.array_equal(got.numpy().view(np.uint8), want.view(np.uint8)), key


def test_rows_of_ragged_requests_read_back_as_written_in_any_take_order(monkeypatch):
    # small chunks: the steps of one request span several chunks
    monkeypatch.setattr(host_arena, "CHUNK_BYTES", 2000)
    monkeypatch.setattr(host_arena, "MIN_ROWS", 8)
    rng = random.Random(3)
    store = _store()
    d = Driver(store, seed=3)
    ids = [f"r{i}" for i in range(7)]
    pos = {r: 0 for r in ids}
    ends = {r: rng.randint(3, 14) for r in ids}
    running = list(ids)
    d.step(running, [rng.randint(1, 5) for _ in running], [0] * len(running))  # keys' first writes: put_owned
    for r, n in zip(running, store.step.query_start_loc if store.step else []):
        pass
    for r in running:
        pos[r] = d.rows[r] and max(d.rows[r]) + 1
    taken = []
    aborted = "r5"
    while running:
        lengths = [1] * len(running)
        d.step(running, lengths, [pos[r] for r in running])
        for r in running:
            pos[r] += 1
        for r in list(running):
            if pos[r] >= ends[r] + 3 or (r == aborted and pos[r] >= 4):
                running.remove(r)
                store.finish(r, aborted=(r == aborted))
                taken.append(r)
    assert d.arena_steps > 0
    rng.shuffle(taken)
    done = [r for r in taken if r != aborted and r in store.done]
    # a take of several requests together (the take's gather), then each alone (its own join), in a random order
    group = done[:4]
    caps = [(r, store.peek(r), pos[r]) for r in group]
    # the first step of every request was put_owned (not the arena's): gather those that are all arena steps
    _check_gathered_from(d, store, group, pos)
    for r in done:
        cap = store.take(r, pos[r])
        _check_joined(d, cap, r, pos[r])
    assert aborted not in store.done


def _check_gathered_from(d, store, group, pos):
    """gather_arena_chunks of the requests' rows after their first (put_owned) step: a StepChunks of those steps."""
    caps = []
    for r in group:
        cap = store.peek(r)
        ch = cap.record_chunks()
        assert isinstance(ch, StepChunks)
        first = ch.ranges[0][1] - ch.ranges[0][0]
        sub = StepChunks(ch.steps[1:], ch.ranges[1:], ch.rows() - first)
        caps.append((r, sub, first))
    routing, sites = gather_arena_chunks([c for _, c, _ in caps])
    for key in d.want(group[0], 1):
        parts = []
        for r, _, first in caps:
            w = d.want(r, pos[r])[key]
            parts.append(w[first:] if key[0] == "routing" else tuple(x[first:] for x in w))
        if key[0] == "routing":
            assert np.array_equal(routing[key[1]].numpy(), np.concatenate(parts))
        else:
            q = sites[key]
            for i, got in enumerate((q.codes, q.scales, q.global_amax)):
                assert np.array_equal(got.numpy().view(np.uint8), np.concatenate([p[i] for p in parts]).view(np.uint8))


def test_a_chunk_is_freed_when_its_last_step_is_taken(monkeypatch):
    monkeypatch.setattr(host_arena, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(host_arena, "MIN_ROWS", 4)
    monkeypatch.setattr(host_arena, "POOL_CHUNKS", 0)
    store = _store()
    d = Driver(store, seed=5)
    d.step(["a", "b"], [2, 2], [0, 0])
    first = None
    for t in range(12):
        d.step(["a", "b"], [1, 1], [2 + t, 2 + t])
        if t == 1:
            first = weakref.ref(store.arena.chunk)
    assert first() is not None and first() is not store.arena.chunk  # the store moved on to later chunks
    store.finish("a")
    store.finish("b")
    cap_a = store.take("a", 14)
    gc.collect()
    assert first() is not None  # "b" still refers to it
    _check_joined(d, cap_a, "a", 14)
    del cap_a
    cap_b = store.take("b", 14)
    _check_joined(d, cap_b, "b", 14)
    del cap_b
    d.step(["c"], [2], [0])  # the store's run of "a" and "b" (which holds its steps) ends at the next step
    assert first() is None  # freed by reference counting with the last step that referred to it


def test_each_step_counts_the_path_it_took():
    """The arena is the native engine's path; a step it could not hold alone (here the keys' first writes, which
    go through put_owned and make the step buffers' keys) takes the general path, and the counters say which,
    step by step. A store without host rows (an engine without the native kernels) takes the general path always."""
    store = _store()
    d = Driver(store, seed=11)
    d.step(["a", "b"], [3, 2], [0, 0])  # every key's first write: put_owned, no arena rows yet
    assert store.counters["capture_steps_general"] == 1 and store.counters["capture_steps_arena"] == 0
    for t in range(4):
        d.step(["a", "b"], [1, 1], [3 + t, 2 + t])
    assert store.counters["capture_steps_arena"] == 4 and d.arena_steps > 0
    d.step(["a", "b"], [1, 1], [7, 6], skip=("kv", 1))  # refused: no path took it
    assert store.counters["steps_missing_capture"] == 1
    assert (store.counters["capture_steps_arena"], store.counters["capture_steps_general"]) == (4, 1)
    assert store.counters["capture_steps_host_rows"] == 0

    plain = _store()
    plain.host_rows = False
    d = Driver(plain, seed=12)
    for t in range(3):
        d.step(["a"], [2 if t == 0 else 1], [0 if t == 0 else 1 + t])
    assert plain.counters["capture_steps_general"] == 3 and plain.counters["capture_steps_arena"] == 0


def test_the_arena_reports_the_memory_it_holds_outside_the_budget(monkeypatch):
    """host_arena_bytes: the current chunk and the kernels' scratch; a chunk the requests' steps still hold is
    theirs (the budget's), and once the last of them goes its arrays are the pool's, counted again."""
    monkeypatch.setattr(host_arena, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(host_arena, "MIN_ROWS", 4)
    store = _store()
    assert store.stats()["host_arena_bytes"] == 0
    d = Driver(store, seed=21)
    d.step(["a"], [2], [0])
    d.step(["a"], [1], [2])
    chunk = store.arena.chunk
    first = sum(a.nbytes for arrs in chunk.arrays.values() for a in arrs)
    before = store.stats()["host_arena_bytes"]
    assert before > first > 0  # the chunk and the scratch (of both row counts: every later step has 1 row)
    t = 0
    while store.arena.chunk is chunk:  # until a step no longer fits the first chunk
        d.step(["a"], [1], [3 + t])
        t += 1
    second = store.arena.chunk
    held = store.stats()["host_arena_bytes"]
    # the first chunk is held by request a's steps, not the arena: the second in its place, the same scratch
    assert held - sum(a.nbytes for arrs in second.arrays.values() for a in arrs) == before - first
    del chunk
    store.finish("a")
    cap = store.take("a", 3 + t)
    del cap
    d.step(["b"], [1], [0])  # the store's run of a's steps ends at the next step: the first chunk is freed
    gc.collect()
    assert store.arena.chunk is second and len(store.arena._pool) == 1
    assert store.stats()["host_arena_bytes"] - held == first


def test_a_step_whose_forward_skipped_a_key_is_refused_by_name():
    store = _store()
    d = Driver(store, seed=7)
    d.step(["a", "b"], [3, 2], [0, 0])
    d.step(["a", "b"], [1, 1], [3, 2])
    d.step(["a", "b"], [1, 1], [4, 3], skip=("kv", 1))  # layer 1's KV write bypassed the capture
    assert store.counters["steps_missing_capture"] == 1
    for r in ("a", "b"):
        err = store.live[r].error
        assert err is not None and "1.k" in err and "did not write" in err
    # a later complete step is an arena step again
    before = d.arena_steps
    d.step(["a", "b"], [1, 1], [5, 4])
    assert d.arena_steps == before + 2 or store._run is not None


def decode_take(seed):
    """Two requests' StepChunks on a host-arena store: their decode steps after a shared prefill (each
    request's first step left out), the rows an engine take of requests that ran together reads."""
    store = _store()
    d = Driver(store, seed=seed)
    d.step(["a", "b"], [3, 2], [0, 0])
    for t in range(4):
        d.step(["a", "b"], [1, 1], [3 + t, 2 + t])
    subs = []
    for r in ("a", "b"):
        store.finish(r)
        ch = store.peek(r).record_chunks()
        first = ch.ranges[0][1] - ch.ranges[0][0]
        subs.append(StepChunks(ch.steps[1:], ch.ranges[1:], ch.rows() - first))
    return subs

