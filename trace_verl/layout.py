"""Where each sample's record rows sit in the packed (THD) micro-batch verl's forward builds.

verl's `gptmodel_forward_model_engine` packs the micro-batch's nested `input_ids` back to back, each
sample padded for TP / CP / FP8 alignment, and hands the model `packed_seq_params` whose
`cu_seqlens_q_padded` are those padded offsets. A sample's record covers its first `num_tokens` tokens
(prompt + generated, without the last sampled token); everything else (alignment padding, the last
token, samples whose record is missing) maps to no record and runs round-to-nearest, counted.

Sequence parallelism needs nothing here: the layout is the whole packed sequence of the TP group and
trace_megatron follows Megatron's scatter along it. Context parallelism: each CP rank's model sees
only its shard (per sample, chunks r and 2 * cp - 1 - r of 2 * cp, verl's `preprocess_packed_seqs`),
so the layout is built over the whole packed sequence and cut the same way
(`TokenLayout.context_parallel_shard`).
"""

import torch
from trace_megatron import TokenLayout


def _context_parallel() -> tuple[int, int]:
    """(size, rank) of Megatron's context-parallel group here ((1, 0) when none is set up)."""
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover
        return 1, 0
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def packed_layout(packed_seq_params, record_tokens: list[int | None], total_len: int, cp: tuple[int, int] | None = None) -> TokenLayout:
    """`record_tokens[i]`: rows of sample i's record, None where it has none. Layout sample ids number
    only the samples with a record, in order (the order of the records handed to guidance).
    `total_len`: the positions this rank's model holds; `cp`: (context-parallel size, rank), by
    default Megatron's. Under CP the rank holds `cu_seqlens_q_padded[-1] / cp` positions."""
    cp_size, cp_rank = _context_parallel() if cp is None else cp
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    cu = cu.to("cpu", torch.int64)
    if cp_size > 1:
        full = int(cu[-1])
        if total_len * cp_size != full:
            raise ValueError(
                f"trace_verl: context_parallel_size={cp_size}: this rank holds {total_len} positions, the packed "
                f"micro-batch {full} (expected {full} / {cp_size})"
            )
        layout = packed_layout(packed_seq_params, record_tokens, full, cp=(1, 0))
        return layout.context_parallel_shard(cp_size, cp_rank, cu)
    real = packed_seq_params.cu_seqlens_q.to("cpu", torch.int64)
    if cu.numel() - 1 != len(record_tokens):
        raise ValueError(
            f"trace_verl: the packed micro-batch holds {cu.numel() - 1} samples, {len(record_tokens)} handles came with it"
        )
    sample = torch.full((total_len,), -1, dtype=torch.int64)
    token = torch.full((total_len,), -1, dtype=torch.int64)
    k = 0
    for i, n in enumerate(record_tokens):
        if n is None:
            continue
        length = int(real[i + 1] - real[i])
        if n > length:
            raise ValueError(f"trace_verl: sample {i}: its record covers {n} tokens, the micro-batch holds {length}")
        start = int(cu[i])
        sample[start : start + n] = k
        token[start : start + n] = torch.arange(n)
        k += 1
    return TokenLayout(sample, token, total_len, 1)
