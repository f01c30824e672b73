"""TRACE through slime's own flags, with slime's real code, on this CPU machine.

Rollout (child process, slime_rollout_driver.py): a real SGLang 0.5.23 HTTP server (trace_fp4 from the
checkpoint's quantization_config, records in a file store) and slime's own `generate_and_rm_group`,
which dispatches to `--custom-generate-function-path trace_slime.generate`; then slime's
`_convert_samples_to_train_data`, `_split_train_data_by_dp` (two DP ranks, dynamic batch sizing) and
the actor-side `process_rollout_data`, all on the command line slime's own parser built.
Trainer (this process): slime's `forward_only` (slime.backends.megatron_utils.model, megatron.training
imported through the Python 3.11 shim) on a CPU Megatron-Core model built from `--spec trace_slime
get_trace_spec` with the same weights, `--custom-megatron-before-log-prob-hook-path` loaded by slime.
Not run here: slime's Ray actors and GPU placement, its SGLangEngine launcher and router, and
`train_one_step`'s DDP/optimizer (CUDA); the training forward runs through the train-step hook and
slime's `get_batch` instead (test_training_forward_is_guided_and_backpropagates).
"""

import os
import subprocess
import sys

import pytest
import torch

from slime_helpers import slime_skip_reason

pytestmark = pytest.mark.skipif(slime_skip_reason() is not None, reason=str(slime_skip_reason()))

SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")
FULL_ALL = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sglang_helpers import write_quantization_config

    from trace_fp4.tiny_model import build_tiny_qwen3_moe

    d = build_tiny_qwen3_moe(tmp_path_factory.mktemp("slime_tiny") / "moe")
    write_quantization_config(d, FULL_ALL)
    return d


@pytest.fixture(scope="module")
def store_spec(tmp_path_factory):
    return f"file:{tmp_path_factory.mktemp('trace_slime_store')}"


