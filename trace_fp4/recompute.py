"""The align job's trainer stage: Megatron-Core recomputes the rollout tokens' log-probabilities.

Four modes, each its own model built from the same converted weights:
  bf16           Megatron's local spec, BF16, no FP4 anywhere (the yardstick)
  fp4_rtn        the trace spec with no guidance: FP4 weights, inputs and K/V by round-to-nearest
                 (plain FP4 QAT), routes replayed from the rollout
  trace_full     the trace spec guided by the full record at every layer
  trace_compact  the trace spec guided by compact records (mantissa bit + scales) at every layer
  trace_sparse   the trace spec guided by sparse records (syndromes; trace_kernels.guides.sparse) at
                 every layer, decoded in every forward from the trainer's own values
  trace_default  the paper's compact default: compact guidance for the deeper half of the layers only
For the FP4 modes the forward runs under `trace_megatron.capture(..., keep_values=True)`, so every
site's codes and unquantized inputs can be compared with the rollout's full record.
"""

import dataclasses
import warnings
from dataclasses import dataclass, field

import torch

# Megatron-Core announces at import that Transformer Engine / Apex / absl are absent; on this path
# that is expected (local spec, torch norms), so keep the align output readable.
warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl).*")

import trace_kernels as tk
import trace_megatron

from . import hf_to_megatron as h2m
from . import megatron_cpu
from .hf_checkpoint import HFMoeConfig, load_tensors
from .audit_sampling import AuditStrata
from .logprob_gap import token_logprobs
from .trainer_parallel_spec import TRAINER_DIMS, parse_trainer_parallel  # noqa: F401  (re-exported)

FALLBACK_REASONS = ("fallback_no_record", "fallback_not_guided", "fallback_route_mismatch")
SPARSE_COUNTERS = ("sparse_segments", "sparse_unresolved_code_segments", "sparse_unresolved_scale_segments",
                   "sparse_code_flips", "sparse_amax_list_rows", "audit_rows", "audit_values", "audit_mismatch",
                   "audit_mismatch_rtn", "audit_skipped_rows")
MODE_CONFIGS = {
    "fp4_rtn": tk.TraceConfig(guided_layers="none"),
    "trace_full": tk.TraceConfig(guidance="full", guided_layers="all"),
    "trace_compact": tk.TraceConfig(guidance="compact", guided_layers="all"),
    "trace_sparse": tk.TraceConfig(guidance="sparse", guided_layers="all"),
    "trace_default": tk.PAPER_CONFIG,
}


@dataclass
class SiteCounts:
    elements: int = 0
    mismatched: int = 0  # trainer codeword != rollout codeword (+0 == -0)
    adjacent: int = 0  # rollout codeword is a grid neighbour of the trainer's value
    mismatched_adjacent: int = 0
    rtn_mismatched: int = 0  # what the trainer's own round-to-nearest would have mismatched
    # quantization error against the unquantized (BF16) values: sum of squares of (own RTN - x) under the
    # run's block scale and under the default "6" rule on the same values, and of x itself
    sq_err: float = 0.0
    sq_err_default: float = 0.0
    sq_norm: float = 0.0
    rows: int = 0  # rows of K values (the rows each carry their own amax)
    amax_mismatched_rows: int = 0  # rows whose amax is not the rollout's (every value of the row is off)
    amax_row_mismatched: int = 0  # mismatched values in those rows

    def add(self, other: "SiteCounts") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ModeOutcome:
    logprobs: list[torch.Tensor]  # per sample: the trainer's log-probabilities of the generated tokens
    sites: dict[tuple[int, str], SiteCounts] = field(default_factory=dict)
    fallback_rows: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # the rest of batch.metrics()'s counts
    sparse: dict[str, float] = field(default_factory=dict)  # sparse decode counters, all sites
    sparse_by_site: dict[str, dict[str, float]] = field(default_factory=dict)
    rates: dict[str, list[int]] = field(default_factory=dict)  # the sparse rates the records were encoded with
    # with `row_groups`: the same counts over each group's rows only (e.g. a turn's generated tokens)
    group_sites: dict[int, SiteCounts] = field(default_factory=dict)
    # sparse modes: per record, layer and site, the true mismatches of every token row and the rows the
    # record's audit drew (what align needs for the audit's real sampling error: audit_sampling.py)
    audit_strata: AuditStrata = field(default_factory=AuditStrata)


