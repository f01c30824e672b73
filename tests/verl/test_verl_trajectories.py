"""The rollout server's trajectory index (trace_verl/trajectories.py) with a real file store: each
turn of a trajectory lands under the first turn's handle, stitched; other samples stay apart."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels import stores
from trace_verl.trajectories import TrajectoryRecords

from trajectory_factory import trajectory, turn_record, turn_request

FULL = tk.TraceConfig(guidance="full", guided_layers="all")


@pytest.fixture
def store(tmp_path):
    return stores.open_store(f"file:{tmp_path / 'records'}")


def _turn_records(seed):
    turns, rows = trajectory(seed)
    return turns, [turn_record(rows, t, len(t) - 1, FULL) for t in turns], rows


def test_turns_land_under_the_first_handle_stitched(store):
    index = TrajectoryRecords(store)
    turns, records, rows = _turn_records(0)
    other_turns, other_records, _ = _turn_records(1)
    handles, other = [], []
    for k in range(3):  # two trajectories interleaved, as concurrent agent loops send them
        prompt, gen = turn_request(turns, k)
        handles.append(index.put_turn(prompt, gen, records[k]))
        prompt, gen = turn_request(other_turns, k)
        other.append(index.put_turn(prompt, gen, other_records[k]))
    assert len(set(handles)) == 1 and len(set(other)) == 1 and handles[0] != other[0]
    whole = turn_record(rows, turns[-1], len(turns[-1]) - 1, FULL)
    got = stores.get(handles[0], consume=False)
    assert got.to_bytes() == whole.to_bytes()
    tk.check_identity(got, source="trajectory", token_ids=turns[-1])
    assert index.stats == {"trajectories": 2, "turns_stitched": 4, "trajectories_evicted": 0}
    assert store.stats()["outstanding"] == 2  # the replaced turn records are gone


def test_a_turn_that_disagrees_with_its_trajectory_is_refused(store):
    index = TrajectoryRecords(store)
    turns, records, rows = _turn_records(0)
    prompt, gen = turn_request(turns, 0)
    index.put_turn(prompt, gen, records[0])
    q = rows[(1, "moe_fc1_in")]
    codes = q.codes.clone()
    codes[3] ^= 0x01
    bad = {**rows, (1, "moe_fc1_in"): tk.NVFP4Tensor(codes, q.scales, q.global_amax)}
    prompt, gen = turn_request(turns, 1)
    with pytest.raises(tk.RecordError, match=r"turn 1 onto turns 0-0: turn 1 disagrees with turn 0 at token 3 .*layer 1, site moe_fc1_in"):
        index.put_turn(prompt, gen, turn_record(bad, turns[1], len(turns[1]) - 1, FULL))


def test_evicted_trajectory_starts_anew(store):
    index = TrajectoryRecords(store, max_trajectories=1)
    turns, records, _ = _turn_records(0)
    other_turns, other_records, _ = _turn_records(1)
    first = index.put_turn(*turn_request(turns, 0), records[0])
    index.put_turn(*turn_request(other_turns, 0), other_records[0])  # evicts the first
    second = index.put_turn(*turn_request(turns, 1), records[1])
    assert second != first and index.stats["trajectories_evicted"] >= 1
    # the first turn's handle (what verl keeps) still holds one turn: the trainer's check refuses it
    with pytest.raises(tk.RecordError, match="length differs"):
        tk.check_identity(stores.get(first, consume=False), source="sample", token_ids=turns[1])


def test_a_partial_rollouts_continuation_is_stitched_with_its_versions(store):
    """verl's fully async client resumes an aborted request with prompt + its tokens so far under the new
    weights: the continuation lands under the aborted part's handle, each token's own rows kept, the
    record saying which version made which rows."""
    index = TrajectoryRecords(store)
    turns, rows = trajectory(0)
    _, new_rows = trajectory(1)  # the new weights recompute the aborted part differently
    aborted = turn_record(rows, turns[0], len(turns[0]) - 1, FULL, weights_version=0)
    resumed = turn_record(new_rows, turns[1], len(turns[1]) - 1, FULL, weights_version=1)
    first = index.put_turn(*turn_request(turns, 0), aborted)
    handle = index.put_turn(*turn_request(turns, 1), resumed)
    got = stores.get(handle, consume=False)
    assert handle == first and got.identity.version_ranges == ((0, 0), (aborted.num_tokens, 1))
    assert got.identity.weights_version == 1
    A = aborted.num_tokens
    assert torch.equal(got.site(0, "k").fields()[0][:A], aborted.site(0, "k").fields()[0])
    assert torch.equal(got.site(0, "k").fields()[0][A:], resumed.site(0, "k").fields()[0][A:])
