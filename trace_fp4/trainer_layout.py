"""The align job's trainer under a parallel layout (`--trainer-parallel tp=2,ep=2,cp=2,pp=2`).

The single-rank recompute (recompute.py) gives the table; this runs the same converted weights again as
Megatron-Core ranks in gloo processes (torch.multiprocessing, one per rank) on the rollout's records:
  bf16        Megatron's local spec (core attention: trace_megatron's CP attention when cp > 1, since
              Megatron's local one refuses CP), the yardstick of how much a layout moves BF16 numbers
  trace_full  the trace spec guided by the full records
and reports, per layer and site, the trace_full codeword mismatch against the rollout's codes (the
ranks' guidance counters, summed), and the log-probabilities of the generated tokens against the
single-rank trainer's, for both modes side by side.

Layout details: expert parallelism runs with expert_tensor_parallel_size 1 (experts whole on their EP
rank, so TP2 x EP2 fits 2 processes); sequence parallelism is off (forward only: Megatron's torch norms
refuse SP); under CP a sample is padded at its end to a multiple of 2 * cp (causal: padding never
reaches a real token) and each rank feeds Megatron's load-balanced shard; under PP stage s sends its
hidden states to stage s + 1, as a schedule does for one micro-batch.
"""

import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

MAX_WORLD = 8  # trainer processes the align job starts (tp x cp x pp)
SITES_FIELDS = ("guided_elements", "mismatch_guided", "mismatch_rtn", "guided_rows", "fallback_no_record",
                "fallback_not_guided", "fallback_route_mismatch")


def world_size(parallel: dict) -> int:
    return parallel["tp"] * parallel["cp"] * parallel["pp"]


def check_layout(parallel: dict, hf) -> None:
    """One line naming the setting where this model cannot be laid out so (before any engine starts)."""
    tp, ep, cp, pp = (parallel[k] for k in ("tp", "ep", "cp", "pp"))
    problems = []
    if hf.num_attention_heads % tp or hf.num_kv_heads % tp:
        problems.append(f"tp={tp}: {hf.num_attention_heads} attention heads / {hf.num_kv_heads} KV heads do not split over {tp} ranks")
    if hf.vocab_size % tp:
        problems.append(f"tp={tp}: vocab {hf.vocab_size} does not split over {tp} ranks")
    if ep > 1 and (hf.num_experts % ep or (tp * cp) % ep):
        problems.append(f"ep={ep}: {hf.num_experts} experts over {ep} ranks, and EP must divide tp*cp={tp * cp} "
                        "(one process per tp x cp x pp rank, experts whole on their rank)")
    if hf.num_layers % pp:
        problems.append(f"pp={pp}: {hf.num_layers} layers do not split into {pp} stages")
    if getattr(hf.model_shape(), "kv_kind", "") == "mla" and cp > 1:
        problems.append(f"cp={cp}: MLA attention under context parallelism is not supported")
    if problems:
        raise ValueError(f"--trainer-parallel {','.join(f'{k}={v}' for k, v in parallel.items() if v != 1)}: "
                         + "; ".join(problems))


