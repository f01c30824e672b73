"""Version-checked hooks into vLLM's V1 model runner and worker (code we do not own).

vLLM has no extension point that tells a layer which request each row of the flattened batch belongs
to. The V1 runner (`GPUModelRunner`, which `CPUModelRunner` subclasses) knows it right before the
forward: `input_batch.req_ids` (batch order), `query_start_loc` (row ranges) and
`input_batch.num_computed_tokens_cpu` (each request's first position). We wrap two methods:

  `_model_forward`              documented as overridable; opens/closes a capture step around it
  `_on_request_state_removed`   "hook for platform runners"; marks the request's capture finished

and add the caller's RPC methods to `WorkerWrapperBase` (reached with `llm.collective_rpc("<name>")`,
which works in-process and with the multiprocess engine without pickling functions).

The patch knows nothing of who listens: `install_runner_hooks(listener_of)` takes a function that maps
a model runner to its listener (or None: run the runner untouched), an object with
  wants_prompt_ids                                   bool: pass each request's prompt token ids
  begin_step(req_ids, query_start_loc, start_positions, prompt_ids)   before the forward
  end_step() / abandon_step()                        after it / when it raised
  request_removed(req_id, aborted)                   the runner removed a request

Supported: vLLM 0.32.x with the V1 model runner (Model Runner V2 is not hooked). Any other version
fails loudly at model load instead of capturing wrong rows.
"""

import vllm

SUPPORTED_VLLM = ("0.32.",)
_listener_of = None  # runner -> listener or None; set once by install_runner_hooks


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


def install_runner_hooks(listener_of) -> None:
    """Wrap the V1 model runner (once per process; called at model build in the worker)."""
    global _listener_of
    if _listener_of is not None:
        if listener_of is not _listener_of:
            raise RuntimeError("trace_fp4: the V1 model-runner hooks are already installed for another listener")
        return
    check_version()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for name in ("_model_forward", "_on_request_state_removed"):
        if not callable(getattr(GPUModelRunner, name, None)):
            raise RuntimeError(f"trace_fp4: vLLM {vllm.__version__} GPUModelRunner has no {name}()")

    orig_forward = GPUModelRunner._model_forward
    orig_removed = GPUModelRunner._on_request_state_removed

    def _model_forward(self, *args, **kwargs):
        listener = listener_of(self)
        if listener is None:
            return orig_forward(self, *args, **kwargs)
        batch = self.input_batch
        n = batch.num_reqs
        req_ids = list(batch.req_ids[:n])
        listener.begin_step(
            req_ids,
            self.query_start_loc.np[: n + 1].tolist(),
            batch.num_computed_tokens_cpu[:n].tolist(),
            # CachedRequestState.prompt_token_ids (references, no copies).
            [self.requests[r].prompt_token_ids for r in req_ids] if listener.wants_prompt_ids else None,
        )
        try:
            out = orig_forward(self, *args, **kwargs)
        except BaseException:
            listener.abandon_step()
            raise
        listener.end_step()
        return out

    def _on_request_state_removed(self, req_id, req_state):
        listener = listener_of(self)
        if listener is not None:
            listener.request_removed(req_id, _was_aborted(req_state, self.max_model_len))
        return orig_removed(self, req_id, req_state)

    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner._on_request_state_removed = _on_request_state_removed
    _listener_of = listener_of


def install_worker_rpc(methods: dict) -> None:
    """Add RPC methods (name -> function taking the wrapper as `self`) to vLLM's worker wrapper
    (every process; cheap)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    for name, fn in methods.items():
        existing = WorkerWrapperBase.__dict__.get(name)
        if existing is not None and existing is not fn:
            raise RuntimeError(f"trace_fp4: WorkerWrapperBase.{name} already exists in this vLLM")
        setattr(WorkerWrapperBase, name, fn)