@pytest.fixture(scope="module")
def rollout(model_dir, store_spec, tmp_path_factory):
    from sglang_helpers import engine_env, sglang_skip_reason
    from slime_helpers import slime_path

    if sglang_skip_reason():
        pytest.skip(sglang_skip_reason())
    work = tmp_path_factory.mktemp("slime_rollout")
    env = engine_env({"TRACE_FP4_RECORD_STORE": store_spec})
    env["PYTHONPATH"] = os.pathsep.join([str(slime_path()), env["PYTHONPATH"]])
    driver = os.path.join(os.path.dirname(__file__), "slime_rollout_driver.py")
    out, log = work / "out.pt", work / "server.log"
    proc = subprocess.run([sys.executable, driver, str(model_dir), str(out), str(log)], env=env,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        raise AssertionError(f"driver failed:\n{proc.stderr[-6000:]}\n--- server log ---\n{tail}")
    return torch.load(out, weights_only=False)


def _handle(mm):
    from trace_slime.handles import HANDLE_KEY, decode

    (h,) = decode(mm[HANDLE_KEY])
    return h


def test_slime_generate_puts_a_handle_on_every_sample(rollout, store_spec, model_dir):
    from transformers import AutoTokenizer

    from trace_kernels import stores, token_digest

    eos_id = AutoTokenizer.from_pretrained(model_dir).eos_token_id

    samples = rollout["samples"]
    handles = [_handle(s["multimodal_train_inputs"]) for s in samples]
    assert len(samples) == 8 and len(set(handles)) == 8
    assert all(h.startswith(f"trace-fp4:{store_spec}#") for h in handles)
    for s, h in zip(samples, handles):
        # Sampled at temperature 1 from a 384-token vocabulary: a response may end on the EOS token before the
        # budget (slime marks it completed); otherwise it runs to max_response_len (truncated).
        assert 1 <= s["response_length"] == len(s["rollout_log_probs"]) <= 8
        if s["response_length"] < 8:
            assert s["status"] == "completed" and s["tokens"][-1] == eos_id, (s["status"], s["tokens"][-1])
        else:
            assert s["status"] in ("truncated", "completed")
        rec = stores.get(h, consume=False, allowed=[store_spec])
        assert rec.num_tokens == len(s["tokens"]) - 1  # the last sampled token never entered the model
        assert rec.identity.token_digest == token_digest(s["tokens"][:-1])
    stats = rollout["rollout_stats"]
    assert stats["records"] == 8 and stats["records_missing"] == 0 and stats["record_bytes"] > 0
    # the evaluation sample was generated, and its record deleted at once (no training step reads it)
    assert rollout["held_out"]["response_length"] > 0 and rollout["held_out"]["multimodal_train_inputs"] is None
    assert stats["records_discarded_eval"] == 1
    assert stores.open_store(store_spec).stats()["outstanding"] == 8
    # What SGLang 0.5.23 returns to slime's request: every meta_info field slime 0.3.1 reads is there.
    for key in ("output_token_logprobs", "finish_reason", "weight_version", "cached_tokens", "prompt_tokens", "trace_fp4"):
        assert key in rollout["raw_meta_info_keys"], key


def test_convert_and_dp_split_keep_each_handle_with_its_sample(rollout, store_spec):
    from trace_kernels import stores, token_digest

    samples = rollout["samples"]
    assert "multimodal_train_inputs" in rollout["train_data_keys"]
    seen = []
    for rank in rollout["ranks"]:
        part = rank["partition"]
        seen += part
        assert len(rank["multimodal_train_inputs"]) == len(part) == len(rank["tokens"])
        for pos, mm, tokens in zip(part, rank["multimodal_train_inputs"], rank["tokens"]):
            h = _handle(mm)
            assert h == _handle(samples[pos]["multimodal_train_inputs"])
            assert tokens.tolist() == samples[pos]["tokens"]
            assert stores.get(h, consume=False, allowed=[store_spec]).identity.token_digest == token_digest(tokens[:-1])
    assert sorted(seen) == list(range(len(samples)))
    # the split is not the identity: samples really moved between ranks
    assert rollout["ranks"][0]["partition"] != list(range(len(rollout["ranks"][0]["partition"])))


# ---- trainer ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer(rollout, model_dir, store_spec):
    import megatron_cpu as mc
    from slime_helpers import cpu_pipeline_schedules, put_slime_on_path, use_cpu_accelerator

    put_slime_on_path()
    mc.install_cpu_shim()
    mc.init_parallel()
    use_cpu_accelerator()
    cpu_pipeline_schedules()
    env = pytest.MonkeyPatch()
    env.setenv("TRACE_FP4_RECORD_STORE", store_spec)  # what slime's actors get from Ray's runtime env
    from trace_fp4 import hf_to_megatron as h2m
    from trace_fp4.hf_checkpoint import load_tensors, read_config

    import trace_slime

    args = rollout["args"]
    hf = read_config(model_dir)
    state = h2m.convert_state_dict(load_tensors(model_dir), hf, dtype=torch.bfloat16)
    config = h2m.transformer_config(hf, params_dtype=torch.bfloat16, bf16=True)
    spec = trace_slime.get_trace_spec(args, config, None)  # what slime's model provider calls
    model = h2m.build_gpt_model(hf, spec, config)
    h2m.load_into(model, state)
    from megatron.core.transformer.module import Float16Module

    # slime's get_model wraps each chunk so (bf16 weights, fp32 logits out of the last stage); the
    # DDP wrapper around it needs CUDA.
    chunk = Float16Module(config, model)
    yield {"args": args, "model": chunk.eval(), "gpt": model}
    env.undo()


def _rank_data(rank):
    """What slime's actor `_get_rollout_data` does to a rank's data before its iterators (on the CPU)."""
    data = dict(rank)
    data["tokens"] = [t.to(torch.long) for t in data["tokens"]]
    data["loss_masks"] = [t.to(torch.int) for t in data["loss_masks"]]
    return data


def _log_probs(trainer, rank):
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.loss import get_log_probs_and_entropy
    from slime.backends.megatron_utils.model import forward_only

    data = _rank_data(rank)
    it = get_data_iterator(data)
    return forward_only(get_log_probs_and_entropy, trainer["args"], [trainer["model"]], it, data["num_microbatches"])


def test_slime_forward_only_is_guided_with_no_codeword_mismatch(rollout, trainer):
    from trace_slime.hooks import guidance_for

    rank = rollout["ranks"][0]
    out = _log_probs(trainer, rank)
    guide = guidance_for(trainer["args"])
    lp = out["log_probs"]
    assert len(lp) == len(rank["partition"])
    gaps = [(a.float() - torch.tensor(b)).abs().mean().item() for a, b in zip(lp, rank["rollout_log_probs"])]
    guide._finish(trainer["args"])
    m = guide.finished["log_probs"]
    print(f"slime forward_only, guided: mean |delta logp| vs rollout {sum(gaps) / len(gaps):.4f}; {m}")
    for site in SITES:
        assert m[f"log_probs/trace_fp4_{site}_mismatch_guided"] == 0.0, site
    for site in ("moe_fc1_in", "k", "v"):
        assert m[f"log_probs/trace_fp4_{site}_mismatch_rtn"] > 0.0, site  # there was something to fix
    assert m["log_probs/trace_fp4_records_missing"] == 0
    assert m["log_probs/trace_fp4_guidance_bytes"] > 0
    assert max(gaps) < 0.5


def test_training_forward_is_guided_and_backpropagates(rollout, trainer, store_spec):
    """The train-step hook, then slime's `get_batch` and the model call slime's training forward_step
    makes (its DDP / optimizer part needs CUDA): guided, 0 mismatch, gradients reach the experts."""
    from slime.backends.megatron_utils.data import get_batch, get_data_iterator

    import trace_slime
    from trace_slime.hooks import guidance_for

    args, model = trainer["args"], trainer["model"]
    trace_slime.before_train_step_hook(args, 0, 0, [model], None, None)
    data = _rank_data(rollout["ranks"][1])
    (it,) = get_data_iterator(data)
    batch = get_batch(it, ["tokens", "multimodal_train_inputs", "total_lengths", "response_lengths", "loss_masks"],
                      args.data_pad_size_multiplier, args.allgather_cp)
    kwargs = {"input_ids": batch["tokens"], "position_ids": None, "attention_mask": None, "labels": None,
              "packed_seq_params": batch["packed_seq_params"], "loss_mask": batch["full_loss_masks"]}
    kwargs.update(batch["multimodal_train_inputs"])
    model.train()
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(**kwargs)
        logits.float().logsumexp(-1).mean().backward()
    model.eval()
    guide = guidance_for(args)
    guide._finish(args)
    m = guide.finished["train"]
    for site in SITES:
        assert m[f"train/trace_fp4_{site}_mismatch_guided"] == 0.0, site
    grads = [p.grad for n, p in trainer["gpt"].named_parameters() if "experts" in n and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_foreign_handle_and_swapped_records_are_refused(rollout, trainer, store_spec):
    from trace_kernels import RecordError, stores

    from megatron.core.packed_seq_params import PackedSeqParams

    from trace_slime.handles import HANDLE_KEY, encode

    model = trainer["model"]
    rank = rollout["ranks"][0]
    h = [_handle(mm) for mm in rank["multimodal_train_inputs"]]
    tokens = [t.to(torch.long) for t in rank["tokens"]]
    other = stores.open_store(f"{store_spec}_other")
    planted = other.put(stores.get(h[0], consume=False, allowed=[store_spec]))
    for handles, error, match in (([planted], RecordError, "not an allowed store"),
                                  ([h[1]], (RecordError, ValueError), "sample 0")):
        t = tokens[0]
        cu = torch.tensor([0, t.numel()], dtype=torch.int32)
        psp = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=t.numel(), max_seqlen_kv=t.numel(),
                              qkv_format="thd")
        kw = {HANDLE_KEY: torch.cat([encode(x) for x in handles])}
        with torch.no_grad(), pytest.raises(error, match=match):
            model(input_ids=t[None], position_ids=None, attention_mask=None, packed_seq_params=psp, **kw)
    assert other.stats()["outstanding"] == 1


def test_records_are_deleted_when_the_rollout_step_ends(rollout, trainer, store_spec):
    """Training steps of the same rollout keep its records; the next rollout's log-prob hook deletes them."""
    from trace_kernels import RecordError, stores

    import trace_slime
    from trace_slime.hooks import guidance_for

    args, model = trainer["args"], trainer["model"]
    used = list(guidance_for(args).records._records)  # what this rank's forwards resolved
    rank0 = [_handle(mm) for mm in rollout["ranks"][0]["multimodal_train_inputs"]]
    assert set(rank0) <= set(used)
    trace_slime.before_train_step_hook(args, 0, 1, [model], None, None)  # rollout 0, step 1
    for h in used:
        stores.get(h, consume=False, allowed=[store_spec])  # still there
    trace_slime.before_log_prob_hook(args, [model], "")  # rollout 1 begins
    for h in used:
        with pytest.raises((RecordError, KeyError, FileNotFoundError)):
            stores.get(h, consume=False, allowed=[store_spec])


def test_the_real_command_line_passes_and_its_refusals_name_the_flag(rollout):
    import copy

    from trace_slime import TraceSlimeError, check_args

    args = rollout["args"]
    assert check_args(args) is not None
    for key, match in (("use_rollout_routing_replay", "--use-rollout-routing-replay"),
                       ("use_routing_replay", "--use-routing-replay")):
        bad = copy.copy(args)
        setattr(bad, key, True)
        with pytest.raises(TraceSlimeError, match=match):
            check_args(bad)
    bad = copy.copy(args)
    bad.spec = None
    with pytest.raises(TraceSlimeError, match="TRACE on the rollout only"):
        check_args(bad)