def _shard_state(model, full: dict, config) -> dict:
    """The slice of a single-rank state dict each parameter of this rank's model holds: global layer
    numbers (PP), global expert ids (EP), TP / expert-TP slices along the one dimension that differs
    (GLU fc1: gate and up halves sliced each)."""
    from megatron.core import parallel_state as ps

    tp_rank, etp_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()
    ep_rank, ep = ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()
    offset = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    n_local = (config.num_moe_experts or 0) // ep
    out = {}
    for key, local in model.state_dict().items():
        if key.endswith("_extra_state"):
            continue
        g = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{offset[int(m.group(1))]}.", key)
        g = re.sub(r"\.local_experts\.(\d+)\.", lambda m: f".local_experts.{int(m.group(1)) + ep_rank * n_local}.", g)
        if g not in full:
            raise KeyError(f"trainer layout: no converted tensor for {key} (looked up as {g})")
        t = full[g]
        dims = [d for d in range(t.dim()) if t.shape[d] != local.shape[d]]
        if dims:
            (d,) = dims
            n = local.shape[d]
            rank = etp_rank if ".experts." in key else tp_rank
            if key.endswith("linear_fc1.weight") and config.gated_linear_unit and d == 0:
                gate, up = t.chunk(2, dim=0)
                t = torch.cat([gate.narrow(0, rank * n // 2, n // 2), up.narrow(0, rank * n // 2, n // 2)])
            else:
                t = t.narrow(d, rank * n, n)
        out[key] = t
    return out


def _build(mode: str, hf, state, parallel, pre, post):
    import trace_megatron
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from . import hf_to_megatron as h2m
    from .recompute import MODE_CONFIGS

    overrides = dict(tensor_model_parallel_size=parallel["tp"], context_parallel_size=parallel["cp"],
                     pipeline_model_parallel_size=parallel["pp"], expert_model_parallel_size=parallel["ep"],
                     expert_tensor_parallel_size=1 if parallel["ep"] > 1 else parallel["tp"], sequence_parallel=False)
    if parallel["pp"] > 1:
        overrides["pipeline_dtype"] = torch.bfloat16
    config = h2m.transformer_config(hf, params_dtype=torch.bfloat16, bf16=True, **overrides)
    if mode == "bf16":
        spec = h2m.local_block_spec(hf, config)
        if parallel["cp"] > 1:
            import dataclasses

            from trace_megatron.context_parallel import ContextParallelDotProductAttention

            def swap(layer):
                attn = layer.submodules.self_attention
                if attn.submodules.core_attention is not DotProductAttention:
                    raise ValueError(f"cp={parallel['cp']}: the BF16 spec's core attention is not Megatron's local one")
                sub = dataclasses.replace(attn.submodules, core_attention=ContextParallelDotProductAttention)
                return dataclasses.replace(layer, submodules=dataclasses.replace(
                    layer.submodules, self_attention=dataclasses.replace(attn, submodules=sub)))

            spec = dataclasses.replace(spec, layer_specs=[swap(s) for s in spec.layer_specs])
    else:
        spec = trace_megatron.get_gpt_decoder_block_with_trace_spec(config, normalization="RMSNorm",
                                                                    trace_config=MODE_CONFIGS[mode])
    kwargs = {} if parallel["pp"] == 1 else dict(pre_process=pre, post_process=post)
    model = h2m.build_gpt_model(hf, spec, config, **kwargs)
    missing, unexpected = model.load_state_dict(_shard_state(model, state, config), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"trainer layout: weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def _rank_main(rank: int, world: int, port: int, job: str):
    from megatron.core import parallel_state as ps

    import trace_kernels as tk
    import trace_megatron

    from . import hf_to_megatron as h2m
    from . import megatron_cpu
    from .hf_checkpoint import load_tensors, read_config
    from .logprob_gap import token_logprobs
    from .recompute import MODE_CONFIGS
    from trace_megatron.layout import cp_chunk_index

    spec = json.loads(Path(job, "job.json").read_text())
    parallel = spec["parallel"]
    megatron_cpu.init_parallel(rank, world, port, tp=parallel["tp"], ep=parallel["ep"], pp=parallel["pp"],
                               cp=parallel["cp"], etp=1 if parallel["ep"] > 1 else None)
    hf = read_config(Path(spec["model_dir"]))
    state = h2m.convert_state_dict(load_tensors(Path(spec["model_dir"])), hf, dtype=torch.bfloat16)
    tp, cp, pp = parallel["tp"], parallel["cp"], parallel["pp"]
    tp_group, cp_group = ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group()
    stage, cp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_context_parallel_rank()
    pre, post = stage == 0, stage == pp - 1
    out = {"metrics": [], "logprobs": {}, "seconds": {}}
    for mode in ("bf16", "trace_full"):
        model = _build(mode, hf, state, parallel, pre, post)
        samples = spec["samples"][mode]
        lps = []
        torch.distributed.barrier()
        start = time.perf_counter()
        for i, sample in enumerate(samples):
            prompt, gen = sample["prompt_token_ids"], sample["output_token_ids"]
            tokens = torch.tensor(prompt + gen[:-1])
            T = tokens.numel()
            Tp = -(-T // (2 * cp)) * 2 * cp if cp > 1 else T
            ids = torch.zeros(1, Tp, dtype=torch.int64)
            ids[0, :T] = tokens
            layout = trace_megatron.TokenLayout.padded([T], Tp)
            idx = torch.arange(Tp)
            if cp > 1:
                idx = cp_chunk_index(Tp, cp, cp_rank)
                layout = layout.context_parallel_shard(cp, cp_rank)
            args = (ids[:, idx], idx[None], megatron_cpu.causal_mask(Tp))
            with torch.no_grad():
                if mode == "trace_full":
                    record = tk.GuidanceRecord.load(Path(spec["records"][i]))
                    tk.check_identity(record, source=f"record of sample {i}", token_ids=tokens)
                    record = record.reencode(MODE_CONFIGS[mode])
                    with trace_megatron.guidance(model, [record], layout) as batch:
                        logits = _stage_forward(model, args, pre, post, Tp // cp, hf.hidden_size)
                    out["metrics"].append(batch.metrics())
                else:
                    logits = _stage_forward(model, args, pre, post, Tp // cp, hf.hidden_size)
            if not post:
                continue
            logits = logits.float()
            if tp > 1:  # vocab-parallel logits -> full vocabulary
                parts = [torch.empty_like(logits) for _ in range(tp)]
                torch.distributed.all_gather(parts, logits.contiguous(), group=tp_group)
                logits = torch.cat(parts, dim=-1)
            if cp > 1:  # this rank's positions -> the whole sequence, in order
                parts = [torch.empty_like(logits) for _ in range(cp)]
                torch.distributed.all_gather(parts, logits.contiguous(), group=cp_group)
                full = torch.empty(1, Tp, logits.shape[-1])
                for r, part in enumerate(parts):
                    full[:, cp_chunk_index(Tp, cp, r)] = part
                logits = full
            lps.append(token_logprobs(logits[0, len(prompt) - 1 : T], torch.tensor(gen)).tolist())
        out["logprobs"][mode] = lps
        torch.distributed.barrier()
        out["seconds"][mode] = time.perf_counter() - start  # the forwards of every sample, this layout
        del model
    torch.save(out, Path(job, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _stage_forward(model, args, pre: bool, post: bool, local_len: int, hidden: int):
    """One micro-batch through this pipeline stage: receive the previous stage's hidden states, run,
    send to the next (the first stage embeds, the last returns logits)."""
    from megatron.core import parallel_state as ps

    if pre and post:
        return model(*args)
    if not pre:
        recv = torch.empty(local_len, 1, hidden, dtype=torch.bfloat16)
        torch.distributed.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(recv)
    out = model(*args)
    if not post:
        torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    return out


def run(model_dir: Path, parallel: dict, samples: dict, record_paths: list[Path], single: dict) -> dict:
    """Recompute bf16 and trace_full under `parallel`; `samples[mode]`: the rollout samples of that
    mode; `single[mode]`: the single-rank trainer's log-probabilities (one tensor per sample; None: no
    comparison)."""
    import torch.multiprocessing as mp

    from . import megatron_cpu

    world = world_size(parallel)
    with tempfile.TemporaryDirectory(prefix="trace-fp4-layout-") as job:
        Path(job, "job.json").write_text(json.dumps({
            "parallel": parallel, "model_dir": str(model_dir), "records": [str(p) for p in record_paths],
            "samples": {m: [{k: s[k] for k in ("prompt_token_ids", "output_token_ids")} for s in v] for m, v in samples.items()},
        }))
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        try:
            mp.start_processes(_rank_main, args=(world, megatron_cpu.free_port(), job), nprocs=world, join=True,
                               start_method="spawn")
        finally:
            if env["OMP_NUM_THREADS"] is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env["OMP_NUM_THREADS"]
        ranks = [torch.load(Path(job, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return summarize(parallel, ranks, single)


def summarize(parallel: dict, ranks: list[dict], single: dict) -> dict:
    counts: dict[tuple[int, str], dict[str, float]] = {}
    for r in ranks:
        for metrics in r["metrics"]:
            for key, value in metrics.items():
                m = re.match(r"trace/layer(\d+)/([^/]+)/([^/]+)$", key)
                if m and m.group(3) in SITES_FIELDS:
                    c = counts.setdefault((int(m.group(1)), m.group(2)), dict.fromkeys(SITES_FIELDS, 0.0))
                    c[m.group(3)] += value
    per_layer, total = {}, dict.fromkeys(SITES_FIELDS, 0.0)
    for (layer, site), c in sorted(counts.items()):
        if site == "routing" or not c["guided_elements"] and not c["guided_rows"]:
            continue
        row = per_layer.setdefault(layer, {"layer": layer})
        row[site] = c["mismatch_guided"] / max(c["guided_elements"], 1)
        row[f"{site}_rtn"] = c["mismatch_rtn"] / max(c["guided_elements"], 1)
        for k in SITES_FIELDS:
            total[k] += c[k]
    last = next(r for r in reversed(ranks) if r["logprobs"].get("bf16"))
    agreement = {}
    for mode in ("bf16", "trace_full") if single is not None else ():
        a = torch.tensor([v for lp in last["logprobs"][mode] for v in lp], dtype=torch.float64)
        b = torch.cat([torch.as_tensor(lp, dtype=torch.float64) for lp in single[mode]])
        d = (a - b).abs()
        agreement[mode] = {"logprob_abs_diff_mean": d.mean().item(), "logprob_abs_diff_max": d.max().item(),
                           "num_tokens": float(d.numel())}
    return {
        "parallel": parallel,
        "world_size": world_size(parallel),
        "expert_tensor_parallel_size": 1 if parallel["ep"] > 1 else parallel["tp"],
        "sequence_parallel": False,
        "trace_full": {
            "codeword_mismatch_rate": total["mismatch_guided"] / max(total["guided_elements"], 1),
            # trace_megatron's `mismatch_rtn` counter over the guided elements (its own round-to-nearest
            # against the record); not computed like the single-rank table's same-activation RTN figure
            "mismatch_rtn_counter_rate": total["mismatch_rtn"] / max(total["guided_elements"], 1),
            "guided_elements": total["guided_elements"],
            "fallback_rows_by_reason": {k: total[k] for k in SITES_FIELDS if k.startswith("fallback")},
            "per_layer": [per_layer[k] for k in sorted(per_layer)],
        },
        # |logp under this layout - logp of the single-rank trainer| over the generated tokens
        "logprob_vs_single_rank": agreement,
        "logprobs": last["logprobs"],  # per mode, per sample: this layout's log-probs of the generated tokens
        # wall time of every sample's forward per mode (model build excluded), slowest rank
        "seconds": {m: max(r["seconds"][m] for r in ranks) for m in ("bf16", "trace_full")},
    }
