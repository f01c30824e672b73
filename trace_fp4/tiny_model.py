"""A tiny Qwen3-MoE checkpoint (random weights, offline tokenizer) for tests, benchmarks and `align`.

`build_tiny_qwen3_moe(out_dir)` writes a Hugging Face checkpoint that vLLM, SGLang, transformers and
Megatron-Core's HF importers load like a real one: `config.json`, `model.safetensors` (bf16, the
classic per-expert Qwen3-MoE tensor names), `tokenizer.json` + `tokenizer_config.json` (a byte-level
BPE trained offline on the text embedded below) and `generation_config.json`.

Everything is deterministic given the arguments: the weights come from a seeded CPU generator and
the tokenizer trainer is deterministic on a fixed corpus. A `.trace_fp4_tiny` stamp holds the hash of
the arguments; a directory that already holds a checkpoint with the same hash is reused as is, and
one with another hash is rebuilt.

Sizes respect the constraints of the paths under test: hidden, moe_intermediate and head_dim are
multiples of 16 (NVFP4 blocks) and head_dim a multiple of 32 (vLLM's CPU attention kernels).
"""

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

STAMP = ".trace_fp4_tiny"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]

# The tokenizer's training text: plain English about the project, enough for ~128 BPE merges.
_CORPUS = """
Reinforcement learning for language models alternates between generating rollouts and training
the policy on them. The rollout engine samples tokens; the trainer recomputes their probabilities.
Mixture of experts models route every token to a few experts, so most parameters stay idle.
Low precision rollouts are cheap, but the trainer and the engine then round numbers differently.
Four bit floating point has only eight magnitudes: zero, one half, one, one and a half, two, three,
four and six, times a block scale. Two values that differ by a tiny amount can land on different
codewords. The engine records which codeword each value became; the trainer follows that choice.
The quick brown fox jumps over the lazy dog. A small model, a short prompt, a few generated words.
Tests run on a central processing unit; benchmarks compare the plain model with the quantized one.
Once upon a time there was a tiny model that learned to count: one two three four five six seven.
"""


def _param_hash(params: dict) -> str:
    blob = json.dumps(params, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.strip().splitlines() if line.strip()]
    tok.train_from_iterator(lines * 4, trainer=trainer)
    return tok


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    tok = _train_tokenizer(vocab_size)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TOKEN,
                "pad_token": EOS_TOKEN,
                "bos_token": None,
                "unk_token": None,
                "model_max_length": 4096,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return tok.token_to_id(EOS_TOKEN)


def _normal(gen: torch.Generator, shape, std: float) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * std).to(torch.bfloat16)


def _attention_weights(gen, p: dict, prefix: str) -> dict[str, torch.Tensor]:
    H, D = p["hidden_size"], p["head_dim"]
    nq, nkv = p["num_attention_heads"], p["num_key_value_heads"]
    w = {
        f"{prefix}.q_proj.weight": _normal(gen, (nq * D, H), 1 / math.sqrt(H)),
        f"{prefix}.k_proj.weight": _normal(gen, (nkv * D, H), 1 / math.sqrt(H)),
        f"{prefix}.v_proj.weight": _normal(gen, (nkv * D, H), 1 / math.sqrt(H)),
        f"{prefix}.o_proj.weight": _normal(gen, (H, nq * D), 1 / math.sqrt(nq * D)),
        # QK norms near 1 with some spread, so K after the norm is not trivially uniform.
        f"{prefix}.q_norm.weight": (1 + _normal(gen, (D,), 0.1).float()).to(torch.bfloat16),
        f"{prefix}.k_norm.weight": (1 + _normal(gen, (D,), 0.1).float()).to(torch.bfloat16),
    }
    return w


