"""verl's vLLM rollout server with TRACE: each request's guidance record goes to the store, its handle
into `TokenOutput.extra_fields[HANDLE_FIELD]` (-> non_tensor_batch -> the trainer's micro-batches).

Registered as replica "vllm" (verl compares the name), so `rollout.name=vllm` picks it up; without the
TRACE keys it behaves exactly as verl's own server.
"""

import logging
import os
import time
from types import SimpleNamespace

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from .settings import HANDLE_FIELD, TraceConfigError, rollout_settings
from .store import open_configured_store
from .trajectories import TrajectoryRecords

logger = logging.getLogger(__name__)


class TraceVLLMHttpServer(vLLMHttpServer):
    def _validate_configs(self) -> None:
        super()._validate_configs()
        # Refuse a half or conflicting TRACE config before vLLM starts (minutes on a big model).
        self.trace = rollout_settings(self.config)
        self.trace_store = None
        self.trace_stats = {"records": 0, "record_bytes": 0, "take_seconds": 0.0}
        self.trace_trajectories = None
        if self.trace is not None:
            # The plugin hooks vLLM's V1 model runner (patches/vllm_v1_runner.py); with verl's engine args
            # vLLM 0.32 would pick Model Runner V2, which records nothing. The engine core and its workers
            # are child processes of this actor and inherit the setting.
            if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").lower() not in ("0", "false"):
                raise TraceConfigError(
                    "VLLM_USE_V2_MODEL_RUNNER is on: the trace_fp4 vLLM plugin hooks the V1 model runner only; unset it"
                )
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
            # Prefix caching stays on while capturing (unless the user set TRACE_FP4_PREFIX_CACHING): a
            # trajectory's next turn re-reads the earlier turns' KV blocks, and their rows come from the
            # capture that computed them (docs/engines.md); measured with `trace-fp4 align --turns`.
            os.environ.setdefault("TRACE_FP4_PREFIX_CACHING", "1")
            # Partial rollouts (fully async): a request aborted at a weight update keeps its rows, taken
            # below with its tokens so far and stitched with its continuation (this server takes or
            # discards every aborted request's rows, so none stay behind).
            os.environ.setdefault("TRACE_FP4_KEEP_ABORTED", "1")
            # verl 0.9.1 pauses vLLM with a keyword vLLM 0.32 no longer takes (patches/README.md).
            from trace_fp4_patches.verl_vllm_pause import install

            install()
            self.trace_store = open_configured_store(self.trace.store, where="actor_rollout_ref.rollout.custom.trace_fp4.store")
            self.trace_trajectories = TrajectoryRecords(self.trace_store)
            logger.info("trace_verl: TRACE rollout, records in %s, %s", self.trace.store, self.trace.trace_config.to_dict())

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        if self.trace is None:
            return out
        if not out.token_ids:  # aborted: free the capture; the trainer counts the sample as records_missing
            await self.engine.collective_rpc("trace_fp4_discard_records", args=([request_id],))
            return out
        import trace_vllm_plugin

        t0 = time.perf_counter()
        # The worker trims the record to prompt + generated - 1 rows and checks the count.
        done = SimpleNamespace(request_id=request_id, prompt_token_ids=list(prompt_ids),
                               outputs=[SimpleNamespace(token_ids=list(out.token_ids))])
        (record,) = await trace_vllm_plugin.get_records_async(self.engine, [done])
        record = _stamp_identity(record, list(prompt_ids), list(out.token_ids), self.global_steps)
        # A later turn of a trajectory (its prompt the trajectory so far) is stitched onto the
        # trajectory's record under the first turn's handle, the one verl keeps (trajectories.py).
        handle = self.trace_trajectories.put_turn(list(prompt_ids), list(out.token_ids), record)
        self.trace_stats["records"] += 1
        self.trace_stats["record_bytes"] += record.nbytes
        self.trace_stats["take_seconds"] += time.perf_counter() - t0
        out.extra_fields[HANDLE_FIELD] = handle
        return out

    async def set_global_steps(self, global_steps: int):
        await super().set_global_steps(global_steps)
        if self.trace is not None and global_steps is not None:
            # verl calls this right after a weight sync: records made from now on carry verl's step as
            # their weights version, the number the trainer compares (accept_stale, staleness metrics).
            await self.engine.collective_rpc("trace_fp4_set_weights_version", args=(global_steps,))

    def trace_requests_decoding(self) -> int:
        """Requests past their prefill (they have generated tokens): when an abort makes partial rollouts."""
        return sum(not s.is_prefilling for s in self.engine.output_processor.request_states.values())

    def trace_rollout_stats(self) -> dict:
        """Records put, their payload bytes and the time taken to take and store them, on this server."""
        out = dict(self.trace_stats)
        if self.trace_trajectories is not None:
            out.update(self.trace_trajectories.stats)
        return out


def _stamp_identity(record, prompt_ids, token_ids, weights_version):
    """Fill the identity fields the engine left empty with what this server sent and got back: the
    token ids of the record's rows (prompt + generated, without the last sampled token), the prompt
    length (the store keeps a GRPO group's prompt rows once) and verl's weights version (global_steps,
    set by the trainer at every weight sync)."""
    from trace_kernels import token_digest

    ident = record.identity
    fields = {}
    if ident.token_digest is None:
        fields["token_digest"] = token_digest((prompt_ids + token_ids)[: record.num_tokens])
        fields["num_tokens"] = record.num_tokens
    if ident.num_prompt_tokens is None:
        fields["num_prompt_tokens"] = len(prompt_ids)
    if ident.weights_version is None and weights_version is not None:
        fields["weights_version"] = weights_version
    return record.with_identity(**fields) if fields else record


class TraceVLLMReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(TraceVLLMHttpServer)


def load_replica():
    return TraceVLLMReplica
