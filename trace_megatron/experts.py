"""TraceSequentialMLP: Megatron's SequentialMLP with the routing probability applied after linear_fc2.

Megatron-Core multiplies the routing probability into the expert activation before linear_fc2; the
rollout engines apply it after the down projection. The captured fc2 input is the unscaled activation
act(gate) * up, so that is what must be quantized here: each expert runs without `per_token_scale` and
its output (plus bias) is scaled afterwards — the same function, since fc2 is linear:
fc2(p * a) + p * b = p * (fc2(a) + b).

Before each expert runs, its linear_fc1 / linear_fc2 are handed the guide rows of its input rows
(`SiteInput`), decoded from the payload that `TraceMoELayer` carried through the token dispatcher, for
all the layer's experts at once (expert_rows.py).

gpt-oss's clamped SwiGLU (Megatron: quick_gelu + activation_func_clamp_value + glu_linear_offset=1) runs
as `trace_kernels.routed_experts.swigluoai`, the one definition the engines use: such experts run
fc1 -> + bias -> swigluoai(gate, up) -> fc2 here (`_engine_expert_fc1`, then linear_fc2) instead of Megatron's MLP.forward
(whose GLU computes the same function from three config knobs). Expert biases are Megatron's own
parameters (add_bias_linear), added after each GEMM like the engines' fp32 epilogue adds them:
before the activation (fc1) and before the routing probability (fc2).

Every gated expert runs the engine's steps (`trace_kernels.routed_experts`, steps 2-5) rather than
Megatron's MLP.forward, whose GLU rounds silu(gate) and the product to BF16 separately: fc1 (the
engine's exact FP4 GEMM, fp32, see linears.py) -> + bias in fp32 -> gate/up rounded to the model dtype
-> the activation in fp32 -> cast to the model dtype -> fc2 (exact, fp32) -> + bias -> times the
routing probability in fp32. The expert outputs stay fp32 through the unpermute's sum over slots and
are cast to the model dtype once (`TraceMoELayer.postprocess`), as the engine sums its slots in fp32.
Where the trainer holds the rollout's codes, its routed-expert output is then the engine's bit for bit
(the routing probabilities aside: they come from each side's own router).
"""

import torch
import torch.nn.functional as F
from megatron.core.activations import quick_gelu
from megatron.core.transformer.moe.experts import SequentialMLP
from trace_kernels import TraceConfig
from trace_kernels.routed_experts import SWIGLUOAI_LIMIT, gated_activation

from .expert_rows import LayerExpertRows
from .site_quant import SiteInput


