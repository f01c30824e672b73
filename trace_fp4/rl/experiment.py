"""The whole miniature: the SFT init once, then every arm x seed from it; JSON and plot."""

import json
import os
import shutil
import platform
import subprocess
import time
from pathlib import Path

from .arms import get_arms
from .loop import RunConfig, run_arm
from .sft import build_sft_init, sft_info
from .task import ReverseDigits


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except Exception:
        return platform.processor()


def run_experiment(arms, seeds, cfg: RunConfig, workdir, *, length: int = 4, sft_target: float = 0.3,
                   num_eval: int = 128, partial_json=None, record_dir=None, log=print) -> dict:
    workdir = Path(workdir)
    if record_dir is None:
        shm = Path("/dev/shm")
        record_dir = shm / f"trace-fp4-rl-{os.getpid()}" if shm.is_dir() else workdir / "records"
    record_dir = Path(record_dir)
    t0 = time.perf_counter()
    init_dir = build_sft_init(workdir / "sft_init", length=length, target=sft_target, log=log)
    task = ReverseDigits.from_tokenizer(init_dir, length, num_eval)
    result = {"task": task.describe(), "sft_init": sft_info(init_dir), "config": dict(cfg.__dict__),
              "cpu": _cpu(), "arms": {}}
    chosen = get_arms(arms)
    for arm in chosen:
        result["arms"][arm.name] = {"engine": arm.engine, "trainer": str(arm.trainer), "seeds": []}
    # Seed-major: if a long run is cut short, every arm has the same seeds so far.
    for seed in seeds:
        for arm in chosen:
            store_dir = record_dir / f"{arm.name}-seed{seed}"
            export_dir = workdir / "exports" / f"{arm.name}-seed{seed}" if cfg.export_eval else None
            r = run_arm(arm, seed, init_dir, task, cfg, store_dir, log=log, export_dir=export_dir)
            result["arms"][arm.name]["seeds"].append({"seed": seed, **r.to_dict()})
            result["wall_s"] = time.perf_counter() - t0
            if partial_json:
                write_json(result, partial_json)
    if cfg.export_eval:
        _evaluate_exports(result, init_dir, task, log)
    result["wall_s"] = time.perf_counter() - t0
    result["record_store_dir"] = str(record_dir)
    shutil.rmtree(record_dir, ignore_errors=True)  # empty by now (every record taken); the prompt parts too
    return result


def _evaluate_exports(result: dict, init_dir, task, log) -> None:
    from .exported_eval import evaluate_exported
    from .loop import evaluate

    runs = [s for a in result["arms"].values() for s in a["seeds"] if s.get("exported_checkpoint")]
    rewards = evaluate_exported(init_dir, {i: r["exported_checkpoint"] for i, r in enumerate(runs)}, task, evaluate)
    for i, r in enumerate(runs):
        r["final_eval_reward_exported_w4a16"] = rewards[i]
    for name, a in result["arms"].items():
        for s in a["seeds"]:
            log(f"[{name} seed {s['seed']}] exported NVFP4 checkpoint (decompressed, BF16 engine) greedy reward "
                f"{s.get('final_eval_reward_exported_w4a16')}")


WINDOW = 10


