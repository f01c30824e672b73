"""Which guidance batch a trace module uses in this forward, activation recompute included.

A batch is active while its `with` block runs. Activation recompute re-runs a layer's forward later,
inside the backward pass, when that block may have closed (or another micro-batch's block is open).
So every trace module keeps a FIFO: a forward that runs inside Megatron's checkpoint (first pass, no
grad) appends the batch it used; the recompute (same module, inside backward) pops it. Micro-batches
are recomputed in the order they ran forward, which is the order Megatron's own routing replay assumes
(`RouterReplay.replay_backward_list`). Limitation: within one step, either every micro-batch that is
recomputed has guidance or none has (an unguided one leaves no FIFO entry).
"""

from collections import deque

import torch
from megatron.core.tensor_parallel import random as mp_random

_ACTIVE: list = []  # stack of open batches, innermost last


def push_active(batch) -> None:
    _ACTIVE.append(batch)


def pop_active(batch) -> None:
    if not _ACTIVE or _ACTIVE[-1] is not batch:
        raise RuntimeError("trace_megatron: guidance batches must be closed in the order they were opened")
    _ACTIVE.pop()


def active_batch():
    return _ACTIVE[-1] if _ACTIVE else None


def _inside_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class BatchBinding:
    """Per-module record of the batches its checkpointed forwards used, for their recompute."""

    def __init__(self, owner: str):
        self.owner = owner
        self._pending: deque = deque()

    def resolve(self):
        """Return (batch or None, is_recompute)."""
        if mp_random.IS_CHECKPOINTING and _inside_backward():
            # An empty FIFO means the first pass ran without guidance: recompute it the same way.
            return (self._pending.popleft() if self._pending else None), True
        batch = active_batch()
        if batch is not None and mp_random.IS_CHECKPOINTING and not torch.is_grad_enabled():
            self._pending.append(batch)
            batch._bindings_used.append(self)
        return batch, False

    def discard(self, batch) -> int:
        """Drop pending entries of `batch` (a checkpointed forward that will never be recomputed)."""
        before = len(self._pending)
        self._pending = deque(b for b in self._pending if b is not batch)
        return before - len(self._pending)

    def clear(self) -> None:
        self._pending.clear()
