"""One record per multi-turn trajectory, stitched from its turns' records by token position.

In an agent loop every turn is one engine request whose prompt is the whole trajectory so far (the
first prompt, each earlier assistant turn, the tool or observation tokens between them). Each turn's
record covers its own request's tokens, so turn k's rows repeat every row of the turns before it. The
trainer recomputes the whole trajectory in one forward, so it needs one record whose rows are the ones
the engine used for each token:

  - the first turn's prompt: that turn's prefill;
  - a generated token: the decode step that ran it (the record of the turn that generated it, except
    the last token of a turn, which never entered the model during that turn);
  - that last token and the observation tokens after it: the prefill of the next turn, the first
    forward that computed them;
  - a prefix served from the prefix cache: the rows of the capture that computed it (the engine's
    record already holds those; see docs/engines.md);
  - K/V: what attention read, which for the cached prefix is the earlier turn's cache.

Rows are therefore taken from the first turn that covers them and each row is filled once. A later
turn's rows over the same tokens must agree with them bit for bit: if they do not, the two turns ran
different codes for the same token (an engine whose prefill and decode round differently, or records
of different trajectories) and no single record is right for both, so the stitch is refused, naming
the turn, the token and the site. Identity covers the whole stitched token sequence.

Partial rollouts (`weight_updates=True`): a request aborted at a weight update and resumed under the new
weights (verl's fully async partial rollout, slime's abort-and-continue) is two turns whose weights
differ: the resumed request's prompt is the aborted one's prompt and tokens, recomputed by the new
weights. Each token keeps the rows that produced it (the aborted part's, by the rule above), so the
resumed turn's recomputed rows over the aborted part are not compared with them (other weights give
other codes); rows of the same version still must agree. The stitched identity says which version made
which rows (`version_ranges`); its weights version and digest are the newest turn's. Versions must not
go back (a turn older than the one before it is refused, naming both).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import RecordError
from ..identity import _older, check_identity, describe, num_ids, token_digest
from .layout import guide_type, packs_routing, routing_name, tensor_name
from .record import GuidanceRecord
from .routing import pack_routing


@dataclass(frozen=True)
class Turn:
    """One engine request of a trajectory: its record and the tokens it ran (its prompt, which is the
    trajectory so far, followed by the tokens it generated)."""

    record: GuidanceRecord
    token_ids: Sequence[int]


def _ids(token_ids) -> list[int]:
    return [int(t) for t in (token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids)]


def _first_row_differing(a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None = None) -> int | None:
    """The first leading-dimension row where a and b differ (bitwise for floats), None if none;
    `rows` (bool [n]): compare those rows only."""
    n = a.shape[0]
    if n == 0:
        return None
    x = a.reshape(n, -1).contiguous()
    y = b.reshape(n, -1).contiguous()
    if x.dtype.is_floating_point:  # bit patterns: +0 / -0 and NaN payloads count as different codes
        x, y = x.view(torch.uint8), y.view(torch.uint8)
    differs = (x != y).any(dim=1)
    if rows is not None:
        differs &= rows
    bad = differs.nonzero()
    return int(bad[0]) if bad.numel() else None


def _row_versions(record, rows: int) -> list:
    """The weights version of each of the record's first `rows` rows."""
    out = []
    for a, b, v in record.identity.row_versions(record.num_tokens):
        out += [v] * (min(b, rows) - min(a, rows))
    return out


def _version_ranges(row_versions: list) -> tuple | None:
    """((first row, version), ...) of a stitched record; None when one version made every row."""
    ranges = [(r, v) for r, v in enumerate(row_versions) if r == 0 or v != row_versions[r - 1]]
    return tuple(ranges) if len(ranges) > 1 else None


def _field_names(kind) -> tuple[str, ...]:
    if dataclasses.is_dataclass(kind):
        return tuple(f.name for f in dataclasses.fields(kind))
    return ("codes", "scales", "amax")


