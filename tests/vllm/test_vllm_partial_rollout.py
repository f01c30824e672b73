"""Partial rollouts in real vLLM: a request aborted at a weight update and resumed under the new weights
(verl's fully async partial rollout, slime's abort-and-continue) gives one record that says, per
token, which weights version produced it; a trainer holding the new weights, guided by it in full,
keeps the codes of the tokens the new weights made (all within its reach).

One engine (module scope) runs both cases: abort + weight update + resume (stitched with
`stitch_turns(weight_updates=True)`), and a request that keeps running through a weight update (the
engine's own record carries the version ranges)."""

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import trace_kernels as tk
import trace_vllm_plugin as tvp
from trace_kernels.records.stitch import Turn, stitch_turns
from vllm_helpers import FULL_ALL, MODELS_DIR, PROMPTS, greedy, make_llm, shutdown, tiny_moe

MAX_TOKENS = 14
ABORT_AFTER = 5  # generated tokens before the abort
STEP = 0.01  # each expert matrix moves by 1% of its norm per update (see _updated_experts)


def _updated_experts(k: int):
    """A checkpoint of the tiny model whose routed experts took k small deterministic steps: each
    expert matrix W moves by STEP * ||W|| along a fixed random direction (seed k) per step, stored in
    BF16 like the checkpoint. What a trainer step does to the part trace_fp4 quantizes."""
    src = tiny_moe()
    dst = MODELS_DIR / f"moe_expert_steps{k}"
    if not (dst / "model.safetensors").exists():
        shutil.copytree(src, dst, dirs_exist_ok=True)
        weights = load_file(src / "model.safetensors")
        g = torch.Generator().manual_seed(k)
        for name in sorted(weights):
            if ".mlp.experts." not in name:
                continue
            w = weights[name].float()
            for _ in range(k):
                d = torch.randn(w.shape, generator=g)
                w = w + STEP * w.norm() * d / d.norm()
            weights[name] = w.to(weights[name].dtype)
        save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load_weights(worker, path: str) -> int:
    """The RL frameworks' sync: the model's own load_weights with the new expert tensors."""
    tensors = [(k, v) for k, v in load_file(path).items() if ".mlp.experts." in k]
    return len(worker.model_runner.model.load_weights(iter(tensors)))


def _output(request_id, prompt, generated):
    """What `get_records` needs of a RequestOutput (the verl server builds the same)."""
    return SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt),
                           outputs=[SimpleNamespace(token_ids=list(generated), index=0)])


def _step_until(engine, request_id, n):
    """Step the engine until `request_id` has generated at least n tokens; its tokens so far."""
    while True:
        for out in engine.step():
            if out.request_id == request_id and len(out.outputs[0].token_ids) >= n:
                return list(out.outputs[0].token_ids)


@pytest.fixture(scope="module")
def run():
    from vllm.inputs import TokensPrompt

    before = os.environ.get("TRACE_FP4_KEEP_ABORTED")
    os.environ["TRACE_FP4_KEEP_ABORTED"] = "1"  # what verl's TRACE server sets
    llm = make_llm(tiny_moe(), quant_config=FULL_ALL)
    try:
        engine = llm.llm_engine
        prompt = llm.get_tokenizer().encode(PROMPTS[1])
        # 1. abort mid-generation, take the aborted part's record
        engine.add_request("partial", TokensPrompt(prompt_token_ids=prompt), greedy(MAX_TOKENS))
        first = _step_until(engine, "partial", ABORT_AFTER)
        engine.abort_request(["partial"])
        assert not engine.has_unfinished_requests()
        # The worker learns of the abort with the next step it runs (another request's): the aborted
        # rows are kept (TRACE_FP4_KEEP_ABORTED) rather than dropped, to be taken now.
        (other,) = llm.generate([PROMPTS[2]], greedy(1), use_tqdm=False)
        tvp.get_records(llm, [other], store=False)
        (aborted,) = tvp.get_records(llm, [_output("partial", prompt, first)], store=False)
        # 2. the weight update (version 0 -> 1), 3. resume: prompt + the tokens so far, the rest of the budget
        assert llm.collective_rpc(_load_weights, args=(str(_updated_experts(1) / "model.safetensors"),))[0] > 0
        (rest,) = llm.generate([TokensPrompt(prompt_token_ids=prompt + first)], greedy(MAX_TOKENS - len(first)),
                               use_tqdm=False)
        (resumed,) = tvp.get_records(llm, [rest], store=False)
        second = list(rest.outputs[0].token_ids)

        # A request that keeps running through a weight update (version 1 -> 2): no abort.
        engine.add_request("through", TokensPrompt(prompt_token_ids=prompt), greedy(MAX_TOKENS))
        early = _step_until(engine, "through", ABORT_AFTER)
        llm.collective_rpc(_load_weights, args=(str(_updated_experts(2) / "model.safetensors"),))
        through = _step_until(engine, "through", MAX_TOKENS)
        (spanning,) = tvp.get_records(llm, [_output("through", prompt, through)], store=False)
        counters = tvp.stats(llm)["counters"]
        leftover = tvp.stats(llm)
    finally:
        shutdown(llm)
        if before is None:
            os.environ.pop("TRACE_FP4_KEEP_ABORTED", None)
        else:
            os.environ["TRACE_FP4_KEEP_ABORTED"] = before
    return SimpleNamespace(prompt=prompt, first=first, second=second, aborted=aborted, resumed=resumed,
                           spanning=spanning, early=early, through=through, counters=counters, leftover=leftover)


