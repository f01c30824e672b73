"""`trace-fp4 align --trainer-parallel`'s recompute (trace_fp4/trainer_layout.py) without an engine:
records come from the single-rank trainer's capture with every value moved by up to 0.2% first (a
second engine's arithmetic), so round-to-nearest misses codes and guidance has work to do. Each layout runs
as gloo processes on the converted checkpoint; it must land on every record code and give the
single-rank trainer's log-probabilities as closely as Megatron's BF16 model does across the same
layouts."""

import pytest
import torch

pytest.importorskip("megatron.core")

LAYOUTS = ({"tp": 1, "ep": 1, "cp": 2, "pp": 1}, {"tp": 2, "ep": 2, "cp": 1, "pp": 1}, {"tp": 1, "ep": 1, "cp": 1, "pp": 2})


def _other_engine(x):
    """A second engine's arithmetic: each value off by up to 0.2% (a different summation order or
    kernel), deterministic."""
    # a function of each value alone: a token row sent to two experts must round the same way in both
    # kept in fp32: cast back to BF16, a 0.2% move would mostly round away
    return x.float() * (1 + 2e-3 * torch.cos(1e4 * x.float()))


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    import trace_megatron
    from trace_fp4 import megatron_cpu
    from trace_fp4.hf_checkpoint import read_config
    from trace_fp4.recompute import MODE_CONFIGS, Trainer
    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    tmp = tmp_path_factory.mktemp("layout")
    model_dir = build_tiny_qwen3_moe(tmp / "model", seed=0)
    hf = read_config(model_dir)
    trainer = Trainer(model_dir, hf)
    engine = trainer.build("fp4_rtn")
    g = torch.Generator().manual_seed(1)
    samples, paths = [], []
    for i, (n_prompt, n_gen) in enumerate(((5, 9), (7, 6))):  # 13 and 12 model tokens: CP=2 pads the first
        ids = torch.randint(1, hf.vocab_size, (n_prompt + n_gen,), generator=g).tolist()
        sample = {"prompt_token_ids": ids[:n_prompt], "output_token_ids": ids[n_prompt:]}
        tokens = torch.tensor(ids[:-1])
        T = tokens.numel()
        layout = trace_megatron.TokenLayout.padded([T], T)
        with torch.no_grad(), trace_megatron.capture(engine, layout, perturb=_other_engine) as cap:
            engine(tokens[None], torch.arange(T)[None], megatron_cpu.causal_mask(T))
        record = cap.build_records(MODE_CONFIGS["trace_full"], token_ids=[tokens])[0]
        paths.append(tmp / f"{i}.safetensors")
        record.save(paths[-1])
        samples.append(sample)
    import trace_kernels as tk

    records = [tk.GuidanceRecord.load(p) for p in paths]
    single = {"bf16": trainer.run("bf16", samples, None).logprobs,
              "trace_full": trainer.run("trace_full", samples, records).logprobs}
    return model_dir, samples, paths, single


@pytest.mark.parametrize("parallel", LAYOUTS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items() if v != 1))
def test_a_trainer_layout_lands_on_every_record_code(rollout, parallel):
    from trace_fp4 import trainer_layout

    model_dir, samples, paths, single = rollout
    res = trainer_layout.run(model_dir, parallel, {"bf16": samples, "trace_full": samples}, paths, single)
    full = res["trace_full"]
    assert full["guided_elements"] > 0
    assert full["mismatch_rtn_counter_rate"] > 0  # the records are not the layout's own RTN codes
    for row in full["per_layer"]:
        for site in ("moe_fc1_in", "moe_fc2_in", "k", "v"):
            assert row[site] == 0, (row["layer"], site)
    assert full["fallback_rows_by_reason"]["fallback_route_mismatch"] == 0
    agree = res["logprob_vs_single_rank"]
    print(f"\n{parallel}: |dlogp| vs single rank, mean / max: BF16 {agree['bf16']['logprob_abs_diff_mean']:.3e} / "
          f"{agree['bf16']['logprob_abs_diff_max']:.3e}, trace_full {agree['trace_full']['logprob_abs_diff_mean']:.3e} / "
          f"{agree['trace_full']['logprob_abs_diff_max']:.3e}")
    assert agree["trace_full"]["num_tokens"] == sum(len(s["output_token_ids"]) for s in samples)
    # same codes everywhere: what is left is BF16 summation order, as in Megatron's own BF16 model
    assert agree["trace_full"]["logprob_abs_diff_mean"] <= 4 * agree["bf16"]["logprob_abs_diff_mean"] + 1e-3
