"""The bits a sparse guide sends, per site and segment size: fixed per site, recorded in each payload's
header, so the decoder never guesses them.
"""

from dataclasses import dataclass

from ...errors import SparseError
from ...format import BLOCK_SIZE

SEGMENT = 64  # elements per syndrome segment (rows split into segments of 64, or of 32 / 16 if K needs it)


@dataclass(frozen=True)
class Rates:
    """Bits the rollout sends per row (amax) and per segment (scales, codes)."""

    amax_bits: int  # coset bits of the row amax (0: the trainer's own amax, or one static amax sent once)
    scale_bits: int  # m_s per segment (= its number of blocks: every LSB)
    code_bits: int  # m_c per segment (<= 62)
    # check-only: the trainer's values are meant to be the rollout's exactly (moe_fc2_in, whose input the
    # trainer computes with the engine's own GEMM from the rollout's fc1 codes), so the syndromes are a
    # checksum: no flips are searched, and a segment whose syndrome disagrees is counted as unresolved
    # (the trainer keeps its own rounding there), never "corrected" into a guess.
    check: bool = False
    # 4over6 (TraceConfig.block_scale): one bit per block, sent as it is, saying which candidate scale the
    # rollout's block took (4 or 6), so the trainer recomputes that candidate's scale (decoder.py).
    choice: bool = False

    def __post_init__(self):
        if not (0 <= self.amax_bits <= 8 and 0 <= self.scale_bits <= 4 and 0 <= self.code_bits <= 62):
            raise SparseError(f"sparse rates out of range: {self}")


# Per site and segment size: measured on the align pipeline (bench/sparse_noise.py DIR, every earlier site
# guided) on the engine with the packed grouped GEMM, embedded tiny and trained tiny models. bf16 row
# amax keys, rollout minus trainer, lie in -4..+4 ulps (2 coset bits would miss the rows beyond -2..+1
# and give them a wrong amax), so every site sends 3 coset bits and the decoder list-decodes the neighbouring coset members (AMAX_LIST) for the
# few beyond. 2.3-2.8% of block scales and 1.3-2.0% of codes flip at fc1 / k / v, 0.6-0.7% of codes at
# fc2. Code rates: the lowest that removed all (or all but one segment's) offline RTN mismatches on both
# models. fc1 at 14 bits (the BCH rows without the parity row) changed nothing on the two tiny models
# but took an 8-layer top-4/16 model from 97.7% to 66.6% removed (wrong fc1 codes compound through the
# layers): keep 16 (docs/measurements.md).
# moe_fc2_in is check-only: since the trainer runs the engine's own expert GEMM and
# activation (trace_megatron/linears.py, experts.py), its fc2 inputs are the rollout's bit for bit
# wherever its fc1 codes are (measured: 0 of 2792 / 2904 rows moved, amax, scales or codes, on both
# models, where a BF16 GEMM would flip 2.3% of scales and 0.7% of codes). So fc2 sends no amax and no scale bits, and 4 check bits
# per segment that catch a row the trainer did not reproduce (15 in 16 of them) and count it.
SITE_RATES = {
    ("moe_fc1_in", 64): Rates(3, 3, 16), ("moe_fc1_in", 32): Rates(3, 2, 11),
    ("moe_fc2_in", 64): Rates(0, 0, 4, check=True), ("moe_fc2_in", 32): Rates(0, 0, 4, check=True),
    ("k", 64): Rates(3, 3, 16), ("k", 32): Rates(3, 1, 11),
    ("v", 64): Rates(3, 3, 16), ("v", 32): Rates(3, 1, 11),
}
# MLA's latent row (kv_latent: the normalised kv_c the cache holds) is K-like: K's rates.
SITE_RATES.update({("kv_latent", seg): r for (site, seg), r in list(SITE_RATES.items()) if site == "k"})
DEFAULT_RATES = {64: Rates(3, 4, 14), 32: Rates(3, 2, 10), 16: Rates(3, 1, 6)}


def segment(K: int) -> int:
    for seg in (SEGMENT, 32, 16):
        if K % seg == 0:
            return seg
    raise ValueError(f"K={K} is not a multiple of {BLOCK_SIZE}")


def rates_for(site: str | None, K: int) -> Rates:
    seg = segment(K)
    r = SITE_RATES.get((site, seg), DEFAULT_RATES[seg])
    return Rates(r.amax_bits, min(r.scale_bits, seg // BLOCK_SIZE), r.code_bits, r.check)


def with_choice(rates: Rates, block_scale: str) -> Rates:
    """`rates` with the 4over6 choice bits on exactly when `block_scale` is "4over6"."""
    return Rates(rates.amax_bits, rates.scale_bits, rates.code_bits, rates.check, block_scale == "4over6")



def layer_rates(config, layer: int, site: str, K: int) -> Rates:
    """The rates `config` gives `site` of `layer` (rows of K): its `sparse_rates` entry where the rate
    controller set one, else the built-in per-site rates. A check-only site stays check-only (its
    trainer values are the rollout's by construction: there is nothing to search)."""
    base = with_choice(rates_for(site, K), getattr(config, "block_scale", "6"))
    entry = (getattr(config, "sparse_rates", None) or {}).get(f"{layer}.{site}")
    if entry is None:
        return base
    bps = segment(K) // BLOCK_SIZE
    if entry[1] > bps:
        raise SparseError(f"sparse_rates[{layer}.{site}] = {entry}: {entry[1]} scale bits exceed the {bps} blocks "
                          f"of a segment of {segment(K)}")
    return Rates(entry[0], entry[1], entry[2], base.check, base.choice)
