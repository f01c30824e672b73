"""Version-checked hooks into vLLM's V1 model runner and worker (code we do not own).

vLLM has no extension point that tells a layer which request each row of the flattened batch belongs
to. The V1 runner (`GPUModelRunner`, which `CPUModelRunner` subclasses) knows it right before the
forward: `input_batch.req_ids` (batch order), `query_start_loc` (row ranges) and
`input_batch.num_computed_tokens_cpu` (each request's first position). We wrap two methods:

  `_model_forward`              documented as overridable; opens/closes a capture step around it
  `_on_request_state_removed`   "hook for platform runners"; marks the request's capture finished

and add three RPC methods to `WorkerWrapperBase` (reached with `llm.collective_rpc("<name>")`, which
works in-process and with the multiprocess engine without pickling functions):
`trace_fp4_take_records`, `trace_fp4_stats`, `trace_fp4_discard_records`, `trace_fp4_set_weights_version`.

Supported: vLLM 0.32.x with the V1 model runner (Model Runner V2 is not hooked). Any other version
fails loudly at model load instead of capturing wrong rows.
"""

import vllm

from trace_vllm_plugin.capture import STORE, StepLayout

SUPPORTED_VLLM = ("0.32.",)
_installed = False


def check_version() -> None:
    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise RuntimeError(
            f"trace_fp4: the request-capture hooks support vLLM {SUPPORTED_VLLM}, found "
            f"{vllm.__version__}; update patches/vllm_v1_runner.py for this version"
        )


def _was_aborted(req_state, max_model_len: int) -> bool:
    """True only when the request surely ended without a natural stop (length, stop token, model
    length). Stop *strings* are matched by the front end, which then aborts the request in the engine:
    such a request looks aborted here, so requests with stop strings are always kept."""
    sp = getattr(req_state, "sampling_params", None)
    if req_state is None or sp is None:
        return False
    out = req_state.output_token_ids
    if not out:
        return True  # removed before its first token was sampled
    if out[-1] < 0 or sp.stop:
        return False  # -1: async-scheduling placeholder (unknown); stop strings: see above
    if sp.max_tokens is not None and len(out) >= sp.max_tokens:
        return False
    stop_ids = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(sp._all_stop_token_ids))
    if out[-1] in stop_ids:
        return False
    return req_state.num_tokens < max_model_len


def install_runner_hooks() -> None:
    """Wrap the V1 model runner (once per process; called at model build in the worker)."""
    global _installed
    if _installed:
        return
    check_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("_model_forward", "_on_request_state_removed"):
        if not callable(getattr(GPUModelRunner, name, None)):
            raise RuntimeError(f"trace_fp4: vLLM {vllm.__version__} GPUModelRunner has no {name}()")

    orig_forward = GPUModelRunner._model_forward
    orig_removed = GPUModelRunner._on_request_state_removed

    def _model_forward(self, *args, **kwargs):
        if not STORE.capturing or self.vllm_config.quant_config is not STORE.owner:
            return orig_forward(self, *args, **kwargs)
        batch = self.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        STORE.begin_step(
            StepLayout(
                req_ids=req_ids,
                query_start_loc=self.query_start_loc.np[: n + 1].tolist(),
                start_positions=batch.num_computed_tokens_cpu[:n].tolist(),
                # CachedRequestState.prompt_token_ids (references, no copies): serves prefix-cache hits.
                prompt_ids=[self.requests[r].prompt_token_ids for r in req_ids] if STORE.serve_prefix_hits else None,
            )
        )
        try:
            out = orig_forward(self, *args, **kwargs)
        except BaseException:
            STORE.step = None
            raise
        STORE.end_step()
        STORE.count("steps")
        return out

    def _on_request_state_removed(self, req_id, req_state):
        if self.vllm_config.quant_config is STORE.owner:
            STORE.finish(req_id, aborted=_was_aborted(req_state, self.max_model_len))
        return orig_removed(self, req_id, req_state)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._on_request_state_removed = _on_request_state_removed
    _installed = True


def install_worker_rpc() -> None:
    """Add the record RPC methods to vLLM's worker wrapper (every process; cheap)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from trace_vllm_plugin import worker_rpc

    for name in ("trace_fp4_take_records", "trace_fp4_stats", "trace_fp4_discard_records", "trace_fp4_set_weights_version"):
        existing = WorkerWrapperBase.__dict__.get(name)
        if existing is not None and existing is not getattr(worker_rpc, name):
            raise RuntimeError(f"trace_fp4: WorkerWrapperBase.{name} already exists in this vLLM")
        setattr(WorkerWrapperBase, name, getattr(worker_rpc, name))