def summary(result: dict) -> list[dict]:
    rows = []
    for name, a in result["arms"].items():
        if not a["seeds"]:
            continue
        finals = [s["final_eval_reward"] for s in a["seeds"]]
        exported = [s["final_eval_reward_exported_w4a16"] for s in a["seeds"] if s.get("final_eval_reward_exported_w4a16") is not None]
        dl = [st["logprob_abs_diff_mean"] for s in a["seeds"] for st in s["steps"]]
        k3 = [st["k3_kl"] for s in a["seeds"] for st in s["steps"]]
        mm = [st["codeword_mismatch_rate"] for s in a["seeds"] for st in s["steps"] if st["codeword_mismatch_rate"] is not None]
        # train reward over the first / last `WINDOW` steps (one step's 64 samples are noisy)
        last = [st["reward_mean"] for s in a["seeds"] for st in s["steps"][-WINDOW:]]
        first = [st["reward_mean"] for s in a["seeds"] for st in s["steps"][:WINDOW]]
        clip = [st["clip_fraction"] for s in a["seeds"] for st in s["steps"]]
        rows.append({
            "arm": name,
            "final_eval_reward_mean": sum(finals) / len(finals),
            "final_eval_reward_by_seed": finals,
            "final_eval_reward_exported_w4a16_mean": (sum(exported) / len(exported)) if exported else None,
            "initial_eval_reward_by_seed": [s["initial_eval_reward"] for s in a["seeds"]],
            "train_reward_first_step": sum(first) / max(len(first), 1),
            "train_reward_last_step": sum(last) / max(len(last), 1),
            "logprob_abs_diff_mean": sum(dl) / max(len(dl), 1),
            "k3_kl_mean": sum(k3) / max(len(k3), 1),
            "clip_fraction_mean": sum(clip) / max(len(clip), 1),
            "codeword_mismatch_rate_mean": (sum(mm) / len(mm)) if mm else None,
            "guidance_bytes_per_token": a["seeds"][0]["steps"][0]["guidance_bytes_per_token"] if a["seeds"][0]["steps"] else 0,
        })
    return rows


def table(result: dict) -> str:
    lines = [f"| arm | final greedy FP4 reward (held-out) | per seed | train reward, first -> last {WINDOW} steps | "
             "mean \\|delta logp\\| | mean k3 KL | PPO clip fraction | codeword mismatch | guidance B/token |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in summary(result):
        mm = "-" if r["codeword_mismatch_rate_mean"] is None else f"{100 * r['codeword_mismatch_rate_mean']:.2f}%"
        lines.append(
            f"| {r['arm']} | {r['final_eval_reward_mean']:.3f} | {', '.join(f'{x:.3f}' for x in r['final_eval_reward_by_seed'])} | "
            f"{r['train_reward_first_step']:.3f} -> {r['train_reward_last_step']:.3f} | {r['logprob_abs_diff_mean']:.4f} | "
            f"{r['k3_kl_mean']:.2e} | {100 * r['clip_fraction_mean']:.1f}% | {mm} | {r['guidance_bytes_per_token']:.0f} |")
    exported = [r for r in summary(result) if r["final_eval_reward_exported_w4a16_mean"] is not None]
    if exported:
        lines += ["", "| arm | final greedy FP4 reward (engine, W4A4) | exported NVFP4 checkpoint, decompressed (W4A16) |",
                  "| --- | --- | --- |"]
        lines += [f"| {r['arm']} | {r['final_eval_reward_mean']:.3f} | {r['final_eval_reward_exported_w4a16_mean']:.3f} |"
                  for r in exported]
    return "\n".join(lines)


def write_json(result: dict, path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, separators=(",", ":")))


def _moving_average(y, w: int):
    import numpy as np

    if w <= 1 or len(y) < w:
        return np.asarray(y, dtype=float)
    c = np.cumsum(np.insert(np.asarray(y, dtype=float), 0, 0.0))
    head = [np.mean(y[: i + 1]) for i in range(w - 1)]  # a trailing window that grows at the start
    return np.concatenate([head, (c[w:] - c[:-w]) / w])


def write_plot(result: dict, path, *, smooth: int = 5) -> None:
    """Reward (trailing moving average over `smooth` steps, per seed, then mean and min..max over
    seeds) and |delta logp| (raw) per step, one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, a in result["arms"].items():
        for ax, key in zip(axes, ("reward_mean", "logprob_abs_diff_mean")):
            if not a["seeds"]:
                continue
            curves = np.array([[st[key] for st in s["steps"]] for s in a["seeds"]])
            if curves.size == 0:
                continue
            if key == "reward_mean":
                curves = np.array([_moving_average(c, smooth) for c in curves])
            mean, lo, hi = curves.mean(0), curves.min(0), curves.max(0)
            x = np.arange(curves.shape[1])
            (line,) = ax.plot(x, mean, label=f"{name} ({curves.shape[0]} seeds)")
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    axes[0].set(title=f"train reward (sampled, T=1; {smooth}-step moving avg)\nmean over seeds, band = min..max",
                xlabel="RL step", ylabel="reward")
    axes[1].set(title="train-rollout mean |delta logp|\n(trainer recompute vs rollout, before the update)", xlabel="RL step", ylabel="|delta logp|", yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
