"""Training-step time of a tiny Megatron-Core MoE model: BF16 vs FP4 RTN vs TRACE guided (one run).

    .venv/bin/python bench/megatron_step.py [--steps 5] [--hidden 128] [--layers 4] [--seq 64] [--batch 4] [--json FILE]

The JSON's `data.step_s` holds seconds per step of each mode: bf16, fp4_rtn, sparse (every layer, the
default), compact (every layer) and paper (compact, deeper half), best of --steps. With --cpu-native also
`sparse_native_prepared`: the sparse step with its record tables built before the step
(`trace_megatron.prepare`, as a data loader would; every step still decodes), the time to build them in
`data.prep_s.sparse_native`; `sparse_native` builds them in the step; `sparse_native_stale` trains on
records captured once before the first step (below).

`--paired N` (bench/megatron_paired.py): after the rows, N passes of one FP4 RTN and one sparse step
alternating in the same process (the native path's with --cpu-native, else the eager path's), each ratio
taken within its pass, wall and CPU (process time); `data.paired`. The rows' bests come from different
windows of a host whose speed drifts; the paired ratio does not.

Every guided step trains on records captured from its own model's weights just before the step (untimed:
the engine's rollout after the weight sync, as in an RL step, where the trainer's first forward sees the
weights the engine ran). `sparse_native_stale` keeps the records of the first step: after n SGD updates
the trainer's values have drifted from them and its decode searches more flips.

BF16 = Megatron's local spec. FP4 RTN = the trace spec without records (experts and KV fake-quantized
with round-to-nearest, the experts' GEMMs the engine's exact FP4 GEMM). TRACE = the trace spec guided by
records of a second (BF16-rounding) engine, with metrics: the paper's compact deeper half, compact at
every layer, and the default (sparse at every layer: its syndromes are decoded in every forward). All train the same weights with the same batch; the printed ratios are measured side by
side in this run. On a CPU the FP4 paths use trace_kernels' torch reference (no Triton, no FP4 GEMMs),
so the ratios show the bookkeeping cost, not what a GPU would see.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import megatron_cpu as mc  # noqa: E402  (CPU shim for Megatron-Core; test/bench only)

mc.init_parallel()

import trace_megatron  # noqa: E402
from trace_kernels import PAPER_CONFIG, TraceConfig  # noqa: E402


class Runner:
    """One model's training step; steps of the three models are interleaved so drift hits all alike."""

    def __init__(self, model, inputs, ctx=None, cpu_backend: str = "eager", prepare=None, records=None):
        self.model, self.inputs, self.ctx, self.cpu_backend = model, inputs, ctx, cpu_backend
        # `records`: a StepRecords re-captured before each step (untimed: the engine's rollout), or None
        self.records = records
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.times, self.cpu_times = [], []
        # `prepare()`: the batch's record tables, built before each step as a data loader would (timed apart,
        # in prep_times); `ctx(prepared)` then guides the step with them
        self.prepare, self.prep_times = prepare, []

    def step(self, record: bool = True) -> tuple[float, float]:
        """One training step; returns its (wall, CPU) seconds, the untimed record capture and preparation
        left out (kept in self.times / self.cpu_times when `record`)."""
        # TRACE_FP4_CPU_BACKEND is read at every call, so runners of both CPU paths interleave in one run.
        os.environ["TRACE_FP4_CPU_BACKEND"] = self.cpu_backend
        if self.records is not None:
            self.records.refresh()
        ctx = self.ctx
        if self.prepare is not None:
            t0 = time.perf_counter()
            prepared = self.prepare()
            if record:
                self.prep_times.append(time.perf_counter() - t0)
            ctx = lambda: self.ctx(prepared)  # noqa: E731
        t0, c0 = time.perf_counter(), time.process_time()
        if ctx is not None:
            with ctx() as batch:
                out = self.model(*self.inputs)
        else:
            out = self.model(*self.inputs)
        out.float().pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.ctx is not None:
            batch.metrics()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if record:
            self.times.append(wall)
            self.cpu_times.append(cpu)
        return wall, cpu

    @property
    def best(self) -> float:
        # The fastest step: the least disturbed by other work on a shared machine.
        return min(self.times)