def mode_config(mode: str, block_scale: str = "6") -> tk.TraceConfig:
    """MODE_CONFIGS[mode] with the run's block scale (TraceConfig.block_scale)."""
    config = MODE_CONFIGS[mode]
    return config if block_scale == config.block_scale else dataclasses.replace(config, block_scale=block_scale)


def _sq_err(x: torch.Tensor, block_scale: str) -> tuple[float, tk.NVFP4Tensor]:
    q = tk.quantize(x, tk.row_amax(x), block_scale=block_scale)
    return float(((tk.dequantize(q, block_scale=block_scale) - x.float()) ** 2).sum()), q


def _compare(x: torch.Tensor, q: tk.NVFP4Tensor, rollout: tk.NVFP4Tensor, block_scale: str = "6") -> SiteCounts:
    ours, theirs = tk.codewords(q), tk.codewords(rollout)
    adjacent = tk.adjacent(x, rollout, block_scale=block_scale)
    sq_err, own_q = _sq_err(x, block_scale)
    sq_err_default = sq_err if block_scale == "6" else _sq_err(x, "6")[0]
    own = tk.codewords(own_q)
    mismatched = ours != theirs
    rows = mismatched.numel() // max(mismatched.shape[-1], 1)
    per_row = q.global_amax.numel() == rows and rollout.global_amax.numel() == rows and rows > 1
    bad = (q.global_amax.reshape(-1) != rollout.global_amax.reshape(-1)) if per_row else None
    return SiteCounts(
        rows=rows, amax_mismatched_rows=int(bad.sum()) if per_row else 0,
        amax_row_mismatched=int(mismatched.reshape(rows, -1)[bad].sum()) if per_row else 0,
        sq_err=sq_err, sq_err_default=sq_err_default, sq_norm=float((x.float() ** 2).sum()),
        elements=mismatched.numel(),
        mismatched=int(mismatched.sum()),
        adjacent=int(adjacent.sum()),
        mismatched_adjacent=int((mismatched & adjacent).sum()),
        rtn_mismatched=int((own != theirs).sum()),
    )


def _counter_keys(key: str, name: str):
    """Which align counters a `batch.metrics()` entry feeds: (name, summed over samples?)."""
    if key.startswith("trace/all/") and name == "saturated_values":
        yield f"saturated_values.{key.split('/')[2]}", True
    elif key.startswith("trace/all/") and name == "expert_gemm_bf16":
        yield f"expert_gemm_bf16.{key.split('/')[2]}", True
    elif key.startswith("trace/layer") and key.endswith("/routing/fallback_rows"):
        yield "routing_fallback_rows", True
    elif key.startswith("trace/spec/"):
        yield f"spec.{name}", False


