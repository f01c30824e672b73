"""Megatron-Core's local-spec sliding-window softmax, on any device and with the caller's mask kept.

`FusedScaleMaskSoftmax.forward_torch_softmax` (megatron-core 0.19.2, the path the local spec's
`DotProductAttention` takes without Transformer Engine) has two problems for gpt-oss's sliding-window
layers:
  1. `get_sliding_window_causal_mask` builds the mask with `device="cuda"`: on a CPU it raises
     ("Torch not compiled with CUDA enabled"), so no sliding-window layer can run there;
  2. when a window is set it REPLACES the mask the caller passed instead of combining with it, so a
     block-diagonal mask of packed samples (trace_megatron's THD path) is dropped and a window
     reaches across sample boundaries.
The replacement is the same function with the window mask built on the scores' device and OR-ed
with the caller's mask (True = masked). Nothing changes for layers without a window.

Supported: megatron-core 0.19.x (checked; anything else raises at install).
"""

import torch

SUPPORTED_MCORE = "0.19."
_installed = False


def sliding_window_mask(sq: int, sk: int, window_size, device) -> torch.Tensor:
    """Megatron's `get_sliding_window_causal_mask` (True = masked) on `device`: query i (of the last sq
    of sk positions) sees keys j with i - window_size[0] <= j <= i + window_size[1]."""
    m = torch.ones(sq, sk, dtype=torch.bool, device=device)
    return ~torch.tril(torch.triu(m, diagonal=sk - sq - window_size[0]), diagonal=sk - sq + window_size[1])


def install_sliding_window_softmax() -> None:
    global _installed
    if _installed:
        return
    import megatron.core
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer.enums import AttnMaskType

    if not megatron.core.__version__.startswith(SUPPORTED_MCORE):
        raise RuntimeError(
            f"trace_fp4: the sliding-window softmax patch supports megatron-core {SUPPORTED_MCORE}x, found "
            f"{megatron.core.__version__}; update patches/megatron_sliding_window.py"
        )
    cls = fused_softmax.FusedScaleMaskSoftmax
    if not hasattr(cls, "forward_torch_softmax"):
        raise RuntimeError("trace_fp4: megatron-core's FusedScaleMaskSoftmax has no forward_torch_softmax()")

    def forward_torch_softmax(self, input, mask, softmax_offset=None):
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.size(2), input.size(3)
        if self.window_size is not None:
            window = sliding_window_mask(sq, sk, self.window_size, input.device)
            mask = window if mask is None else (mask.to(torch.bool) | window)
        elif self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            assert sq == sk, "causal mask is only for self attention"
            mask = torch.triu(torch.ones(sq, sq, device=input.device), diagonal=1).bool()
        mask_output = self.mask_func(input, mask) if mask is not None else input
        if softmax_offset is None:
            probs = torch.softmax(mask_output, dim=-1)
        else:
            probs = fused_softmax.SoftmaxOne(-1, softmax_offset.to(input.device))(mask_output)
        if self.input_in_float16 and self.softmax_in_fp32:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    cls.forward_torch_softmax = forward_torch_softmax
    _installed = True
