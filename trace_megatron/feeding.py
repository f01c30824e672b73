"""Feeding guidance to a model built with the trace spec: one `with` block per micro-batch forward.

    with trace_megatron.guidance(model, records, layout) as batch:
        output = model(input_ids, position_ids, attention_mask)      # unchanged forward
    loss.backward()                                                   # recompute reuses `batch`
    logger.log(batch.metrics())

`records` holds one `trace_kernels.GuidanceRecord` per sample of this rank's micro-batch; `layout`
(`TokenLayout.padded(...)` or `.packed(...)`) says where each sample's tokens are. `capture(...)` runs the
same forward in round-to-nearest and keeps the codes it computed (tests, debugging, or a trainer-side
reference); `batch.build_records()` turns them into records.
"""

from contextlib import contextmanager

import torch
from trace_kernels import GuidanceRecord, check_identity, stores
from trace_kernels.identity import stale_rows

from .batch import TraceBatch
from .binding import pop_active, push_active
from .layout import TokenLayout
from .prepared import PreparedRecords, prepare_tables
from .spec_fallbacks import model_spec_fallbacks
from .specs import model_shape


def _modules(model) -> list:
    """Every module of `model` (a module or a list of chunks), each chunk's in `Module.modules()`'s order
    (pre-order, a module shared within a chunk once). Walked afresh on every `guidance` / `prepare` call,
    never cached, so a module swapped in or out after the first step is always seen. A list built from
    `_modules` directly: `modules()` is a generator per module that builds a dotted name per module nobody
    here reads (~100 us a call for the bench's 177 modules on the loaded 2-core host, this loop ~50 us)."""
    models = model if isinstance(model, (list, tuple)) else [model]
    out = []
    for root in models:
        seen, stack = set(), [root]
        while stack:
            m = stack.pop()
            if id(m) in seen:  # modules() keeps a memo of the modules it yielded (identity hash): same rule
                continue
            seen.add(id(m))
            out.append(m)
            children = m._modules
            if children:
                stack.extend(reversed([c for c in children.values() if c is not None]))
    return out


_IS_TRACE: dict[type, bool] = {}  # module class -> whether it is a trace module (a class's bases never change)


def _is_trace_module(m) -> bool:
    # isinstance against the two ABCMeta classes costs ~0.3 us a module (their __instancecheck__); a
    # model has a few dozen classes, so each is asked once per process
    kind = type(m)
    known = _IS_TRACE.get(kind)
    if known is None:
        from .attention import KVQuantMixin
        from .mla import TraceMLASelfAttention
        from .moe_layer import TraceMoELayer

        known = _IS_TRACE[kind] = issubclass(kind, (TraceMoELayer, KVQuantMixin, TraceMLASelfAttention))
    return known


def trace_modules(model) -> list:
    return [m for m in _modules(model) if _is_trace_module(m)]


def _model_info(model):
    mods = trace_modules(model)
    if not mods:
        raise ValueError("trace_megatron: this model has no trace modules; build it with get_gpt_*_with_trace_spec")
    config = mods[0].trace_config
    if any(m.trace_config != config for m in mods):
        raise ValueError("trace_megatron: the model's layers were built with different TraceConfigs")
    return mods, model_shape(mods[0].config), config


def _device(model):
    models = model if isinstance(model, (list, tuple)) else [model]
    for m in (m for root in models for m in root.modules()):  # lazily: the first module with a parameter ends it
        for p in m.parameters(recurse=False):
            return p.device
    return torch.device("cpu")


@contextmanager
def _open(model, batch: TraceBatch, mods: list, check_inputs: bool = False):
    # `mods`: the model's trace modules (trace_modules), which the caller walked the model for already
    will_recompute = torch.is_grad_enabled() and any(
        getattr(getattr(m, "config", None), "recompute_granularity", None) for m in mods
    )
    hooks = _input_token_checks(model, batch) if check_inputs else []
    push_active(batch)
    try:
        yield batch
    finally:
        pop_active(batch)
        for h in hooks:
            h.remove()
        batch.close(will_recompute=will_recompute)


