"""verl's Megatron engine with TRACE: the trace decoder-block spec, and every forward guided.

`TraceMegatronEngineWithLMHead` replaces verl's `MegatronEngineWithLMHead` in `EngineRegistry` (same
model type, backend and devices), so `actor.strategy=megatron` picks it up. Without the trainer-side key
(`actor.megatron.override_mcore_model_config.trace_fp4`) it is verl's engine unchanged (the reference
policy has its own `ref.megatron` section, so it stays unguided: its weights are not the rollout's).

With it, each `forward_step` (compute_log_prob and the training forward alike):
  1. reads the micro-batch's handles (`non_tensor_batch[HANDLE_FIELD]`, aligned with the samples after
     verl's dynamic-batch rearrangement) and resolves only this rank's samples from the store,
  2. opens `trace_megatron.guidance` around the model call with a layout built from the packed sequence
     params verl's forward passes the model, and checks each record against its sample's tokens,
  3. adds `trace_fp4/*` counters to the micro-batch's metrics (metrics.py).
"""

import logging
from functools import partial

import torch

from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

from .guided import GuidedForward
from .metrics import verl_metrics
from .ranks import model_parallel_rank0
from .records import RecordCache, handles_of, record_staleness
from .settings import HANDLE_FIELD, TraceConfigError, trainer_settings

logger = logging.getLogger(__name__)


def trace_layer_spec(trace_config):
    """A Megatron-Bridge `transformer_layer_spec` callable: the trace decoder-block spec for the provider."""
    import importlib.util

    import trace_megatron

    # Transformer Engine where it is installed (what verl's Megatron-Bridge models use on a GPU).
    use_te = importlib.util.find_spec("transformer_engine") is not None

    def spec(provider, vp_stage=None):
        return trace_megatron.get_gpt_decoder_block_with_trace_spec(
            provider, use_transformer_engine=use_te, normalization=getattr(provider, "normalization", None),
            vp_stage=vp_stage, trace_config=trace_config,
        )

    return spec


class TraceMegatronEngineWithLMHead(MegatronEngineWithLMHead):
    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        # Before verl's __init__: it installs its router-replay patch when R3 is on, which TRACE refuses.
        self.trace = trainer_settings(engine_config)
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._trace_init()
        if self.trace is not None:
            if not engine_config.use_remove_padding:
                raise TraceConfigError(
                    "TRACE needs verl's packed (THD) forward: set actor_rollout_ref.model.use_remove_padding=True"
                )
            logger.info("trace_verl: TRACE trainer, %s", self.trace.trace_config.to_dict())

    def _trace_init(self):
        store = getattr(self.trace, "store", None)  # the trainer-side config's store: the only one it reads
        self.trace_records = RecordCache(owner=model_parallel_rank0(), allowed=[store] if store else None)
        # Weight exports so far: verl labels the k-th export (from 0) with global_steps k, the version
        # the rollout stamps on the records it makes after it (rollout_vllm.py, set_global_steps).
        self.trace_exports = 0

    def _trace_export(self):
        self.trace_records.end_step()
        self.trace_exports += 1

    def trace_weights_version(self):
        """The version of the weights the trainer has now: the last export's (None before any)."""
        return self.trace_exports - 1 if self.trace_exports else None

    def _build_tf_config(self):
        super()._build_tf_config()
        if self.trace is None:
            return
        if self.provider is None:
            raise TraceConfigError("TRACE installs its layer spec through Megatron-Bridge; vanilla_mbridge is not supported")
        self.provider.transformer_layer_spec = trace_layer_spec(self.trace.trace_config)
        # The trace MoE layer replays the record's routes through Megatron's routing-replay hook.
        self.provider.moe_enable_routing_replay = True

    # verl exports the trainer's weights to the rollout once per step: the records training forwards
    # used are done then; the others wait for their training step (records.py).
    def get_per_tensor_param(self, *args, **kwargs):
        self._trace_export()
        return super().get_per_tensor_param(*args, **kwargs)

    def get_per_tensor_param_shard(self, *args, **kwargs):
        self._trace_export()
        return super().get_per_tensor_param_shard(*args, **kwargs)

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        trace = getattr(self, "trace", None)
        if trace is None:
            batch = next(batch_iter)
            if any(h is not None for h in handles_of(batch)):
                raise TraceConfigError(
                    "TRACE on the rollout only: the micro-batch carries guidance records "
                    f"({HANDLE_FIELD}) but the trainer has no TRACE config: set "
                    "actor_rollout_ref.actor.megatron.override_mcore_model_config.trace_fp4"
                )
            return super().forward_step(iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)
        handles = handles_of(batch)
        input_ids = batch["input_ids"]
        if not handles or all(h is None for h in handles):
            raise TraceConfigError(
                "TRACE on the trainer only: this micro-batch has no guidance records "
                f"({HANDLE_FIELD} missing); the rollout must run trace_fp4 with a store "
                "(actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides.quantization_config, rollout.custom.trace_fp4.store)"
            )
        # A training forward (update_actor) runs with autograd on; compute_log_prob under no_grad.
        records, resolve = self.trace_records.resolve(handles, training=torch.is_grad_enabled())
        token_ids = [t.cpu() for t in input_ids.unbind()] if input_ids.is_nested else [t.cpu() for t in input_ids]
        version = self.trace_weights_version()
        staleness, stale_tokens = record_staleness(records, version, accept_stale=trace.accept_stale,
                                     max_staleness=trace.max_staleness, sources=[f"sample {i} ({h})" for i, h in enumerate(handles)])
        with GuidedForward(model, records, token_ids, weights_version=version, accept_stale=trace.accept_stale) as guided:
            output, post = super().forward_step(iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        metrics = verl_metrics(guided.trace_metrics(), records, resolve, staleness=staleness, stale_tokens=stale_tokens)
        return output, partial(_with_metrics, post, metrics)


def _with_metrics(post, metrics, *args, **kwargs):
    result = post(*args, **kwargs)
    result[-1].setdefault("metrics", {}).update(metrics)
    return result


def register_engine() -> None:
    """Put the TRACE engine where verl's registry keeps MegatronEngineWithLMHead (every device key)."""
    from verl.workers.engine.base import EngineRegistry

    table = EngineRegistry._engines.get("language_model", {}).get("megatron", {})
    keys = [k for k, cls in table.items() if cls is MegatronEngineWithLMHead]
    if not keys and not any(cls is TraceMegatronEngineWithLMHead for cls in table.values()):
        raise RuntimeError("trace_verl: verl's EngineRegistry has no MegatronEngineWithLMHead to extend")
    for k in keys:
        table[k] = TraceMegatronEngineWithLMHead