class TraceSequentialMLP(SequentialMLP):
    def __init__(self, *args, trace_config: TraceConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.moe_apply_probs_on_input:
            raise ValueError(
                "trace_megatron: moe_apply_probs_on_input scales expert inputs by the routing probability; "
                "the rollout engines do not, so the captured codes could not agree. Turn it off."
            )
        if self.config.fp8 or self.config.fp4:
            raise ValueError("trace_megatron: Megatron's own fp8/fp4 recipes cannot be combined with the trace spec")
        self.trace_config = trace_config or TraceConfig()
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        # Global ids of the local experts (TraceMoELayer sets them from its own list).
        self.local_expert_indices = [ep_rank * self.num_local_experts + i for i in range(self.num_local_experts)]
        self.pending_rows = None  # (batch, recompute, layer, PayloadSpec, payload rows), set by TraceMoELayer
        self.activation_name = _expert_activation(self.config)

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        pending, self.pending_rows = self.pending_rows, None
        counts = tokens_per_expert.tolist() if torch.is_tensor(tokens_per_expert) else list(tokens_per_expert)
        tokens_list = torch.split(permuted_local_hidden_states, counts)
        probs_list = torch.split(permuted_probs, counts)
        layer_rows = None
        if pending is not None:  # every expert's sites from the layer's payload rows at once (expert_rows.py)
            tp = self.tp_group if (self.tp_group is not None and self.tp_group.size() > 1) else None  # expert TP
            layer_rows = LayerExpertRows(pending, counts, self.local_expert_indices, tp, self.trace_config, _columns)
            all_sites = layer_rows.sites
            layer_rows.predecode(0, tokens_list)
        else:
            all_sites = [self._plain_sites() for _ in counts]
        # Every expert's fc1 and activation first, then every fc2: the fc2 inputs then all exist, so their
        # sparse rows decode in one call too (each expert computes exactly what it did in turn).
        acts = []
        for expert, tokens, sites in zip(self.local_experts, tokens_list, all_sites):
            # Always set (None = plain RTN): a stale site from an interrupted forward must never be reused.
            expert.linear_fc1.pending_site, expert.linear_fc2.pending_site = sites
            acts.append(_engine_expert_fc1(expert, tokens, self.activation_name))
        if layer_rows is not None:
            layer_rows.flush(0)
            layer_rows.predecode(1, acts)
        outputs = []
        for expert, act, probs in zip(self.local_experts, acts, probs_list):
            output, bias = expert.linear_fc2(act)
            if bias is not None:
                output = output + bias.to(torch.float32)
            outputs.append(output.to(torch.float32) * probs.unsqueeze(-1).to(torch.float32))
        if layer_rows is not None:
            layer_rows.flush(1)
        return torch.cat(outputs, dim=0), None

    def _plain_sites(self):
        """No guidance batch: plain round-to-nearest, but the layer and site still decide the amax."""
        layer = getattr(self, "trace_layer", None)
        if layer is None:
            return None, None
        return SiteInput(batch=None, layer=layer, site="moe_fc1_in"), SiteInput(batch=None, layer=layer, site="moe_fc2_in")


def _expert_activation(config) -> str:
    """The `trace_kernels.routed_experts` activation name of Megatron's expert config: "silu" / "gelu"
    GLUs, or "swigluoai" for gpt-oss experts (a quick_gelu GLU, offset 1, clamp 7). The engines run
    gated experts only, so anything else is refused."""
    if not config.gated_linear_unit:
        raise ValueError("trace_megatron: routed experts must be gated (gated_linear_unit=True), as in the engines")
    plain = config.glu_linear_offset == 0.0 and config.activation_func_clamp_value is None
    if config.activation_func is F.silu and plain:
        return "silu"
    if config.activation_func is F.gelu and plain:
        return "gelu"
    if not (config.activation_func is quick_gelu and config.glu_linear_offset == 1.0):
        raise ValueError(
            f"trace_megatron: expert activation {getattr(config.activation_func, '__name__', config.activation_func)!r} "
            f"(glu_linear_offset {config.glu_linear_offset}, clamp {config.activation_func_clamp_value}) has no "
            "engine counterpart (silu / gelu GLUs, gpt-oss's swigluoai)"
        )
    if config.activation_func_clamp_value != SWIGLUOAI_LIMIT or config.bias_activation_fusion:
        raise ValueError(
            "trace_megatron: a quick_gelu GLU with offset 1 is gpt-oss's swigluoai, which needs "
            f"activation_func_clamp_value={SWIGLUOAI_LIMIT} and bias_activation_fusion=False "
            f"(got {config.activation_func_clamp_value}, {config.bias_activation_fusion})"
        )
    gated_activation("swigluoai")
    return "swigluoai"


def _engine_expert_fc1(expert, tokens, activation: str):
    """One expert's fc2 input, in the engine's order and precisions: fc1 (+ bias, fp32), gate/up rounded
    to the model dtype, `trace_kernels`' activation in fp32 on the [gate; up] halves (the converter's row
    order), cast to the model dtype. Then `expert.linear_fc2` gives (output, fc2 bias or None), without the
    routing probability."""
    h, b1 = expert.linear_fc1(tokens)
    if b1 is not None:
        h = h.to(torch.float32) + b1.to(torch.float32)
    gate, up = torch.chunk(h.to(tokens.dtype).to(torch.float32), 2, dim=-1)
    return gated_activation(activation)(gate, up).to(tokens.dtype)


def _columns(g, rank: int, size: int):
    """The `rank`-th of `size` equal column shards of guide rows [n, K] (K split in whole 16-blocks)."""
    if g.whole_rows:
        raise NotImplementedError(f"trace_megatron: {g.encoding} guidance rows cannot be split over expert-TP ranks "
                                  "(their syndromes cover whole rows); use full or compact guidance with expert TP")
    return g.column_shard(rank, size)
