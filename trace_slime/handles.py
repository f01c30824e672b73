"""How a sample's record handle rides from the rollout to the model call of its micro-batch.

slime forwards a fixed list of per-sample keys from the rollout manager to its Megatron actors
(`RolloutManager._split_train_data_by_dp`). One of them is `multimodal_train_inputs`: a dict per sample
whose tensors slime's `get_batch` concatenates over the micro-batch and passes to the model call as
keyword arguments (`model(**forward_kwargs)`). The handle goes there, under HANDLE_KEY, as its ASCII
bytes plus a 0 terminator (a uint8 tensor: slime moves tensors to the device and concatenates them;
strings it would not). So the handles arrive in the very call that runs their samples, in the
micro-batch's sample order, whatever slime's DP split and dynamic batching did; the trace_slime hook
takes the keyword out before the model sees it (hooks.py). No slime code is changed for it.

A sample without a record (aborted request) carries an empty handle (a lone 0).
"""

import torch

HANDLE_KEY = "trace_fp4_handle"


def encode(handle: str | None) -> torch.Tensor:
    data = (handle or "").encode("ascii")
    if b"\0" in data:
        raise ValueError(f"a record handle cannot hold a NUL byte: {handle!r}")
    return torch.tensor(list(data) + [0], dtype=torch.uint8)


def decode(encoded: torch.Tensor) -> list[str | None]:
    """The handles of a micro-batch (its samples' encodings concatenated), None where a sample has none."""
    flat = encoded.detach().reshape(-1).to("cpu", torch.uint8)
    if flat.numel() == 0 or int(flat[-1]) != 0:
        raise ValueError(f"{HANDLE_KEY}: not a concatenation of 0-terminated handles")
    ends = (flat == 0).nonzero().flatten().tolist()
    out, start = [], 0
    for end in ends:
        text = bytes(flat[start:end].tolist()).decode("ascii")
        out.append(text or None)
        start = end + 1
    return out


def set_handle(sample, handle: str | None) -> None:
    """Put `handle` on a slime Sample (replacing the one of an earlier generate of the same sample)."""
    inputs = dict(sample.multimodal_train_inputs or {})
    inputs[HANDLE_KEY] = encode(handle)
    sample.multimodal_train_inputs = inputs


def handle_of(sample) -> str | None:
    enc = (sample.multimodal_train_inputs or {}).get(HANDLE_KEY)
    if enc is None:
        return None
    (handle,) = decode(enc)
    return handle