def _whole_tokens(flat: torch.Tensor, layout):
    """sample -> its token ids in order. A context-parallel shard holds part of each sample: the CP
    ranks' ids and layouts are gathered first (a record's digest covers the whole sample)."""
    sample, token = layout.sample, layout.token
    if layout.is_shard:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
        parts = []
        for t in (flat, sample, token):
            out = [torch.empty_like(t) for _ in range(group.size())]
            torch.distributed.all_gather(out, t.contiguous(), group=group)
            parts.append(torch.cat(out))
        flat, sample, token = parts

    def tokens_of(i: int) -> torch.Tensor:
        pos = torch.nonzero(sample == i).flatten()
        return flat[pos[torch.argsort(token[pos])]]

    return tokens_of


def _input_token_checks(model, batch: TraceBatch) -> list:
    """Check the records' token digests against the `input_ids` the model is called with (GPTModel's
    first argument; a pipeline stage without it checks nothing and counts that)."""

    def check(module, args, kwargs):
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is None or batch.record_counts.get("tokens_checked"):
            if ids is None:
                batch.record_counts["tokens_unchecked"] = len(batch.records)
            return
        # Flat position p = s * B + b (layout.py), input_ids is [B, S].
        flat = ids.detach().t().reshape(-1).cpu()
        if flat.numel() != batch.layout.num_positions:
            return  # the layout check in the layers reports this with its own message
        tokens_of = _whole_tokens(flat, batch.layout)
        unchecked = 0
        for i, rec in enumerate(batch.records):
            if rec.identity.token_digest is None:
                unchecked += 1  # made without token ids (e.g. a capture without token_ids): counted
                continue
            check_identity(rec, source=f"record of sample {i}", token_ids=tokens_of(i))
        batch.record_counts["tokens_checked"] = len(batch.records) - unchecked
        batch.record_counts["tokens_unchecked"] = unchecked

    models = model if isinstance(model, (list, tuple)) else [model]
    hooks = [m.register_forward_pre_hook(check, with_kwargs=True) for m in models if hasattr(m, "embedding")]
    if not hooks:
        # A later pipeline stage (no embedding, no input_ids): the first stage checks the tokens.
        batch.record_counts["tokens_unchecked"] = len(batch.records)
    return hooks


def guidance(model, records: "list[GuidanceRecord] | PreparedRecords", layout: TokenLayout, *, token_ids=None, weights_version=None,
             weights_digest: str | None = None, accept_stale: bool = False, allowed_stores=None):
    """Guide this micro-batch's forward by `records` (one per sample, in layout order): GuidanceRecords,
    or record handles (`trace_kernels.stores`), which are taken from their store here: only from
    `allowed_stores` (specs or stores; default the process's, `stores.allowed_stores()`), any other
    store's handle is refused (docs/record-format.md, "Trust").

    `records` may be a `PreparedRecords` (`prepare(...)`): its tables, built ahead, are reused.

    Before anything runs, every record is checked against what the trainer is about to run; a record
    that does not belong raises `trace_kernels.RecordError` naming the sample index and the field:
      shape / config  the model's shape and the spec's TraceConfig (always)
      length          the record holds T rows (every token but the last sampled one); the sample's
                      tokens in `layout` must be T or T + 1 (always; a 3-row record for a 12-token
                      sample is refused)
      tokens          with `token_ids` (one sequence of ids per sample: lists or 1-D tensors, the
                      tokens the trainer runs): their first T ids must give the record's token digest
                      (a record without a digest is refused). Without `token_ids` the check reads the
                      `input_ids` the model (a GPTModel with its embedding) is called with, at the
                      forward; records without a digest, or a pipeline stage that gets no input_ids,
                      are counted as `trace/records/tokens_unchecked`, never skipped silently.
      weights         with `weights_version` (and / or `weights_digest`): the record's must match.
                      `accept_stale=True` accepts records of an older version (async / off-policy RL);
                      each one is counted in `batch.metrics()["trace/records/stale_weights"]`.
    """
    mods, shape, config = _model_info(model)
    tables = None
    if isinstance(records, PreparedRecords):  # tables built ahead (prepare): checked to be this batch's, reused
        records.check_batch(shape, config, layout, _device(model))
        records, tables = list(records.records), records.tables
    records = _resolve(records, allowed_stores, "guidance")
    if token_ids is not None and len(token_ids) != len(records):
        raise ValueError(f"{len(token_ids)} token id sequences for {len(records)} records (one per sample)")
    stale = 0
    for i, rec in enumerate(records):
        verdict = check_identity(
            rec, source=f"record of sample {i}", token_ids=None if token_ids is None else token_ids[i],
            weights_version=weights_version, weights_digest=weights_digest, accept_stale=accept_stale,
        )
        stale += verdict == "stale"
    batch = TraceBatch(shape, config, layout, list(records) if tables is None else tables.records, device=_device(model),
                       spec_fallbacks=model_spec_fallbacks(mods), tables=tables)  # _model_info's walk: one per micro-batch
    batch.record_counts.update(
        checked=len(records), tokens_checked=len(records) if token_ids is not None else 0, tokens_unchecked=0,
        stale_weights=stale,
        # Tokens made by older weights than the trainer's: of stale records, and a partial rollout's
        # tokens from before its weight update (its newer ones follow the trainer's version).
        stale_tokens=sum(stale_rows(r, weights_version) for r in records),
    )
    return _open(model, batch, mods, check_inputs=token_ids is None)