def _check_turns(turns: list[Turn], source: str, weight_updates: bool) -> list[list[int]]:
    ids = [_ids(t.token_ids) for t in turns]
    first = turns[0].record
    for k, turn in enumerate(turns):
        rec = turn.record
        if not isinstance(rec, GuidanceRecord):
            raise RecordError(f"{source}: turn {k}: expected a GuidanceRecord, got {type(rec).__name__}")
        where = describe(rec, f"{source}: turn {k}")
        if rec.shape != first.shape:
            raise RecordError(f"{where}: made for another model shape than turn 0's record")
        if rec.config != first.config or rec.modes != first.modes:
            raise RecordError(
                f"{where}: made with another TRACE config than turn 0's ({rec.config.to_dict()} vs {first.config.to_dict()})"
            )
        # The record belongs to this turn's tokens (length and digest), as the trainer checks a sample's.
        check_identity(rec, source=f"{source}: turn {k}", token_ids=ids[k])
        if weight_updates and k:
            before = turns[k - 1].record.identity.weights_version
            older = _older(rec.identity.row_versions(rec.num_tokens)[0][2], before)
            if older:
                raise RecordError(
                    f"{where}: made with weights version {rec.identity.row_versions(rec.num_tokens)[0][2]!r}, older than "
                    f"turn {k - 1}'s {before!r}: a resumed request runs under the same or newer weights"
                )
        for field in () if weight_updates else ("weights_version", "weights_digest"):
            mine, theirs = getattr(rec.identity, field), getattr(first.identity, field)
            if mine != theirs:
                raise RecordError(
                    f"{where}: made with {field} {mine!r}, turn 0 with {theirs!r}: a trajectory whose turns ran under "
                    "different weights (a partial rollout resumed after a weight update) is stitched only with "
                    "weight_updates=True, which records each row's version"
                )
        if k == 0:
            continue
        prev = ids[k - 1]
        if len(ids[k]) < len(prev):
            raise RecordError(
                f"{source}: turn {k} runs {len(ids[k])} tokens, fewer than the {len(prev)} of turn {k - 1}: "
                "a turn's prompt must be the whole trajectory before it"
            )
        for pos, (a, b) in enumerate(zip(prev, ids[k])):
            if a != b:
                raise RecordError(
                    f"{source}: turn {k}'s prompt differs from the tokens before it at token {pos} "
                    f"(id {b}, turn {k - 1} has {a}): a turn's prompt must be the whole trajectory before it"
                )
        if rec.num_tokens < turns[k - 1].record.num_tokens:
            raise RecordError(f"{where}: holds {rec.num_tokens} rows, fewer than turn {k - 1}'s {turns[k - 1].record.num_tokens}")
    return ids


