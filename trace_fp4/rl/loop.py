"""One arm x seed of the miniature: rollout in vLLM -> records -> GRPO step in Megatron -> weight sync.

Per step (all measured, nothing assumed):
  rollout   the engine samples n completions of each prompt (one request per sample, n=1 each)
  records   FP4 arms: the engine puts each sample's full record in a record store (local files,
            the prompt rows of a group stored once) and only handles travel; the trainer takes each
            record from the store (consumed once), checks its identity (its tokens, the weights
            version, and the digest of the NVFP4 expert weights against the trainer's own weights) and
            re-encodes it into the arm's TraceConfig
  train     one forward on the whole batch (the recompute of the rollout tokens, before any
            update: |delta logp| and k3 KL against the engine's log-probabilities come from it),
            PPO-clip loss, backward, Adam on the fp32 master copy of the routed experts
  sync      the new expert weights into the engine (its public update path), weights version + 1
At the end: greedy evaluation on the held-out strings in an FP4 engine holding the final weights
(the FP4 arms' own engine; the bf16 arm's weights are synced into a fresh FP4 engine).
"""

import time
from dataclasses import dataclass, field

import torch

import trace_kernels as tk
from trace_kernels.config import SITES
from trace_kernels.grouped_mm import PackedExperts
from trace_kernels.weight_digest import layer_digest

from ..logprob_gap import gap
from ..recompute import SiteCounts, _compare
from .arms import Arm
from .engine import RolloutEngine
from .grpo import group_advantages, ppo_clip_loss
from .policy import Policy
from .task import ReverseDigits


@dataclass
class RunConfig:
    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 4
    lr: float = 1e-3
    clip: float = 0.2
    temperature: float = 1.0
    check_weights: bool = False  # compare the engine's weights with the trainer's after every sync (tests)
    # Also export each arm's final policy as an NVFP4 checkpoint and evaluate it as a stock engine
    # would serve it (trace_fp4/rl/exported_eval.py): one extra BF16 engine start per experiment.
    export_eval: bool = False


def _mismatch(batch, records: list[tk.GuidanceRecord], num_layers: int) -> dict:
    """Codeword mismatch of the trainer's forward at every captured site against the rollout's full
    records, and the part of it where the rollout's codeword is a grid neighbour of the trainer's value."""
    pos = torch.cat([batch.layout.positions_of(i) for i in range(len(records))])
    total = SiteCounts()
    per_layer = []
    for layer in range(num_layers):
        lay = SiteCounts()
        for site in SITES:
            q = batch.captured(layer, site)
            ours = tk.NVFP4Tensor(q.codes[pos], q.scales[pos], q.global_amax[pos])
            full = [r.site(layer, site) for r in records]
            theirs = tk.NVFP4Tensor(*(torch.cat([getattr(f, a) for f in full]) for a in ("codes", "scales", "global_amax")))
            lay.add(_compare(batch.captured_values(layer, site)[pos], ours, theirs))
        total.add(lay)
        per_layer.append(lay.mismatched / lay.elements)
    return {
        "codeword_mismatch_rate": total.mismatched / total.elements,
        "codeword_mismatch_rate_adjacent": total.mismatched_adjacent / max(total.adjacent, 1),
        "non_adjacent_rate": 1 - total.adjacent / total.elements,
        "codeword_mismatch_by_layer": per_layer,
    }


