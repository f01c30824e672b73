"""Guide one micro-batch's forward, whatever verl's forward function does around the model call.

verl's `gptmodel_forward_model_engine` packs the micro-batch and calls the model with
`packed_seq_params`. `GuidedForward` hooks the (unwrapped) GPTModel: right before its forward it builds
the layout from exactly those `packed_seq_params`, builds the micro-batch's record tables
(`trace_megatron.prepare`) and opens `trace_megatron.guidance` with them; right after, it closes it
(backward and activation recompute reuse the guidance, as in trace_megatron).

    with GuidedForward(model, records, token_ids) as g:
        output = gptmodel_forward_model_engine(model, input_ids, ...)
    g.metrics()
"""

import inspect

import torch
import trace_megatron

from .layout import packed_layout


def _unwrap(model):
    m = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(m, "module") and not hasattr(m, "decoder"):
        m = m.module
    return m


class GuidedForward:
    def __init__(self, model, records: list, token_ids: list[torch.Tensor], *, weights_version=None,
                 accept_stale: bool = False):
        """`records[i]`: sample i's GuidanceRecord or None (missing: RTN, counted); `token_ids[i]`: the
        tokens the trainer runs for sample i (prompt + response), checked against the record's identity."""
        if len(records) != len(token_ids):
            raise ValueError(f"{len(records)} records for {len(token_ids)} samples")
        self.model = _unwrap(model)
        self.records = records
        self.token_ids = token_ids
        self.weights_version = weights_version
        self.accept_stale = accept_stale
        self.batches = []  # one TraceBatch per model call (one per micro-batch in verl)
        self._ctx = None
        self._hooks = []

    # -- hooks -----------------------------------------------------------------------------------
    def _open(self, module, args, kwargs):
        psp = kwargs.get("packed_seq_params")
        if psp is None or getattr(psp, "qkv_format", "thd") != "thd":
            raise RuntimeError(
                "trace_verl: the model was called without THD packed_seq_params; TRACE needs verl's packed path "
                "(actor_rollout_ref.model.use_remove_padding=True)"
            )
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        total = int(input_ids.shape[-1]) if input_ids is not None else int(psp.cu_seqlens_q_padded[-1])
        present = [i for i, r in enumerate(self.records) if r is not None]
        layout = packed_layout(psp, [None if r is None else r.num_tokens for r in self.records], total)
        records = [self.records[i] for i in present]
        kw = {}
        params = inspect.signature(trace_megatron.guidance).parameters
        if "token_ids" in params:  # records-travel: identity checked inside guidance
            kw["token_ids"] = [self.token_ids[i] for i in present]
            kw["weights_version"] = self.weights_version
            kw["accept_stale"] = self.accept_stale
        # Every record table built here, in one go before the model's first layer runs
        # (trace_megatron.prepare: the same tables the layers would build one by one inside the forward).
        # On a GPU trainer this host work then runs while the GPU still executes what was queued before
        # this call (the previous micro-batch's backward), not between this forward's kernel launches.
        # prepare checks shape, config and lengths as guidance does; guidance still checks the tokens and
        # weights of every record at this call.
        feed = trace_megatron.prepare(self.model, records, layout) if records else records
        self._ctx = trace_megatron.guidance(self.model, feed, layout, **kw)
        self.batches.append(self._ctx.__enter__())

    def _close(self, module, args, kwargs, output):
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def __enter__(self):
        self._hooks = [
            self.model.register_forward_pre_hook(self._open, with_kwargs=True),
            self.model.register_forward_hook(self._close, with_kwargs=True),
        ]
        return self

    def __exit__(self, exc_type, exc, tb):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        ctx, self._ctx = self._ctx, None
        if ctx is not None:  # the forward raised between the hooks
            ctx.__exit__(exc_type, exc, tb)
        return False

    def trace_metrics(self) -> dict[str, float]:
        """trace_megatron's counters of the model call (verl calls the model once per micro-batch)."""
        if len(self.batches) != 1:
            raise RuntimeError(f"trace_verl: expected one guided model call per micro-batch, saw {len(self.batches)}")
        return self.batches[0].metrics()
