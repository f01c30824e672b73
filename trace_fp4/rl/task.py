"""The toy verifiable task: reverse a string of digits.

Prompt `d1 d2 ... dL >`, answer `dL ... d1` then end-of-sequence; reward 1 for an exact match of the
generated token ids (answer + EOS, nothing after), else 0. Digits are single tokens in the tiny
model's byte-level BPE (its training text holds no digits, so no merges), so the task is a pure
token-level copy-in-reverse that attention can learn, and exact match needs every position right.

Prompts come from a seeded generator; the held-out evaluation strings are drawn first from a fixed
seed and never appear among training prompts or SFT examples.
"""

import random
from dataclasses import dataclass
from pathlib import Path

DIGITS = "0123456789"
SEPARATOR = ">"
EVAL_SEED = 20261201


@dataclass(frozen=True)
class ReverseDigits:
    length: int
    digit_ids: tuple[int, ...]  # token id of "0" .. "9"
    sep_id: int
    eos_id: int
    num_eval: int = 128

    @classmethod
    def from_tokenizer(cls, model_dir, length: int = 4, num_eval: int = 128) -> "ReverseDigits":
        from tokenizers import Tokenizer

        from ..tiny_model import EOS_TOKEN

        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        ids = tuple(tok.token_to_id(d) for d in DIGITS)
        sep, eos = tok.token_to_id(SEPARATOR), tok.token_to_id(EOS_TOKEN)
        if None in ids or sep is None or eos is None:
            raise ValueError(f"{model_dir}: the tokenizer has no single token for every digit, {SEPARATOR!r} and EOS")
        return cls(length, ids, sep, eos, num_eval)

    def describe(self) -> dict:
        return {"name": "reverse_digits", "length": self.length, "num_eval": self.num_eval,
                "reward": "exact match of the generated token ids with reversed digits + EOS",
                "prompt": f"{self.length} digits then {SEPARATOR!r}", "eval_seed": EVAL_SEED}

    # ---- strings ----------------------------------------------------------------------------
    def eval_strings(self) -> list[str]:
        rng = random.Random(EVAL_SEED)
        out: list[str] = []
        seen = set()
        while len(out) < self.num_eval:
            s = "".join(rng.choice(DIGITS) for _ in range(self.length))
            if s not in seen:
                seen.add(s)
                out.append(s)
        return out

    def train_strings(self, count: int, seed: int) -> list[str]:
        """`count` strings from `seed`, none of them held out (repeats allowed across calls)."""
        held_out = set(self.eval_strings())
        rng = random.Random(seed)
        out = []
        while len(out) < count:
            s = "".join(rng.choice(DIGITS) for _ in range(self.length))
            if s not in held_out:
                out.append(s)
        return out

    # ---- tokens -----------------------------------------------------------------------------
    def prompt_ids(self, s: str) -> list[int]:
        return [self.digit_ids[int(c)] for c in s] + [self.sep_id]

    def answer_ids(self, s: str) -> list[int]:
        return [self.digit_ids[int(c)] for c in reversed(s)] + [self.eos_id]

    def max_new_tokens(self) -> int:
        return self.length + 2  # room to fail by running on (no reward without EOS in place)

    def reward(self, s: str, generated: list[int]) -> float:
        return 1.0 if list(generated) == self.answer_ids(s) else 0.0