def prepare(model, records: list[GuidanceRecord], layout: TokenLayout, *, allowed_stores=None) -> PreparedRecords:
    """Build every table `guidance` reads from `records` (one per sample, in `layout` order) now, once: pass
    the result to `guidance(model, prepared, layout)` in place of the records, in as many forwards as run
    on them (old log-probs, the update, PPO epochs), or build it ahead in a data loader (prepared.py). The
    records are checked against the model and layout here as `guidance` checks them; `guidance` still runs
    its identity checks (tokens, weights) at every forward, and refuses a prepared object made for another
    model shape, TraceConfig or layout. No decode is prepared: a sparse site decodes in every forward."""
    _, shape, config = _model_info(model)
    records = _resolve(records, allowed_stores, "prepare")
    return prepare_tables(shape, config, layout, records, _device(model))


def _resolve(records, allowed_stores, who: str) -> list[GuidanceRecord]:
    if isinstance(records, (list, tuple)):
        # Handles (trace_kernels.stores) are resolved here, by the rank that runs these samples.
        records = [stores.get(r, allowed=allowed_stores) if stores.is_handle(r) else r for r in records]
    if not isinstance(records, (list, tuple)) or not all(isinstance(r, GuidanceRecord) for r in records):
        raise TypeError(f"trace_megatron.{who} needs a list of trace_kernels.GuidanceRecord (or record handles), one per sample")
    return records


def capture(model, layout: TokenLayout, *, perturb=None, records: list[GuidanceRecord] | None = None,
            keep_values: bool = False):
    """Run the forward and keep, per layer and site, the codes it computed by token position.

    Without `records` that is round-to-nearest (what an engine with the same weights captures). With
    `records` it is the guided result. `perturb(x) -> x'` captures RTN(x') instead (a second engine's
    slightly different numerics, for tests). `batch.build_records(config)` encodes per-sample records.
    `keep_values` also keeps each row's unquantized input (`batch.captured_values`), so an analysis
    can ask which rollout codewords were within reach (`trace_kernels.adjacent`)."""
    mods, shape, config = _model_info(model)
    batch = TraceBatch(shape, config, layout, list(records) if records else None, capture=True,
                       keep_values=keep_values, perturb=perturb, device=_device(model),
                       spec_fallbacks=model_spec_fallbacks(mods))
    return _open(model, batch, mods)


def clear_pending(model) -> None:
    """Forget guidance kept for recompute (e.g. after a forward whose backward never ran)."""
    for m in trace_modules(model):
        m.binding.clear()
