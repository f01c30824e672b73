"""Stitching a multi-turn trajectory's turn records into one record (trace_kernels.records.stitch)."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels.records.stitch import Turn, stitch_turns, turn_row_spans

from record_factory import SHAPE
from trajectory_factory import GEN, OBS, PROMPT, trajectory as _trajectory, turn_record as _record

def _turns(config, seed=0, **identity):
    turns, rows = _trajectory(seed)
    return [Turn(_record(rows, t, len(t) - 1, config, **identity), t) for t in turns], turns, rows


CONFIGS = {
    "full": tk.TraceConfig(guidance="full", guided_layers="all"),
    "compact": tk.TraceConfig(guidance="compact", guided_layers="all"),
    "sparse": tk.TraceConfig(guidance="sparse", guided_layers="all"),
    "paper": tk.PAPER_CONFIG,  # unguided shallow layers: routing only there
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stitched_record_is_the_trajectorys_record(name):
    config = CONFIGS[name]
    turns, ids, rows = _turns(config, weights_version=3)
    stitched = stitch_turns(turns)
    whole = _record(rows, ids[-1], len(ids[-1]) - 1, config, weights_version=3)
    assert stitched.num_tokens == len(ids[-1]) - 1
    if config.guidance != "sparse":
        assert stitched.to_bytes() == whole.to_bytes()  # every tensor and the identity of the whole sequence
    else:
        # A sparse record's audit samples rows by a seed of the record's identity, so the stitched one
        # (the turns' samples) is not the whole record's; every other tensor is, byte for byte.
        assert stitched.identity == whole.identity
        other = lambda r: {n: t for n, t in r.tensors.items() if not n.endswith(".audit")}  # noqa: E731
        assert other(stitched).keys() == other(whole).keys()
        assert all(torch.equal(t, other(whole)[n]) for n, t in other(stitched).items())
    # the trainer's identity check passes for the whole trajectory and refuses the last turn's prompt alone
    tk.check_identity(stitched, source="trajectory", token_ids=ids[-1])
    with pytest.raises(tk.RecordError, match="length differs"):
        tk.check_identity(stitched, source="trajectory", token_ids=ids[-1][: len(ids[1])])


def test_each_turn_fills_the_rows_it_first_computed():
    turns, ids, _ = _turns(CONFIGS["full"])
    spans = turn_row_spans(turns)
    # turn 0: its prompt and generated tokens but its last; turn 1 from that last token (first run in
    # turn 1's prefill), through the observation, to its own last-but-one
    assert spans[0] == (0, PROMPT + GEN[0] - 1)
    assert spans[1] == (PROMPT + GEN[0] - 1, PROMPT + GEN[0] + OBS[0] + GEN[1] - 1)
    assert spans[-1][1] == len(ids[-1]) - 1
    assert sum(b - a for a, b in spans) == len(ids[-1]) - 1


@pytest.mark.parametrize("name", ["full", "compact", "sparse"])
def test_disagreeing_overlap_is_refused_naming_turn_token_and_site(name):
    config = CONFIGS[name]
    turns, ids, rows = _turns(config)
    # turn 2's prefill computed token 9 (turn 0's decode) differently at layer 2's k rows
    bad = {k: v for k, v in rows.items()}
    q = rows[(2, "k")]
    codes = q.codes.clone()
    codes[9] ^= 0x11
    bad[(2, "k")] = tk.NVFP4Tensor(codes, q.scales, q.global_amax)
    t2 = ids[2]
    turns[2] = Turn(_record(bad, t2, len(t2) - 1, config), t2)
    with pytest.raises(tk.RecordError, match=rf"turn 2 disagrees with turn 0 at token 9 \(id {ids[2][9]}\), layer 2, site k"):
        stitch_turns(turns)


def test_disagreeing_routing_is_refused():
    turns, ids, rows = _turns(CONFIGS["compact"])
    bad = dict(rows)
    r = rows[(1, "routing")].clone()
    r[PROMPT + GEN[0]] = (r[PROMPT + GEN[0]] + 1) % SHAPE.num_experts  # an observation token of turn 1
    bad[(1, "routing")] = r
    turns[2] = Turn(_record(bad, ids[2], len(ids[2]) - 1, CONFIGS["compact"]), ids[2])
    with pytest.raises(tk.RecordError, match=rf"turn 2 disagrees with turn 1 at token {PROMPT + GEN[0]} .*layer 1, routing ids"):
        stitch_turns(turns)


def test_prompt_that_is_not_the_trajectory_so_far_is_refused():
    turns, ids, rows = _turns(CONFIGS["full"])
    edited = list(ids[1])
    edited[PROMPT + 1] += 1  # turn 1's prompt rewrote a token turn 0 generated
    turns[1] = Turn(_record(rows, edited, len(edited) - 1, CONFIGS["full"]), edited)
    with pytest.raises(tk.RecordError, match=rf"turn 1's prompt differs from the tokens before it at token {PROMPT + 1}"):
        stitch_turns(turns)


def test_record_of_another_turn_or_trajectory_is_refused():
    turns, ids, _ = _turns(CONFIGS["full"])
    swapped = [turns[0], Turn(turns[2].record, ids[1]), turns[2]]
    with pytest.raises(tk.RecordError, match="turn 1: length differs"):
        stitch_turns(swapped)
    other, other_ids, _ = _turns(CONFIGS["full"], seed=1)
    mixed = [turns[0], Turn(other[1].record, ids[1][: len(other_ids[1])] + ids[1][len(other_ids[1]):])]
    with pytest.raises(tk.RecordError, match="turn 1: tokens differ"):
        stitch_turns(mixed)


def test_turns_under_different_weights_or_configs_are_refused():
    turns, ids, rows = _turns(CONFIGS["full"], weights_version=1)
    later = Turn(_record(rows, ids[1], len(ids[1]) - 1, CONFIGS["full"], weights_version=2), ids[1])
    with pytest.raises(tk.RecordError, match="turn 1.*weights_version 2, turn 0 with 1"):
        stitch_turns([turns[0], later])
    compact = Turn(_record(rows, ids[1], len(ids[1]) - 1, CONFIGS["compact"], weights_version=1), ids[1])
    with pytest.raises(tk.RecordError, match="turn 1.*another TRACE config"):
        stitch_turns([turns[0], compact])


def test_one_turn_is_its_own_record_and_no_turns_is_refused():
    turns, _, _ = _turns(CONFIGS["full"])
    assert stitch_turns(turns[:1]) is turns[0].record
    with pytest.raises(tk.RecordError, match="no turns"):
        stitch_turns([])


def test_a_sparse_trajectory_carries_its_turns_audits_with_the_codes_of_the_rows_they_name():
    config = tk.TraceConfig(guidance="sparse", guided_layers="all", sparse_audit=0.5)
    turns, ids, rows = _turns(config)
    stitched = stitch_turns(turns)
    spans = turn_row_spans(turns)
    audited = 0
    for layer in range(SHAPE.num_layers):
        for site in SHAPE.layer_sites(layer):
            r, codes = stitched.audit(layer, site)
            audited += r.numel()
            # each row comes from the turn that fills it, and its codes are the engine's for that token
            expect = torch.cat([t.record.audit(layer, site)[0] for t in turns])
            owned = torch.cat([e[(e >= a) & (e < b)] for e, (a, b) in
                               zip([t.record.audit(layer, site)[0] for t in turns], spans)])
            assert torch.equal(r, owned) and set(r.tolist()) <= set(expect.tolist())
            assert torch.equal(codes, rows[(layer, site)].codes[r])
    assert audited > 0
    tk.check_identity(stitched, source="trajectory", token_ids=ids[-1])


def _resumed(config, old_version=1, new_version=2):
    """A request aborted after turn 0's tokens and resumed under newer weights: the resumed request's
    rows over the aborted part are recomputed by the new weights (other rows, here another trajectory's)."""
    ids, rows = _trajectory(0)
    _, new_rows = _trajectory(1)
    aborted = Turn(_record(rows, ids[0], len(ids[0]) - 1, config, weights_version=old_version), ids[0])
    resumed = Turn(_record(new_rows, ids[1], len(ids[1]) - 1, config, weights_version=new_version), ids[1])
    return aborted, resumed, ids, rows, new_rows


def test_a_partial_rollout_keeps_each_tokens_own_rows_and_says_which_version_made_them():
    config = CONFIGS["full"]
    aborted, resumed, ids, rows, new_rows = _resumed(config)
    with pytest.raises(tk.RecordError, match="weights_version 2, turn 0 with 1.*weight_updates=True"):
        stitch_turns([aborted, resumed])
    stitched = stitch_turns([aborted, resumed], weight_updates=True)
    A = aborted.record.num_tokens
    assert stitched.identity.version_ranges == ((0, 1), (A, 2))
    assert stitched.identity.weights_version == 2
    assert stitched.identity.row_versions() == [(0, A, 1), (A, stitched.num_tokens, 2)]
    for layer in range(SHAPE.num_layers):
        got = stitched.routed_experts(layer)
        assert torch.equal(got[:A], rows[(layer, "routing")][:A].to(got.dtype))  # the aborted part's own
        assert torch.equal(got[A:], new_rows[(layer, "routing")][A : stitched.num_tokens].to(got.dtype))
        for site in SHAPE.layer_sites(layer):
            codes = stitched.site(layer, site).fields()[0]
            assert torch.equal(codes[:A], rows[(layer, site)].codes[:A])
            assert torch.equal(codes[A:], new_rows[(layer, site)].codes[A : stitched.num_tokens])
    # the version ranges travel in the record's metadata
    again = tk.GuidanceRecord.from_bytes(stitched.to_bytes())
    assert again.identity == stitched.identity
    tk.check_identity(again, source="partial", token_ids=ids[1])


def test_a_partial_rollouts_rows_of_one_version_must_still_agree():
    config = CONFIGS["full"]
    ids, rows = _trajectory(0)
    _, other = _trajectory(1)
    aborted = Turn(_record(rows, ids[0], len(ids[0]) - 1, config, weights_version=1), ids[0])
    # a continuation that says it ran the same weights but recomputed other rows: refused
    resumed = Turn(_record(other, ids[1], len(ids[1]) - 1, config, weights_version=1), ids[1])
    with pytest.raises(tk.RecordError, match="turn 1 disagrees with turn 0 at token 0"):
        stitch_turns([aborted, resumed], weight_updates=True)
    # and one that ran older weights than the aborted part: refused, naming both versions
    older = Turn(_record(rows, ids[1], len(ids[1]) - 1, config, weights_version=0), ids[1])
    with pytest.raises(tk.RecordError, match="weights version 0, older than turn 0's 1"):
        stitch_turns([aborted, older], weight_updates=True)


def test_a_partial_rollout_resumed_twice_merges_its_version_ranges():
    config = CONFIGS["compact"]
    ids, rows = _trajectory(0)
    recs = [Turn(_record(rows, t, len(t) - 1, config, weights_version=v), t) for t, v in zip(ids, (3, 3, 5))]
    once = stitch_turns(recs[:2], weight_updates=True)
    assert once.identity.version_ranges is None and once.identity.weights_version == 3
    twice = stitch_turns([Turn(once, ids[1]), recs[2]], weight_updates=True)
    B = recs[1].record.num_tokens
    assert twice.identity.version_ranges == ((0, 3), (B, 5))
    assert twice.to_bytes() != stitch_turns(recs[:2]).to_bytes()