class StepRecords:
    """The records a guided step trains on: by default re-captured from the model's current weights before
    every step, as an RL step's rollout is (the weight sync, then the rollout, then the trainer's step on
    its records: the trainer's weights are the engine's). With `stale=True`, captured once before the first
    step and reused: after n steps the trainer's values have drifted n SGD updates from the records', so
    the decode searches more flips (what a trainer many updates off-policy would see)."""

    def __init__(self, model, inputs, layout, config, engine, stale: bool = False):
        self.model, self.inputs, self.layout, self.config, self.engine = model, inputs, layout, config, engine
        self.stale, self.records = stale, None

    def refresh(self) -> None:
        if self.stale and self.records is not None:
            return
        with torch.no_grad(), trace_megatron.capture(self.model, self.layout, perturb=self.engine) as cap:
            self.model(*self.inputs)
        self.records = cap.build_records(self.config)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--compiled", action="store_true",
                    help="also run FP4 RTN, the paper's mode and sparse on the compiled CPU path (TRACE_FP4_CPU_BACKEND="
                    "compiled), interleaved with the others; warm-up rounds compile")
    ap.add_argument("--cpu-native", action="store_true",
                    help="also run FP4 RTN, the paper's mode and sparse on the native CPU path (TRACE_FP4_CPU_BACKEND="
                    "native: numba kernels, e.g. the whole sparse decode of a site in one call), interleaved; the "
                    "first call compiles (cached on disk). No decode is cached across steps: every step decodes.")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (compiling takes several with --compiled)")
    ap.add_argument("--paired", type=int, default=0, metavar="N",
                    help="after the rows, N passes of one FP4 RTN and one sparse step alternating in this process (the "
                    "native path's with --cpu-native), ratios within each pass, wall and CPU (bench/megatron_paired.py)")
    from results_io import add_json_arg, write_results

    add_json_arg(ap, "megatron_step")
    args = ap.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))

    cfg = mc.tiny_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=4, num_query_groups=2,
        kv_channels=args.hidden // 4, moe_ffn_hidden_size=args.hidden // 2, num_moe_experts=8, moe_router_topk=2,
        params_dtype=torch.bfloat16, bf16=True,
    )
    mc.MAX_SEQ = max(mc.MAX_SEQ, args.seq)
    lengths = [args.seq] * args.batch
    ids, pos, mask = mc.padded_batch(lengths, args.seq)
    layout = trace_megatron.TokenLayout.padded(lengths, args.seq)
    tc = PAPER_CONFIG  # compact guidance for the deeper half (the paper's default)
    sparse = TraceConfig()  # the default: sparse guidance at every layer
    compact = TraceConfig(guidance="compact", guided_layers="all")

    bf16 = mc.tiny_model(cfg, trace=False, seed=0)
    rtn = mc.tiny_model(cfg, trace_config=tc, seed=0)
    traced = mc.tiny_model(cfg, trace_config=tc, seed=0)
    traced_sparse = mc.tiny_model(cfg, trace_config=sparse, seed=0)
    traced_compact = mc.tiny_model(cfg, trace_config=compact, seed=0)
    # CPU backend -> its own (rtn, paper, sparse) models, run interleaved with the eager ones
    backends = [b for b, on in (("compiled", args.compiled), ("native", args.cpu_native)) if on]
    # (the native path adds two: sparse with its tables prepared before the step (trace_megatron.prepare), and
    # sparse on stale records, captured once before the first step)
    per_backend = {b: [mc.tiny_model(cfg, trace_config=c, seed=0) for c in (tc, tc, sparse) + ((sparse, sparse) if b == "native" else ())]
                   for b in backends}
    for m in (rtn, traced, traced_sparse, traced_compact, *(m for ms in per_backend.values() for m in ms)):
        m.load_state_dict(bf16.state_dict())

    engine = lambda x: x.to(torch.float16).to(x.dtype)  # noqa: E731  a second engine's rounding
    inputs = (ids, pos, mask)

    def guided(m, config, backend="eager", stale=False, prepared=False):
        # a guided runner whose records come from its own weights (StepRecords), re-captured before each step
        rec = StepRecords(m, inputs, layout, config, engine, stale=stale)
        if prepared:  # tables built before every step (a data loader's work), the step reuses them
            return Runner(m, inputs, ctx=lambda p: trace_megatron.guidance(m, p, layout), cpu_backend=backend,
                          prepare=lambda: trace_megatron.prepare(m, rec.records, layout), records=rec)
        return Runner(m, inputs, ctx=lambda: trace_megatron.guidance(m, rec.records, layout), cpu_backend=backend,
                      records=rec)

    runners = [
        Runner(bf16, inputs),
        Runner(rtn, inputs),
        guided(traced, tc),
        guided(traced_sparse, sparse),
        guided(traced_compact, compact),
    ]
    first = {}  # backend -> index of its first runner
    for b, (m_rtn, m_paper, m_sparse, *m_more) in per_backend.items():
        first[b] = len(runners)
        runners += [Runner(m_rtn, inputs, cpu_backend=b), guided(m_paper, tc, b), guided(m_sparse, sparse, b)]
        if m_more:  # native: sparse with its tables prepared, and sparse on records captured once (stale)
            m_prepared, m_stale = m_more
            runners += [guided(m_prepared, sparse, b, prepared=True), guided(m_stale, sparse, b, stale=True)]
    for i in range(args.steps + args.warmup):  # the first rounds are warm-up
        for r in runners:
            r.step(record=i >= args.warmup)
    t_bf16, t_rtn, t_trace, t_sparse, t_compact = (r.best for r in runners[:5])

    print(f"tiny MoE: {args.layers} layers, hidden {args.hidden}, 8 experts top-2, batch {args.batch} x seq {args.seq}, "
          f"bf16 params, {torch.get_num_threads()} CPU threads, best of {args.steps} steps")
    print(f"  BF16 (Megatron local spec)   {t_bf16 * 1e3:8.1f} ms/step   1.00x")
    print(f"  FP4 RTN fake-quant           {t_rtn * 1e3:8.1f} ms/step   {t_rtn / t_bf16:.2f}x BF16")
    print(f"  TRACE compact, deeper half   {t_trace * 1e3:8.1f} ms/step   {t_trace / t_bf16:.2f}x BF16, "
          f"{t_trace / t_rtn:.2f}x FP4 RTN")
    print(f"  TRACE compact, every layer   {t_compact * 1e3:8.1f} ms/step   {t_compact / t_bf16:.2f}x BF16, "
          f"{t_compact / t_rtn:.2f}x FP4 RTN")
    print(f"  TRACE sparse, every layer    {t_sparse * 1e3:8.1f} ms/step   {t_sparse / t_bf16:.2f}x BF16, "
          f"{t_sparse / t_rtn:.2f}x FP4 RTN (syndromes decoded in every forward)")
    step_s = {"bf16": t_bf16, "fp4_rtn": t_rtn, "sparse": t_sparse, "compact": t_compact, "paper": t_trace}
    prep_s = {}  # seconds to prepare a micro-batch's record tables (trace_megatron.prepare), best of --steps
    if args.compiled:
        from trace_kernels import cpu_compiled

        c_rtn, c_paper, c_sparse = (r.best for r in runners[first["compiled"]:first["compiled"] + 3])
        print("  compiled CPU path (TRACE_FP4_CPU_BACKEND=compiled), same run:")
        print(f"  FP4 RTN fake-quant           {c_rtn * 1e3:8.1f} ms/step   {c_rtn / t_bf16:.2f}x BF16, {c_rtn / t_rtn:.2f}x eager RTN")
        print(f"  TRACE compact, deeper half   {c_paper * 1e3:8.1f} ms/step   {c_paper / t_bf16:.2f}x BF16, {c_paper / c_rtn:.2f}x FP4 RTN")
        print(f"  TRACE sparse, every layer    {c_sparse * 1e3:8.1f} ms/step   {c_sparse / t_bf16:.2f}x BF16, {c_sparse / c_rtn:.2f}x FP4 RTN")
        print(f"  eager fallbacks counted: {cpu_compiled.fallbacks()}")
        step_s.update({"fp4_rtn_compiled": c_rtn, "paper_compiled": c_paper, "sparse_compiled": c_sparse})
    if args.cpu_native:
        from trace_kernels import cpu_native

        n_rtn, n_paper, n_sparse = (r.best for r in runners[first["native"]:first["native"] + 3])
        print("  native CPU path (TRACE_FP4_CPU_BACKEND=native), same run:")
        print(f"  FP4 RTN fake-quant           {n_rtn * 1e3:8.1f} ms/step   {n_rtn / t_bf16:.2f}x BF16, {n_rtn / t_rtn:.2f}x eager RTN")
        print(f"  TRACE compact, deeper half   {n_paper * 1e3:8.1f} ms/step   {n_paper / t_bf16:.2f}x BF16, {n_paper / n_rtn:.2f}x native FP4 RTN")
        print(f"  TRACE sparse, every layer    {n_sparse * 1e3:8.1f} ms/step   {n_sparse / t_bf16:.2f}x BF16, "
              f"{n_sparse / n_rtn:.2f}x native FP4 RTN, {n_sparse / t_rtn:.2f}x eager FP4 RTN")
        prepared = runners[first["native"] + 3]
        n_prep, t_prep = prepared.best, min(prepared.prep_times)
        print(f"  TRACE sparse, tables prepared{n_prep * 1e3:8.1f} ms/step   {n_prep / t_bf16:.2f}x BF16, "
              f"{n_prep / n_rtn:.2f}x native FP4 RTN (+ {t_prep * 1e3:.1f} ms to prepare, before the step)")
        stale = runners[first["native"] + 4]
        n_stale = stale.best
        print(f"  TRACE sparse, stale records  {n_stale * 1e3:8.1f} ms/step   {n_stale / n_rtn:.2f}x native FP4 RTN (records "
              f"captured once, the trainer {args.warmup}-{args.warmup + args.steps - 1} updates past them)")
        print(f"  torch fallbacks counted on the native path: {cpu_native.fallbacks()}")
        step_s.update({"fp4_rtn_native": n_rtn, "paper_native": n_paper, "sparse_native": n_sparse,
                       "sparse_native_prepared": n_prep, "sparse_native_stale": n_stale})
        prep_s["sparse_native"] = t_prep
    paired = None
    if args.paired:
        import megatron_paired

        # the native path's RTN and sparse runners where it ran (the figure), else the eager path's
        backend = "native" if args.cpu_native else "eager"
        i_rtn, i_sparse = (first["native"], first["native"] + 2) if args.cpu_native else (1, 3)
        paired = {"backend": backend, **megatron_paired.paired(runners[i_rtn], runners[i_sparse], args.paired)}
        print(megatron_paired.report(paired, backend))
    write_results(args.json, "megatron_step", {
        "layers": args.layers, "hidden": args.hidden, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "threads": torch.get_num_threads(), "step_s": step_s, **({"prep_s": prep_s} if prep_s else {}),
        **({"paired": paired} if paired else {}),
    })


if __name__ == "__main__":
    main()
