"""Where each sample's record rows sit in the packed (THD) micro-batch verl's forward builds.

verl's `gptmodel_forward_model_engine` packs the micro-batch's nested `input_ids` back to back, each
sample padded for TP / CP / FP8 alignment, and hands the model `packed_seq_params` whose
`cu_seqlens_q_padded` are those padded offsets. A sample's record covers its first `num_tokens` tokens
(prompt + generated, without the last sampled token); everything else (alignment padding, the last
token, samples whose record is missing) maps to no record and runs round-to-nearest, counted.
"""

import torch
from trace_megatron import TokenLayout


def packed_layout(packed_seq_params, record_tokens: list[int | None], total_len: int) -> TokenLayout:
    """`record_tokens[i]`: rows of sample i's record, None where it has none. Layout sample ids number
    only the samples with a record, in order (the order of the records handed to guidance)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    if cu is None:
        cu = packed_seq_params.cu_seqlens_q
    cu = cu.to("cpu", torch.int64)
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