class Trainer:
    """Megatron-Core on this machine (CPU mode when there is no CUDA), holding the converted weights."""

    def __init__(self, model_dir, hf: HFMoeConfig, block_scale: str = "6"):
        # single-rank; --trainer-parallel layouts run as gloo processes in trainer_layout.py
        if not torch.cuda.is_available():
            megatron_cpu.install()
        megatron_cpu.init_parallel()
        self.hf = hf
        self.block_scale = block_scale
        self.state = h2m.convert_state_dict(load_tensors(model_dir), hf, dtype=torch.bfloat16)

    def build(self, mode: str):
        config = h2m.transformer_config(self.hf, params_dtype=torch.bfloat16, bf16=True)
        if mode == "bf16":
            spec = h2m.local_block_spec(self.hf, config)
        else:
            spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(
                config, normalization="RMSNorm", trace_config=self.mode_config(mode)
            )
        model = h2m.build_gpt_model(self.hf, spec, config)
        h2m.load_into(model, self.state)
        return model.eval()

    def mode_config(self, mode: str) -> tk.TraceConfig:
        return mode_config(mode, self.block_scale)

    def _count_groups(self, outcome, groups, batch, full, layer, site):
        values, ours, theirs = batch.captured_values(layer, site), batch.captured(layer, site), full.site(layer, site)
        for g in sorted(set(groups.tolist()) - {-1}):
            sel = groups == g
            outcome.group_sites.setdefault(g, SiteCounts()).add(
                _compare(values[sel], ours[sel], theirs[sel], self.block_scale))

    @torch.no_grad()
    def run(self, mode: str, samples: list[dict], records: list[tk.GuidanceRecord] | None,
            config: tk.TraceConfig | None = None, row_groups: list[torch.Tensor] | None = None) -> ModeOutcome:
        """Recompute every sample (batch of one: no padding to account for) under `mode`; `config`: the
        records' encoding config when it is not the mode's own (e.g. sparse with calibrated rates).
        `row_groups[i]`: int [T] group of each of sample i's rows (-1: none), counted in `group_sites`."""
        model = self.build(mode)
        outcome = ModeOutcome(logprobs=[])
        for i, sample in enumerate(samples):
            prompt, gen = sample["prompt_token_ids"], sample["output_token_ids"]
            tokens = torch.tensor(prompt + gen[:-1])  # the last sampled token never enters the model
            T = tokens.numel()
            args = (tokens[None], torch.arange(T)[None], megatron_cpu.causal_mask(T))
            if mode == "bf16":
                logits = model(*args)
            else:
                full = records[i]
                # The record must be this sample's (token digest, length) before it guides anything.
                tk.check_identity(full, source=f"record of sample {i}", token_ids=tokens)
                layout = trace_megatron.TokenLayout.padded([T], T)
                encoded = full.reencode(config or self.mode_config(mode))
                if i == 0 and "sparse" in encoded.modes:
                    outcome.rates = encoded.rates()
                with trace_megatron.capture(model, layout, records=[encoded], keep_values=True) as batch:
                    logits = model(*args)
                shape = full.shape
                for layer in range(shape.num_layers):
                    for site in shape.layer_sites(layer):
                        counts = _compare(
                            batch.captured_values(layer, site), batch.captured(layer, site), full.site(layer, site),
                            self.block_scale,
                        )
                        outcome.sites.setdefault((layer, site), SiteCounts()).add(counts)
                        audit = encoded.audit(layer, site)
                        if audit is not None:
                            ours, theirs = batch.captured(layer, site), full.site(layer, site)
                            wrong = (tk.codewords(ours) != tk.codewords(theirs)).reshape(T, -1)
                            outcome.audit_strata.add(wrong.sum(-1), audit[0], wrong.shape[1],
                                                     (config or MODE_CONFIGS[mode]).sparse_audit)
                        if row_groups is not None:
                            self._count_groups(outcome, row_groups[i], batch, full, layer, site)
                for key, value in batch.metrics().items():
                    name = key.split("/")[-1]
                    if key.startswith("trace/all/") and name in FALLBACK_REASONS:
                        outcome.fallback_rows[name] = outcome.fallback_rows.get(name, 0.0) + value
                    for counter, total in _counter_keys(key, name):
                        if total:
                            outcome.counters[counter] = outcome.counters.get(counter, 0.0) + value
                        else:  # process-wide counts (spec substitutions): the latest value, not a sum
                            outcome.counters[counter] = value
                    if key.startswith("trace/layer") and name in SPARSE_COUNTERS:
                        site_key = "/".join(key.split("/")[1:3])  # layer<L>/<site>
                        per = outcome.sparse_by_site.setdefault(site_key, {})
                        per[name] = per.get(name, 0.0) + value
                        outcome.sparse[name] = outcome.sparse.get(name, 0.0) + value
            outcome.logprobs.append(token_logprobs(logits[0, len(prompt) - 1 :], torch.tensor(gen)))
        return outcome