def test_the_stitched_record_says_which_version_made_each_token(run):
    P, first, second = run.prompt, run.first, run.second
    assert len(first) >= ABORT_AFTER and len(first) + len(second) == MAX_TOKENS
    assert run.aborted.identity.weights_version == 0 and run.resumed.identity.weights_version == 1
    assert run.aborted.identity.weights_digest != run.resumed.identity.weights_digest
    assert run.counters["aborted_records_kept"] == 1 and run.counters.get("aborted_records_dropped", 0) == 0
    A = len(P) + len(first) - 1  # the aborted part's rows; its last token first ran in the resumed prefill
    assert run.aborted.num_tokens == A
    tokens = P + first + second
    # The resumed request recomputed the aborted part under the new weights: other codes there, so the
    # plain multi-turn stitch refuses it, naming the versions.
    with pytest.raises(tk.RecordError, match="weights_version 1, turn 0 with 0"):
        stitch_turns([Turn(run.aborted, P + first), Turn(run.resumed, tokens)])
    stitched = stitch_turns([Turn(run.aborted, P + first), Turn(run.resumed, tokens)], weight_updates=True)
    assert stitched.identity.version_ranges == ((0, 0), (A, 1))
    assert stitched.identity.weights_version == 1 and stitched.num_tokens == len(tokens) - 1
    tk.check_identity(stitched, source="partial rollout", token_ids=tokens)
    # each token's own rows: the aborted part's decode rows, the resumed request's from A on
    for layer in range(stitched.shape.num_layers):
        assert torch.equal(stitched.routed_experts(layer)[:A], run.aborted.routed_experts(layer))
        assert torch.equal(stitched.routed_experts(layer)[A:], run.resumed.routed_experts(layer)[A:])
        for site in stitched.shape.layer_sites(layer):
            codes = stitched.site(layer, site).fields()[0]
            assert torch.equal(codes[:A], run.aborted.site(layer, site).fields()[0])
            assert torch.equal(codes[A:], run.resumed.site(layer, site).fields()[0][A:])
    # the update changed codes over the aborted part (so the version ranges matter)
    old, new = run.aborted.site(1, "moe_fc2_in").fields()[0], run.resumed.site(1, "moe_fc2_in").fields()[0][:A]
    assert not torch.equal(old, new)


def test_a_request_running_through_a_weight_update_records_its_version_ranges(run):
    ident = run.spanning.identity
    assert run.counters["requests_spanning_weight_update"] >= 1
    assert ident.weights_version == 2 and ident.version_ranges is not None
    (start, v0), (change, v1) = ident.version_ranges
    assert (start, v0, v1) == (0, 1, 2)
    # the update landed between steps after the early tokens: rows from there on are version 2's
    assert len(run.prompt) + len(run.early) - 1 <= change < run.spanning.num_tokens
    assert run.leftover["live_requests"] == 0 and run.leftover["done_requests"] == 0


@pytest.fixture(scope="module")
def recomputed(run):
    """Megatron-Core holding the version-1 weights recomputes the partial rollout, guided in full and
    by round-to-nearest; codes compared per version's rows."""
    from trace_fp4.hf_checkpoint import read_config
    from trace_fp4.recompute import Trainer

    stitched = stitch_turns([Turn(run.aborted, run.prompt + run.first),
                             Turn(run.resumed, run.prompt + run.first + run.second)], weight_updates=True)
    model_dir = _updated_experts(1)
    trainer = Trainer(model_dir, read_config(model_dir))
    sample = {"prompt_token_ids": run.prompt, "output_token_ids": run.first + run.second}
    groups = torch.zeros(stitched.num_tokens, dtype=torch.int64)
    for a, b, v in stitched.identity.row_versions():
        groups[a:b] = v
    out = {mode: trainer.run(mode, [sample], [stitched], row_groups=[groups]) for mode in ("trace_full", "fp4_rtn")}
    return stitched, out


def test_full_guidance_keeps_the_current_versions_codes(recomputed):
    """Not every code: the aborted part's rows serve two forwards. The trainer runs them as the tokens'
    own (old) codes, while the resumed request's tokens attended to the prefix recomputed by the new
    weights, so their inputs move a little and a few values land out of reach of the rollout's code
    (never an adjacent one missed). Measured (docs/rl-stacks.md, partial rollouts): 16 of 9216 values
    with a 1% expert step, against 647 by round-to-nearest."""
    stitched, out = recomputed
    full, rtn = out["trace_full"].group_sites, out["fp4_rtn"].group_sites
    print({v: (c.mismatched, c.rtn_mismatched, c.elements) for v, c in full.items()})
    assert full[1].elements > 0 and rtn[1].mismatched > 0
    assert full[1].mismatched_adjacent == 0  # every code within reach is the rollout's
    assert full[1].mismatched <= 0.05 * rtn[1].mismatched, (full[1], rtn[1])
    # the older tokens are stale: the trainer's weights moved, guidance keeps most of their codes
    assert full[0].mismatched < 0.5 * rtn[0].mismatched, (full[0], rtn[0])


def test_stale_tokens_are_counted_and_refused_beyond_max_staleness(recomputed):
    from trace_verl.records import record_staleness

    stitched, _ = recomputed
    A = stitched.identity.version_ranges[1][0]
    assert record_staleness([stitched], 1, accept_stale=True, max_staleness=1) == ([1], A)
    with pytest.raises(tk.RecordError, match=rf"rows {A}\.\.\d+ .*weights version 1 is newer than the trainer's 0"):
        record_staleness([stitched], 0, accept_stale=True, max_staleness=None)
    with pytest.raises(tk.RecordError, match=rf"rows 0\.\.{A - 1} of the record \(a partial rollout\) was made with "
                       r"weights version 0, 1 versions older than the trainer's 1; the trainer accepts at most 0"):
        record_staleness([stitched], 1, accept_stale=True, max_staleness=0)
