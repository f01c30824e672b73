"""Multi-turn trajectories on the rollout server: one record per trajectory, under one handle.

verl's agent loops (`ToolAgentLoop`) send each turn of a trajectory as its own request (verl's
`LLMServerClient` gives every turn a fresh request id), its prompt being the whole trajectory so far,
and keep only the first turn's `extra_fields`: the first turn's handle is the one that reaches the
trainer. So the server remembers each open trajectory by the digest of its tokens so far (prompt +
generated); a request whose prompt starts with such a trajectory is its next turn. That turn's record
is stitched onto the trajectory's by token position (trace_kernels.records.stitch: overlaps must
agree, each row filled once, identity over the whole sequence) and the stitched record replaces the
trajectory's under the same handle. A prompt that continues no open trajectory starts one. A partial
rollout (verl's fully async client resumes a request aborted at a weight update with prompt + the tokens
so far) is such a continuation: its rows are stitched with `weight_updates=True`, so the record keeps
each token's own rows and says which weights version made them (`version_ranges`).

Only digests are kept (no tokens, no records: those are in the store), at most `max_trajectories`
(oldest out first, counted as `trajectories_evicted`). A later turn of an evicted trajectory starts a
new one, whose handle never reaches the trainer; the trainer then finds the first turn's record too
short for the sample and refuses it (identity check), never guides it wrongly.
"""

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class _Trajectory:
    handle: str
    num_tokens: int  # tokens so far: the last turn's prompt + generated
    turns: int


def _prefix_digests(ids: list[int], lengths) -> dict[int, str]:
    """token_digest(ids[:n]) for every n in `lengths` (n <= len(ids)), in one pass over ids."""
    arr = np.asarray(ids, dtype="<i8")
    h, out, done = hashlib.sha256(), {}, 0
    for n in sorted(n for n in lengths if n <= len(ids)):
        h.update(arr[done:n].tobytes())
        done = n
        out[n] = h.copy().hexdigest()
    return out


class TrajectoryRecords:
    def __init__(self, store, *, max_trajectories: int = 65536):
        self.store = store
        self.max_trajectories = max_trajectories
        self._open: OrderedDict[str, _Trajectory] = OrderedDict()  # by the digest of its tokens so far
        self._lengths: Counter = Counter()  # how many open trajectories have each token count
        self.stats = {"trajectories": 0, "turns_stitched": 0, "trajectories_evicted": 0}

    def _continued(self, prompt_ids: list[int]) -> tuple[str, _Trajectory] | None:
        """The longest open trajectory that `prompt_ids` continues."""
        digests = _prefix_digests(prompt_ids, self._lengths)
        for n in sorted(digests, reverse=True):
            traj = self._open.get(digests[n])
            if traj is not None and traj.num_tokens == n:
                return digests[n], traj
        return None

    def _close(self, key: str) -> None:
        traj = self._open.pop(key)
        self._lengths[traj.num_tokens] -= 1
        if not self._lengths[traj.num_tokens]:
            del self._lengths[traj.num_tokens]

    def _open_as(self, tokens: list[int], traj: _Trajectory) -> None:
        key = _prefix_digests(tokens, [len(tokens)])[len(tokens)]
        if key in self._open:  # the same tokens again (a repeated sample): the newer one continues
            self._close(key)
        self._open[key] = traj
        self._lengths[traj.num_tokens] += 1
        while len(self._open) > self.max_trajectories:
            self._close(next(iter(self._open)))
            self.stats["trajectories_evicted"] += 1

    def put_turn(self, prompt_ids: list[int], token_ids: list[int], record) -> str:
        """Store this turn's record, stitched onto the trajectory it continues if any; its handle."""
        from trace_kernels.records.stitch import Turn, stitch_turns

        prompt_ids, tokens = list(prompt_ids), list(prompt_ids) + list(token_ids)
        found = self._continued(prompt_ids)
        if found is None:
            handle = self.store.put(record)
            self._open_as(tokens, _Trajectory(handle, len(tokens), 1))
            self.stats["trajectories"] += 1
            return handle
        key, traj = found
        so_far = self.store.get(traj.handle, consume=False)
        stitched = stitch_turns(
            [Turn(so_far, prompt_ids[: traj.num_tokens]), Turn(record, tokens)],
            source=f"trajectory {traj.handle}: turn {traj.turns} onto turns 0-{traj.turns - 1}",
            # A turn after a weight update (fully async: a partial rollout's continuation, or an agent's
            # next turn): each token keeps the rows that produced it, the record says which version.
            weight_updates=True,
        )
        self._close(key)
        handle = self.store.replace(traj.handle, stitched)
        self._open_as(tokens, _Trajectory(handle, len(tokens), traj.turns + 1))
        self.stats["turns_stitched"] += 1
        return handle
