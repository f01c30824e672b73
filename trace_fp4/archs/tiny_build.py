"""Writing a tiny random checkpoint of any registered family with transformers' own classes.

The family module gives a transformers config and model class; this file does the rest the way
`trace_fp4.tiny_model` does for Qwen3-MoE: seeded weights, bf16 safetensors under the classic tensor
names, the shared offline tokenizer, a generation_config.json, and a stamp so that a directory already
holding the same checkpoint is reused and a stale one rebuilt. Built in a private temporary directory
and renamed into place, so concurrent builders never see half a checkpoint.
"""

import json
import warnings
from pathlib import Path

import torch

from ..tiny_model import _param_hash, _write_tokenizer, build_atomically


def build_checkpoint(out_dir, *, family: str, config_class, model_class, params: dict, seed: int,
                     initializer_range: float, after_init=None) -> Path:
    """Write (or reuse) `out_dir`: `config_class(**params)` with random weights from `model_class`.

    `initializer_range` is the std of transformers' normal init: the tiny models use ~1/sqrt(hidden)
    instead of 0.02 so that logits and routing scores have a real spread. `after_init(model, gen)` may
    set what transformers initialises to constants (e.g. routing correction biases, zero at init)."""
    stamp_value = _param_hash({**params, "family": family, "seed": seed, "init": initializer_range, "format": 1})

    def write(tmp: Path) -> None:
        eos_id = _write_tokenizer(tmp, params["vocab_size"])
        config = config_class(
            **params, initializer_range=initializer_range, eos_token_id=eos_id, pad_token_id=eos_id,
            bos_token_id=None, tie_word_embeddings=False,
        )
        torch.manual_seed(seed)  # transformers' init draws from the global generator
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_class(config)
            if after_init is not None:
                with torch.no_grad():
                    after_init(model, torch.Generator().manual_seed(seed + 1))
            model.to(torch.bfloat16).save_pretrained(tmp)
        (tmp / "generation_config.json").write_text(
            json.dumps({"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}, indent=2)
        )

    return build_atomically(out_dir, stamp_value, write)
