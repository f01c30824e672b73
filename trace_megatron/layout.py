"""Where each sample's tokens sit in the micro-batch that the model sees.

Megatron's GPTModel takes `input_ids` [B, S] and works on hidden states [S, B, H]; MoE layers and the
router flatten them to [S * B, H] (s-major: flat position p = s * B + b). With packed sequences (THD)
B = 1 and the samples follow each other along S, at offsets `cu_seqlens` (padded offsets if the packer
pads each sample). A `TokenLayout` maps every flat position to (sample, token in sample), or to -1 for
padding, so each layer can find its rows in the samples' guidance records.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLayout:
    sample: torch.Tensor  # int64 [S * B]: index of the sample (record) at each flat position, -1 = padding
    token: torch.Tensor  # int64 [S * B]: index of the token within its sample, -1 = padding
    seq_len: int
    batch_size: int
    # A context-parallel shard holds part of each sample: the samples' whole lengths (their records
    # cover all of them), None for a layout that holds its samples whole.
    whole_lengths: tuple[int, ...] | None = None

    @property
    def num_positions(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def is_shard(self) -> bool:
        return self.whole_lengths is not None

    @property
    def num_samples(self) -> int:
        if self.whole_lengths is not None:
            return len(self.whole_lengths)
        return int(self.sample.max()) + 1 if (self.sample >= 0).any() else 0

    def sample_lengths(self) -> list[int]:
        """Tokens of each sample, the whole sample's even where this layout holds a CP shard of it."""
        if self.whole_lengths is not None:
            return list(self.whole_lengths)
        return [int((self.sample == i).sum()) for i in range(self.num_samples)]

    def positions_of(self, sample: int) -> torch.Tensor:
        """Flat positions of `sample`'s tokens, in token order."""
        pos = torch.nonzero(self.sample == sample).flatten()
        return pos[torch.argsort(self.token[pos])]

    @classmethod
    def padded(cls, lengths, seq_len: int) -> "TokenLayout":
        """`input_ids` [B, seq_len]: sample b holds tokens 0 .. lengths[b] - 1, then right padding."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.dim() != 1 or (lengths < 0).any() or (lengths > seq_len).any():
            raise ValueError(f"lengths {lengths.tolist()} must be between 0 and seq_len={seq_len}")
        B = lengths.numel()
        s = torch.arange(seq_len)[:, None]
        b = torch.arange(B)[None, :]
        valid = s < lengths[None, :]
        sample = torch.where(valid, b, -1).reshape(-1)
        token = torch.where(valid, s.expand(seq_len, B), -1).reshape(-1)
        return cls(sample, token, seq_len, B)

    @classmethod
    def packed(cls, cu_seqlens, lengths=None, total_len: int | None = None) -> "TokenLayout":
        """THD: sample i starts at cu_seqlens[i] (padded offsets when the packer pads); `lengths` are
        the real token counts (default: the distance to the next offset); `total_len` the packed length
        (default cu_seqlens[-1])."""
        cu = torch.as_tensor(cu_seqlens, dtype=torch.int64)
        n = cu.numel() - 1
        lengths = (cu[1:] - cu[:-1]) if lengths is None else torch.as_tensor(lengths, dtype=torch.int64)
        if lengths.numel() != n or (lengths > cu[1:] - cu[:-1]).any() or (lengths < 0).any():
            raise ValueError(f"lengths {lengths.tolist()} do not fit between cu_seqlens {cu.tolist()}")
        T = int(cu[-1]) if total_len is None else total_len
        sample = torch.full((T,), -1, dtype=torch.int64)
        token = torch.full((T,), -1, dtype=torch.int64)
        for i in range(n):
            start, length = int(cu[i]), int(lengths[i])
            sample[start : start + length] = i
            token[start : start + length] = torch.arange(length)
        return cls(sample, token, T, 1)

    def context_parallel_shard(self, cp_size: int, cp_rank: int, cu_seqlens_padded=None) -> "TokenLayout":
        """The positions context-parallel rank `cp_rank` of `cp_size` holds, in Megatron's load-balanced
        (zigzag) order: a sequence is cut into 2 * cp_size equal chunks and rank r keeps chunks r and
        2 * cp_size - 1 - r, in that order. A padded batch [S, B] is cut along S
        (`get_batch_on_this_cp_rank` without cu_seqlens); a packed batch (B = 1) per sample, at
        `cu_seqlens_padded` (each span divisible by 2 * cp_size), the samples' pieces in sample order
        (Transformer Engine's `thd_get_partitioned_indices`, verl's `preprocess_packed_seqs`)."""
        if cp_size == 1:
            return self
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank {cp_rank} outside context_parallel_size {cp_size}")
        if self.is_shard:
            raise ValueError("this layout is already a context-parallel shard")
        whole = tuple(self.sample_lengths())
        if cu_seqlens_padded is None:
            index = cp_chunk_index(self.seq_len, cp_size, cp_rank)
            grid = lambda t: t.view(self.seq_len, self.batch_size)[index].reshape(-1)  # noqa: E731
            return TokenLayout(grid(self.sample), grid(self.token), index.numel(), self.batch_size, whole)
        if self.batch_size != 1:
            raise ValueError(f"a packed layout has batch size 1, this one {self.batch_size}")
        cu = torch.as_tensor(cu_seqlens_padded, dtype=torch.int64).flatten()
        if int(cu[-1]) != self.seq_len:
            raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])}, the packed layout holds {self.seq_len} positions")
        index = torch.cat([int(cu[i]) + cp_chunk_index(int(cu[i + 1] - cu[i]), cp_size, cp_rank)
                           for i in range(cu.numel() - 1)])
        return TokenLayout(self.sample[index], self.token[index], index.numel(), 1, whole)


def cp_chunk_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Positions 0..length-1 that CP rank `cp_rank` holds: chunks r and 2 * cp - 1 - r of 2 * cp."""
    if length % (2 * cp_size):
        raise ValueError(
            f"a sequence of {length} positions cannot be split in {2 * cp_size} equal chunks for "
            f"context_parallel_size={cp_size} (pad it to a multiple of {2 * cp_size})"
        )
    chunk = length // (2 * cp_size)
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)])