def _lead_rows(rows: torch.Tensor, lead: int) -> torch.Tensor:
    """A per-token row mask for a site whose leading dimension is `lead` (fc2 inputs: token x top_k
    flattened or not); the guides keep one leading row per token, so this is the mask itself."""
    if lead == rows.numel():
        return rows
    if lead % max(rows.numel(), 1) == 0:
        return rows.repeat_interleave(lead // rows.numel())
    raise RecordError(f"stitch: a site with {lead} leading rows for {rows.numel()} tokens")


def turn_row_spans(turns: Sequence[Turn]) -> list[tuple[int, int]]:
    """The rows of the stitched record each turn fills: [start, end) per turn (turn 0 from row 0)."""
    spans, start = [], 0
    for t in turns:
        spans.append((start, t.record.num_tokens))
        start = t.record.num_tokens
    return spans


def _stitched_audit(turns: list[Turn], spans, layer: int, site: str) -> torch.Tensor | None:
    """A sparse site's audit over the trajectory: each turn's audited rows among the rows it fills
    (its own span), with their codes. Audits store their rows, so the stitched one needs no re-draw:
    it is the turns' samples, about the same fraction of every span. None when no turn has an audit."""
    from ..guides.sparse.audit import audit_blob

    rows, codes = [], []
    for k, (a, b) in enumerate(spans):
        got = turns[k].record.audit(layer, site)
        if got is None:
            continue
        r, c = got
        keep = (r >= a) & (r < b)
        rows.append(r[keep])
        codes.append(c[keep])
    if not rows:
        return None
    return audit_blob(torch.cat(rows), torch.cat(codes))


def stitch_turns(turns: Sequence[Turn], *, source: str = "trajectory", weight_updates: bool = False) -> GuidanceRecord:
    """One record of the whole trajectory from its turns' records (see the module docstring).

    Raises RecordError naming the turn (and token, layer and site) when a turn's prompt is not the
    trajectory before it, a record is not its turn's, the turns ran under different weights (unless
    `weight_updates`: a partial rollout) or configs, or a turn's rows over earlier tokens disagree
    with the rows of the same weights version that first computed them."""
    turns = list(turns)
    if not turns:
        raise RecordError(f"{source}: no turns to stitch")
    ids = _check_turns(turns, source, weight_updates)
    if len(turns) == 1:
        return turns[0].record
    first, last = turns[0].record, turns[-1].record
    shape, T = first.shape, last.num_tokens
    spans = turn_row_spans(turns)
    owner = [k for k, (a, b) in enumerate(spans) for _ in range(a, b)]
    # Per row, the version that made it; a turn's rows over earlier tokens are compared where its own
    # version is the one that made them (a resumed request recomputed the rest under newer weights).
    versions = [v for k, (a, b) in enumerate(spans) for v in _row_versions(turns[k].record, b)[a:]]
    same = []
    for k, (a, b) in enumerate(spans):
        mine = _row_versions(turns[k].record, a)
        same.append(torch.tensor([x == y for x, y in zip(mine, versions[:a])], dtype=torch.bool))

    def refuse(k, row, what):
        raise RecordError(
            f"{source}: turn {k} disagrees with turn {owner[row]} at token {row} (id {ids[-1][row]}), {what}: "
            "its rows over the tokens before it must be the ones that first computed them (an engine whose "
            "prefill and decode round differently, or a record of another trajectory?)"
        )

    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape.num_layers):
        mode = first.modes[layer]
        if shape.has_moe(layer):
            pieces = []
            for k, (a, b) in enumerate(spans):
                ids_k = turns[k].record.routed_experts(layer)
                if a:
                    row = _first_row_differing(ids_k[:a], torch.cat(pieces), same[k])
                    if row is not None:
                        refuse(k, row, f"layer {layer}, routing ids")
                pieces.append(ids_k[a:b])
            routed = torch.cat(pieces)
            packed = packs_routing(mode)
            tensors[routing_name(layer, packed)] = (
                pack_routing(routed, shape.num_experts) if packed else routed.to(torch.int16)
            )
        kind = guide_type(mode)
        if kind is None:
            continue
        for site in shape.layer_sites(layer):
            pieces = []
            for k, (a, b) in enumerate(spans):
                guide = turns[k].record.site(layer, site)
                if a:
                    so_far = kind.cat(pieces)
                    for name, mine, theirs in zip(_field_names(kind), guide[:a].fields(), so_far.fields()):
                        row = _first_row_differing(mine, theirs, _lead_rows(same[k], mine.shape[0]))
                        if row is not None:
                            refuse(k, row, f"layer {layer}, site {site} ({kind.encoding} {name})")
                pieces.append(guide[a:b])
            for part, t in kind.cat(pieces).record_parts().items():
                tensors[tensor_name(layer, site, part)] = t
            audit = _stitched_audit(turns, spans, layer, site)
            if audit is not None:
                tensors[tensor_name(layer, site, "audit")] = audit
    ident = first.identity
    stitched_identity = type(ident)(
        token_digest=token_digest(ids[-1][:T]), num_tokens=T, weights_version=last.identity.weights_version,
        weights_digest=last.identity.weights_digest, num_prompt_tokens=ident.num_prompt_tokens,
        version_ranges=_version_ranges(versions),
    )
    if num_ids(ids[-1]) not in (T, T + 1):  # checked per turn already; the stitched record must say the same
        raise RecordError(f"{source}: the last turn runs {len(ids[-1])} tokens for {T} rows")
    return GuidanceRecord(shape, first.config, T, first.modes, tensors, stitched_identity)
