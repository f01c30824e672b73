"""The FP4 RTN and the sparse training steps interleaved in one process: the ratios of
`bench/megatron_step.py --paired N`.

Why: on a shared 2-core host the step time drifts by tens of percent within a minute. The table rows
take each mode's best of --steps, and the two bests can come from different windows: stop 39's two runs
of the same code read 1.01x and 1.22x. Here each of N passes runs one RTN step and one sparse step back
to back (RTN first on even passes, sparse first on odd ones, so neither always follows the other), each
ratio is taken within its pass, then the median over passes. A drift slower than a pass (~0.3 s)
cancels in each ratio.

Each step is timed twice: wall (perf_counter) and CPU (process_time, all of the process's threads). CPU
time leaves out the time the process waited for a core while other work ran, so on a loaded host it is
the steadier of the two; the difference between the two ratios says how much of the wall ratio was
waiting. The sparse step's record capture (the engine's rollout) is untimed in both, as in the rows.
"""

import statistics


def _spread(values) -> dict:
    """median, min, max over passes, and the passes themselves."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_pass": values}


def paired(rtn, sparse, passes: int) -> dict:
    """Run `passes` interleaved passes of `rtn.step()` and `sparse.step()` (each returns (wall_s, cpu_s) of
    its step, the untimed parts left out); return the per-pass times and ratios."""
    if passes < 1:
        raise ValueError(f"--paired needs at least one pass, got {passes}")
    times = {"fp4_rtn": {"wall_s": [], "cpu_s": []}, "sparse": {"wall_s": [], "cpu_s": []}}
    runners = {"fp4_rtn": rtn, "sparse": sparse}
    for i in range(passes):
        for name in ("fp4_rtn", "sparse") if i % 2 == 0 else ("sparse", "fp4_rtn"):
            wall, cpu = runners[name].step(record=False)
            times[name]["wall_s"].append(wall)
            times[name]["cpu_s"].append(cpu)
    r, s = times["fp4_rtn"], times["sparse"]
    wall_ratio = [b / a for a, b in zip(r["wall_s"], s["wall_s"])]
    cpu_ratio = [b / a for a, b in zip(r["cpu_s"], s["cpu_s"])]
    return {
        "passes": passes,
        "times": times,
        "sparse_vs_rtn_wall": _spread(wall_ratio),
        "sparse_vs_rtn_cpu": _spread(cpu_ratio),
        # wall ratio minus CPU ratio, per pass: > 0 where the sparse step waited for a core more than RTN did
        "wall_minus_cpu_ratio": _spread(w - c for w, c in zip(wall_ratio, cpu_ratio)),
        # sparse minus RTN in seconds, per pass: what the sparse step adds, in wall and CPU time
        "sparse_minus_rtn_wall_s": _spread(b - a for a, b in zip(r["wall_s"], s["wall_s"])),
        "sparse_minus_rtn_cpu_s": _spread(b - a for a, b in zip(r["cpu_s"], s["cpu_s"])),
    }


def report(p: dict, backend: str) -> str:
    """The lines the bench prints."""
    w, c, d = p["sparse_vs_rtn_wall"], p["sparse_vs_rtn_cpu"], p["wall_minus_cpu_ratio"]
    dw, dc = p["sparse_minus_rtn_wall_s"], p["sparse_minus_rtn_cpu_s"]
    return (f"\npaired steps ({p['passes']} passes on the {backend} path, RTN and sparse alternating in one process, "
            f"ratios within each pass, median [min, max]):\n"
            f"  sparse vs FP4 RTN, wall: {w['median']:.3f}x [{w['min']:.3f}, {w['max']:.3f}]; "
            f"CPU (process time): {c['median']:.3f}x [{c['min']:.3f}, {c['max']:.3f}]; "
            f"wall minus CPU ratio {d['median']:+.3f} [{d['min']:+.3f}, {d['max']:+.3f}]\n"
            f"  sparse minus RTN: wall {1e3 * dw['median']:+.1f} ms [{1e3 * dw['min']:+.1f}, {1e3 * dw['max']:+.1f}], "
            f"CPU {1e3 * dc['median']:+.1f} ms [{1e3 * dc['min']:+.1f}, {1e3 * dc['max']:+.1f}]")