def _weights(p: dict, seed: int, moe: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    H, V = p["hidden_size"], p["vocab_size"]
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal(gen, (V, H), 1.0)}
    for i in range(p["num_hidden_layers"]):
        pre = f"model.layers.{i}"
        w[f"{pre}.input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        w[f"{pre}.post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        w.update(_attention_weights(gen, p, f"{pre}.self_attn"))
        if moe:
            I, E = p["moe_intermediate_size"], p["num_experts"]
            w[f"{pre}.mlp.gate.weight"] = _normal(gen, (E, H), 1 / math.sqrt(H))
            for e in range(E):
                ep = f"{pre}.mlp.experts.{e}"
                w[f"{ep}.gate_proj.weight"] = _normal(gen, (I, H), 1 / math.sqrt(H))
                w[f"{ep}.up_proj.weight"] = _normal(gen, (I, H), 1 / math.sqrt(H))
                w[f"{ep}.down_proj.weight"] = _normal(gen, (H, I), 1 / math.sqrt(I))
        else:
            I = p["intermediate_size"]
            w[f"{pre}.mlp.gate_proj.weight"] = _normal(gen, (I, H), 1 / math.sqrt(H))
            w[f"{pre}.mlp.up_proj.weight"] = _normal(gen, (I, H), 1 / math.sqrt(H))
            w[f"{pre}.mlp.down_proj.weight"] = _normal(gen, (H, I), 1 / math.sqrt(I))
    w["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    # A peaked output distribution (std 3/sqrt(H) per logit unit) so greedy decoding is meaningful.
    w["lm_head.weight"] = _normal(gen, (V, H), 3 / math.sqrt(H))
    return w


def _is_built(out: Path, stamp_value: str) -> bool:
    stamp = out / STAMP
    return stamp.exists() and stamp.read_text().strip() == stamp_value


def _build(out_dir, params: dict, seed: int, moe: bool) -> Path:
    stamp_value = _param_hash({**params, "seed": seed, "moe": moe, "format": 1})
    return build_atomically(out_dir, stamp_value, lambda tmp: _write_checkpoint(tmp, params, seed, moe))


def build_atomically(out_dir, stamp_value: str, write) -> Path:
    """`write(tmp)` a checkpoint into a private temporary directory, then move it into place:
    concurrent builders (test processes, the align CLI) never see a half-written checkpoint. A
    directory stamped with `stamp_value` is reused as is; one with another stamp is rebuilt. Every
    tiny checkpoint (this module's, trace_fp4/archs' families) is built through here."""
    out = Path(out_dir)
    if _is_built(out, stamp_value):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        (tmp / STAMP).write_text(stamp_value)
        if out.exists() and not _is_built(out, stamp_value):
            shutil.rmtree(out, ignore_errors=True)  # stale (other arguments or an older format)
        try:
            os.rename(tmp, out)
        except OSError:
            if not _is_built(out, stamp_value):  # lost a race to another builder: theirs is fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_checkpoint(out: Path, params: dict, seed: int, moe: bool) -> None:
    from safetensors.torch import save_file

    eos_id = _write_tokenizer(out, params["vocab_size"])
    if moe:
        from transformers import Qwen3MoeConfig as Config

        arch = "Qwen3MoeForCausalLM"
    else:
        from transformers import Qwen3Config as Config

        arch = "Qwen3ForCausalLM"
    cfg_kwargs = {k: v for k, v in params.items() if not (not moe and k in _MOE_KEYS)}
    config = Config(
        **cfg_kwargs,
        architectures=[arch],
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    cfg = config.to_dict()
    if moe:
        # transformers 5 writes `num_local_experts`; tools that read config.json directly expect the
        # classic Qwen3-MoE key too.
        cfg["num_experts"] = params["num_experts"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2)
    )
    save_file(_weights(params, seed, moe), str(out / "model.safetensors"), metadata={"format": "pt"})


_MOE_KEYS = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step")


def build_tiny_qwen3_moe(
    out_dir,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 64,
    moe_intermediate_size: int = 32,
    num_experts: int = 8,
    top_k: int = 2,
    num_attention_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 384,
    max_position_embeddings: int = 2048,
    norm_topk_prob: bool = True,
) -> Path:
    """Write (or reuse) a tiny random Qwen3-MoE checkpoint in `out_dir`; returns its path."""
    params = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
    )
    return _build(out_dir, params, seed, moe=True)


def build_tiny_qwen3_dense(
    out_dir,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_attention_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    vocab_size: int = 384,
) -> Path:
    """A tiny dense Qwen3 (no routed experts): the model that MoE-only paths must refuse."""
    params = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return _build(out_dir, params, seed, moe=False)
