import math

import pytest
import torch

from trace_fp4.logprob_gap import gap, token_logprobs


def test_gap_figures():
    rollout = torch.log(torch.tensor([0.5, 0.25, 0.8]))
    train = torch.log(torch.tensor([0.5, 0.5, 0.4]))
    g = gap(train, rollout)
    r = [0.0, math.log(2), math.log(0.5)]
    assert g["logprob_abs_diff_mean"] == pytest.approx(sum(abs(x) for x in r) / 3)
    assert g["k3_kl"] == pytest.approx(sum(math.expm1(x) - x for x in r) / 3)
    assert g["k3_kl"] > 0 and gap(rollout, rollout)["k3_kl"] == 0


def test_token_logprobs_and_errors():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    lp = token_logprobs(logits, torch.tensor([1, 0]))
    assert lp.tolist() == pytest.approx([math.log(0.5), math.log(0.75)])
    with pytest.raises(ValueError, match="log-prob shapes differ"):
        gap(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="no tokens"):
        gap(torch.zeros(0), torch.zeros(0))