def check_engine_weights(engine: RolloutEngine, policy: Policy, fp4: bool) -> None:
    """The engine computes with the trainer's weights: FP4 codes (compared as values, +0 == -0),
    scales and per-expert amax equal; BF16 expert parameters equal where the engine holds them."""
    theirs = engine.weights()
    ours = policy.expert_codes()
    state = policy.expert_state_hf()
    E = policy.hf.num_experts
    for layer, w in theirs.items():
        gate_up = torch.stack([torch.cat([state[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"],
                                          state[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"]]) for e in range(E)])
        down = torch.stack([state[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] for e in range(E)])
        if not fp4 and not ("w13" in w and "w2" in w):
            raise AssertionError(f"layer {layer}: the BF16 engine shows no BF16 expert weights")
        for name, mine in (("w13", gate_up), ("w2", down)):
            if name in w and not torch.equal(w[name], mine):
                raise AssertionError(f"layer {layer} {name}: the engine's BF16 expert weights differ from the trainer's")
        if fp4:
            for name in ("w13", "w2"):
                q = ours[layer][name]
                if f"{name}_codes" not in w:
                    raise AssertionError(f"layer {layer} {name}: the FP4 engine shows no NVFP4 expert weights")
                eng = tk.NVFP4Tensor(w[f"{name}_codes"], w[f"{name}_scales"], q.global_amax)
                if not torch.equal(w[f"{name}_amax"], q.global_amax[:, 0]):
                    raise AssertionError(f"layer {layer} {name}: the engine's per-expert amax differs from the trainer's")
                if not torch.equal(eng.scales, q.scales) or not torch.equal(tk.codewords(eng), tk.codewords(q)):
                    raise AssertionError(f"layer {layer} {name}: the engine's FP4 codes differ from the trainer's")


def evaluate(engine: RolloutEngine, task: ReverseDigits) -> float:
    strings = task.eval_strings()
    out = engine.generate([task.prompt_ids(s) for s in strings], [0] * len(strings), temperature=0.0,
                          max_tokens=task.max_new_tokens())
    return sum(task.reward(s, o["output_token_ids"]) for s, o in zip(strings, out["samples"])) / len(strings)


@dataclass
class RunResult:
    steps: list = field(default_factory=list)
    initial_eval_reward: float | None = None
    final_eval_reward: float | None = None
    final_eval_reward_bf16_engine: float | None = None
    exported_checkpoint: str | None = None  # the final policy as a compressed-tensors NVFP4 checkpoint
    final_eval_reward_exported_w4a16: float | None = None  # that checkpoint, decompressed, in a BF16 engine
    engine_start_s: list = field(default_factory=list)
    records: dict = field(default_factory=dict)  # put by the engine, taken by the trainer, left in the store
    engine_counters: dict = field(default_factory=dict)  # the plugin's worker counters at the end
    weight_checks: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_arm(arm: Arm, seed: int, init_dir, task: ReverseDigits, cfg: RunConfig, store_dir, log=print,
            export_dir=None) -> RunResult:
    torch.manual_seed(seed)
    res = RunResult()
    policy = Policy(init_dir, arm.trainer, trainable="experts", lr=cfg.lr)
    store = tk.stores.open_store(f"file:{store_dir}") if arm.fp4 else None
    engine = RolloutEngine(init_dir, arm.engine, seed=seed, max_num_seqs=max(cfg.prompts_per_step * cfg.group_size, 128))
    try:
        res.engine_start_s.append(engine.start_s)
        res.initial_eval_reward = evaluate(engine, task)
        log(f"[{arm.name} seed {seed}] engine up ({engine.start_s:.1f} s); initial greedy reward "
            f"({arm.engine} engine) {res.initial_eval_reward:.3f}")
        for step in range(cfg.steps):
            res.steps.append(_step(arm, seed, step, policy, engine, task, cfg, store))
            if cfg.check_weights:
                check_engine_weights(engine, policy, arm.fp4)
                res.weight_checks += 1
            s = res.steps[-1]
            log(f"[{arm.name} seed {seed}] step {step}: reward {s['reward_mean']:.3f}, |dlogp| "
                f"{s['logprob_abs_diff_mean']:.4f}, k3 {s['k3_kl']:.2e}, mismatch {s['codeword_mismatch_rate']}, "
                f"rollout {s['time_rollout_s']:.1f} s, records {s['time_records_s']:.2f} s, train {s['time_train_s']:.1f} s")
        if arm.fp4:
            res.final_eval_reward = evaluate(engine, task)
        else:
            res.final_eval_reward_bf16_engine = evaluate(engine, task)
        res.engine_counters = dict(engine.stats()["counters"])
    finally:
        engine.close()
    if not arm.fp4:
        with RolloutEngine(init_dir, "fp4", seed=seed) as fp4_engine:
            res.engine_start_s.append(fp4_engine.start_s)
            fp4_engine.sync(policy.expert_state_hf())
            if cfg.check_weights:
                check_engine_weights(fp4_engine, policy, True)
            res.final_eval_reward = evaluate(fp4_engine, task)
    if store is not None:
        st = store.stats()
        res.records = {"put": res.engine_counters.get("records_put_in_store", 0), "taken": st["taken"],
                       "outstanding": st["outstanding"]}
    log(f"[{arm.name} seed {seed}] final greedy FP4 reward {res.final_eval_reward:.3f}")
    if export_dir is not None:
        from .exported_eval import export_policy

        res.exported_checkpoint = str(export_policy(policy, init_dir, export_dir))
    return res


def _packed(q: tk.NVFP4Tensor) -> PackedExperts:
    """The trainer's NVFP4 expert weights [E, N, K] (amax per row, constant within an expert) as the
    engines hold them."""
    return PackedExperts(q.codes, q.scales, q.global_amax.reshape(q.codes.shape[0], -1)[:, 0].contiguous())


def _take_records(handles, samples, policy: Policy, version: int) -> list[tk.GuidanceRecord]:
    """Resolve each handle once and check the record belongs to this sample and these weights."""
    codes = policy.expert_codes()
    # the engine's digest is over its resident PackedExperts (one amax per expert): the same bytes here
    digest = tk.weights_digest({layer: layer_digest(*(_packed(w[n]) for n in ("w13", "w2"))) for layer, w in codes.items()})
    shape = policy.hf.model_shape()
    records = []
    for i, (h, s) in enumerate(zip(handles, samples)):
        rec = tk.stores.get(h, consume=True)
        rec.check_compatible(shape, source=f"record of sample {i}")
        tk.check_identity(rec, source=f"record of sample {i}", token_ids=s["prompt_token_ids"] + s["output_token_ids"],
                          weights_version=version, weights_digest=digest)
        records.append(rec)
    return records


def _step(arm, seed, step, policy, engine, task, cfg, store) -> dict:
    n = cfg.group_size
    strings = task.train_strings(cfg.prompts_per_step, seed=seed * 1_000_003 + step)
    prompt_seeds = [seed * 10_000_000 + step * 10_000 + i for i in range(len(strings))]
    t0 = time.perf_counter()
    out = engine.generate([task.prompt_ids(s) for s in strings], prompt_seeds, n=n, temperature=cfg.temperature,
                          max_tokens=task.max_new_tokens(), store=store.spec if store is not None else None)
    t_call = time.perf_counter() - t0
    samples = out["samples"]
    if len(samples) != n * len(strings):
        raise RuntimeError(f"step {step}: {len(samples)} samples for {len(strings)} prompts x {n}")
    t1 = time.perf_counter()
    full = _take_records(out["handles"], samples, policy, step) if arm.fp4 else None
    t_records = out["take_records_s"] + (time.perf_counter() - t1)
    if store is not None and store.stats()["outstanding"]:
        raise RuntimeError(f"step {step}: records left in the store after taking them: {store.stats()}")
    rewards = torch.tensor([task.reward(s, x["output_token_ids"]) for s, x in zip([s for s in strings for _ in range(n)], samples)])
    logp_rollout = [torch.tensor(x["logprobs"], dtype=torch.float32) for x in samples]

    t2 = time.perf_counter()
    records = [r.reencode(arm.trainer) for r in full] if arm.fp4 else None
    logp, batch = policy.forward(samples, records, capture=arm.fp4)
    metrics = gap(torch.cat(logp).detach(), torch.cat(logp_rollout))
    adv = group_advantages(rewards, n)
    loss, info = ppo_clip_loss(logp, logp_rollout, adv, clip=cfg.clip)
    grad_norm = policy.step(loss)
    t_train = time.perf_counter() - t2
    mism = {"codeword_mismatch_rate": None, "codeword_mismatch_rate_adjacent": None, "non_adjacent_rate": None,
            "codeword_mismatch_by_layer": None}
    if arm.fp4:
        mism = _mismatch(batch, full, policy.hf.num_layers)
    guided = arm.fp4 and any(m is not None for m in arm.trainer.layer_modes(policy.hf.num_layers))
    tokens = sum(r.num_tokens for r in records) if records else 1
    t3 = time.perf_counter()
    synced = engine.sync(policy.expert_state_hf())
    t_sync = time.perf_counter() - t3
    return {
        "step": step,
        "reward_mean": rewards.mean().item(),
        "logprob_abs_diff_mean": metrics["logprob_abs_diff_mean"],
        "k3_kl": metrics["k3_kl"],
        **mism,
        "guidance_bytes_per_token": (sum(r.nbytes for r in records) / tokens) if guided else 0.0,
        "time_rollout_s": t_call - out["take_records_s"],
        "time_records_s": t_records,
        "time_train_s": t_train,
        "time_sync_s": t_sync,
        "loss": loss.item(),
        "grad_norm": grad_norm,
        "clip_fraction": info["clip_fraction"],
        "num_samples": len(samples),
        "num_generated_tokens": int(metrics["num_tokens"]),
        "weights_version": synced["weights_version"],
        "rollout_weights_version": out["weights_version"],
        "distinct_completions_per_group": sum(
            len({tuple(x["output_token_ids"]) for x in samples[g * n:(g + 1) * n]}) for g in range(len(strings))) / len(strings),
    }


