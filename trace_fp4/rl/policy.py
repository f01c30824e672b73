"""The trainer's policy: a real Megatron-Core GPTModel, BF16 compute, fp32 master weights.

`spec` picks the decoder: "bf16" (Megatron's local spec) or a `trace_kernels.TraceConfig` (the trace
spec: FP4 routed-expert weights by RTN with straight-through gradients, expert inputs and K/V guided
by the records' codewords where the config guides a layer, RTN elsewhere; routes replayed from the
records). `trainable` says which parameters learn: "experts" (the routed experts, all the rollout
engine can reload in this vLLM build) or "all" (the supervised initialisation).

Mixed precision as Megatron's optimizer does it: the model holds BF16 parameters; Adam updates an
fp32 master copy, which is rounded back into the model after each step (small updates would vanish
in BF16 parameters).
"""

import warnings

import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|absl).*")

import trace_kernels as tk  # noqa: E402
import trace_megatron  # noqa: E402

from .. import hf_to_megatron as h2m  # noqa: E402
from .. import megatron_cpu  # noqa: E402
from ..hf_checkpoint import load_tensors, read_config  # noqa: E402
from . import export  # noqa: E402

EXPERT_KEY = ".mlp.experts.local_experts."


class Policy:
    def __init__(self, model_dir, spec, *, trainable: str = "experts", lr: float = 1e-3, betas=(0.9, 0.99),
                 weight_decay: float = 0.0, grad_clip: float = 1.0):
        if not torch.cuda.is_available():
            megatron_cpu.install()
        megatron_cpu.init_parallel()
        self.hf = read_config(model_dir)
        self.trace_config = None if spec == "bf16" else spec
        config = h2m.transformer_config(self.hf, params_dtype=torch.bfloat16, bf16=True)
        if self.trace_config is None:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        else:
            layer_spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(
                config, normalization="RMSNorm", trace_config=self.trace_config)
        self.model = h2m.build_gpt_model(self.hf, layer_spec, config)
        h2m.load_into(self.model, h2m.convert_state_dict(load_tensors(model_dir), self.hf, dtype=torch.bfloat16))
        if trainable not in ("experts", "all"):
            raise ValueError(f"trainable must be 'experts' or 'all', got {trainable!r}")
        self.params = {}
        for name, p in self.model.named_parameters():
            learn = trainable == "all" or EXPERT_KEY in name
            p.requires_grad_(learn)
            if learn:
                self.params[name] = p
        if not self.params:
            raise ValueError("no trainable parameters")
        self.master = {n: p.detach().float().clone().requires_grad_(True) for n, p in self.params.items()}
        self.opt = torch.optim.AdamW(list(self.master.values()), lr=lr, betas=betas, weight_decay=weight_decay)
        self.grad_clip = grad_clip
        self.model.train()

    # ---- forward ----------------------------------------------------------------------------
    @staticmethod
    def batch_inputs(samples: list[dict]):
        """Right-padded input_ids [B, S] of prompt + generated[:-1] (the last token never enters the
        model), the sample lengths, and the position where each sample's predictions start."""
        seqs = [s["prompt_token_ids"] + s["output_token_ids"][:-1] for s in samples]
        lengths = [len(x) for x in seqs]
        S = max(lengths)
        ids = torch.zeros(len(seqs), S, dtype=torch.int64)
        for b, x in enumerate(seqs):
            ids[b, : len(x)] = torch.tensor(x)
        return ids, lengths, S

    def forward(self, samples: list[dict], records=None, *, capture: bool = False):
        """Log-probabilities of each sample's generated tokens (list of [G_b] tensors, with grad), and
        the TraceBatch (None for the bf16 spec). `records`: one GuidanceRecord per sample, already in
        this spec's TraceConfig. `capture`: keep codes and inputs of every site for mismatch analysis."""
        ids, lengths, S = self.batch_inputs(samples)
        B = len(samples)
        args = (ids, torch.arange(S)[None].expand(B, S), megatron_cpu.causal_mask(S))
        batch = None
        if self.trace_config is None:
            logits = self.model(*args)
        else:
            if records is None:
                raise ValueError("the trace spec needs the rollout's records (routing replay; guidance per config)")
            layout = trace_megatron.TokenLayout.padded(lengths, S)
            ctx = (trace_megatron.capture(self.model, layout, records=records, keep_values=True) if capture
                   else trace_megatron.guidance(self.model, records, layout))
            with ctx as batch:
                logits = self.model(*args)
        logp = torch.log_softmax(logits.float(), dim=-1)
        out = []
        for b, s in enumerate(samples):
            P, gen = len(s["prompt_token_ids"]), torch.tensor(s["output_token_ids"])
            out.append(logp[b, P - 1 : P - 1 + gen.numel()].gather(-1, gen[:, None])[:, 0])
        return out, batch

    # ---- update -----------------------------------------------------------------------------
    def step(self, loss: torch.Tensor) -> float:
        """Backward, clip, Adam on the fp32 master copy, round back into the BF16 model. Returns the
        gradient norm before clipping."""
        for p in self.params.values():
            p.grad = None
        loss.backward()
        for n, p in self.params.items():
            g = p.grad
            self.master[n].grad = torch.zeros_like(self.master[n]) if g is None else g.float()
        norm = torch.nn.utils.clip_grad_norm_(list(self.master.values()), self.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.master[n].to(p.dtype))
                p.grad = None
        return float(norm)

    # ---- export -----------------------------------------------------------------------------
    def expert_state_hf(self) -> dict[str, torch.Tensor]:
        """The routed experts as the engine's checkpoint names them (BF16, what the model computes with)."""
        state = {n: p.detach().clone() for n, p in self.model.named_parameters() if EXPERT_KEY in n}
        return export.experts_to_hf(state)

    def state_hf(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        return export.to_hf(state, self.hf)

    def expert_codes(self) -> dict[int, dict[str, tk.NVFP4Tensor]]:
        """Per layer: NVFP4 RTN of the fused expert weights with one amax per expert, as the trace
        spec's linears quantize them ([E, N, K]; for comparison with the engine's)."""
        out = {}
        for layer in range(self.hf.num_layers):
            w = {}
            for name, key in (("w13", "linear_fc1"), ("w2", "linear_fc2")):
                ws = torch.stack([self.model.state_dict()[
                    f"decoder.layers.{layer}{EXPERT_KEY}{e}.{key}.weight"] for e in range(self.hf.num_experts)])
                amax = torch.cat([tk.tensor_amax(ws[e]) for e in range(ws.shape[0])])
                w[name] = tk.quantize(ws, amax[:, None].expand(ws.shape[:-1]).contiguous())
            out[layer] = w
        return out
