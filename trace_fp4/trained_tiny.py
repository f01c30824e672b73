"""A *trained* tiny Qwen3-MoE: the embedded random model after a short next-token training run.

Random weights give activations no trained model has (flat distributions, large drift under FP4). This
trains the tiny model (same shape, same tokenizer) with AdamW on the text below, which none of the align
prompts are taken from (they come from the tokenizer corpus in tiny_model.py): the align job then runs
on held-out prompts. Deterministic given the arguments (seeded init, seeded batches, CPU, float32), and
cached like the tiny model (a stamp with the hash of the arguments).

    trace-fp4 align --model "$(python -m trace_fp4.trained_tiny /tmp/trained-tiny)"
"""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch

from .tiny_model import build_tiny_qwen3_moe
from .tiny_qwen2_moe import build_tiny_qwen2_moe

BUILDERS = {"qwen3_moe": build_tiny_qwen3_moe, "qwen2_moe": build_tiny_qwen2_moe}

STAMP = ".trace_fp4_trained"

_TRAINING_TEXT = """
A farmer walked to the market every morning with a basket of apples and a jar of honey.
The river ran past the mill, and the mill wheel turned slowly while the miller sang.
Children counted the boats in the harbour: one red boat, two blue boats, three white boats.
The library opened at nine; students read about planets, rivers, numbers and old kings.
When the rain stopped, the garden smelled of wet earth and the birds came back to the trees.
A careful cook measures the flour twice, tastes the soup, and adds a little salt at the end.
The train left the station at noon and crossed the bridge over the valley before dark.
Every winter the village held a festival with music, lanterns, bread and warm spiced cider.
The teacher wrote a long sum on the board and asked who could finish it before the bell.
On the hill stood a lighthouse whose lamp turned all night to guide the ships home safely.
""" * 4


def _param_hash(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def build_trained_tiny_qwen3_moe(out_dir, *, seed: int = 0, steps: int = 300, lr: float = 3e-3,
                                 seq_len: int = 48, batch: int = 16, family: str = "qwen3_moe", **shape) -> Path:
    """Write (or reuse) the trained tiny checkpoint in `out_dir`; returns its path. `shape`: keyword
    arguments of tiny_model.build_tiny_qwen3_moe (num_layers, num_experts, top_k, ...) for a model
    other than the embedded one's shape (a checkpoint the rates were not tuned on). `family`:
    "qwen2_moe" trains tiny_qwen2_moe's Qwen2-MoE with a shared expert instead (its own shape keywords)."""
    if family not in BUILDERS:
        raise ValueError(f"family must be one of {sorted(BUILDERS)}, got {family!r}")
    out = Path(out_dir)
    params = dict(seed=seed, steps=steps, lr=lr, seq_len=seq_len, batch=batch, format=1)
    if shape:  # only then: the embedded shape's stamp stays what it was
        params["shape"] = dict(sorted(shape.items()))
    if family != "qwen3_moe":
        params["family"] = family
    stamp = _param_hash(params)
    if (out / STAMP).exists() and (out / STAMP).read_text().strip() == stamp:
        return out
    base = BUILDERS[family](out.parent / f".{out.name}.base", seed=seed, **shape)
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(base)
    ids = torch.tensor(tok(_TRAINING_TEXT)["input_ids"], dtype=torch.int64)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=g)
        x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    (tmp / ".trace_fp4_tiny").unlink(missing_ok=True)
    # Back to the classic per-expert tensor names of the base checkpoint (what every loader here reads).
    original = load_file(str(base / "model.safetensors"))
    trained = model.state_dict()
    weights = {}
    for name, t in original.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, e, proj = parts[2], int(parts[5]), parts[6]
            fused = f"model.layers.{layer}.mlp.experts."
            if proj == "down_proj":
                new = trained[fused + "down_proj"][e]
            else:
                gate_up = trained[fused + "gate_up_proj"][e]
                half = gate_up.shape[0] // 2
                new = gate_up[:half] if proj == "gate_proj" else gate_up[half:]
        else:
            new = trained[name]
        if tuple(new.shape) != tuple(t.shape):
            raise RuntimeError(f"trained tensor {name}: shape {tuple(new.shape)} vs {tuple(t.shape)}")
        weights[name] = new.detach().to(t.dtype).contiguous()
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "training.json").write_text(json.dumps({**params, "loss_first": losses[0], "loss_last": losses[-1]}))
    (tmp / STAMP).write_text(stamp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    # python -m trace_fp4.trained_tiny DIR [seed=3 num_layers=8 num_experts=16 top_k=4 family=qwen2_moe ...]
    extra = dict(a.split("=", 1) for a in sys.argv[2:])
    print(build_trained_tiny_qwen3_moe(sys.argv[1] if len(sys.argv) > 1 else "/tmp/trace-fp4-trained-tiny",
                                       **{k: (v if k == "family" else int(v)) for k, v in extra.items()}))
