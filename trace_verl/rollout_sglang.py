"""verl's SGLang rollout server with TRACE (the twin of rollout_vllm.py).

trace_sglang_plugin returns each response's record in `meta_info["trace_fp4"]`; verl's
`SGLangHttpServer.generate` reads meta_info itself and returns only a TokenOutput. So this server wraps
its tokenizer manager's `generate_request` once at launch to keep each finished request's payload by
request id (verl passes `rid=request_id`), and `generate` turns it into a record in the store and a
handle in `extra_fields`, exactly as the vLLM server does.

Not run on this CPU machine: verl's `async_sglang_server` does not even import here (SGLang's
multimodal utilities import torchvision, which the environment removes), and its scheduler
subprocesses need `sgl_kernel` (no CPU build; the repo's stand-in is test-only, tests/helpers/sglang_stubs).
"""

import logging
import time

from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

from .rollout_vllm import _stamp_identity
from .settings import HANDLE_FIELD, rollout_settings
from .store import open_configured_store

logger = logging.getLogger(__name__)


class TraceSGLangHttpServer(SGLangHttpServer):
    async def launch_server(self, *args, **kwargs):
        self.trace = rollout_settings(self.config)
        self.trace_store = None
        self.trace_stats = {"records": 0, "record_bytes": 0, "take_seconds": 0.0}
        self._trace_payloads: dict[str, dict] = {}
        if self.trace is not None:
            self.trace_store = open_configured_store(self.trace.store, where="actor_rollout_ref.rollout.custom.trace_fp4.store")
        result = await super().launch_server(*args, **kwargs)
        if self.trace is not None:
            self._wrap_generate_request()
        return result

    def _wrap_generate_request(self):
        from trace_sglang_plugin.transport import META_KEY

        manager = self.tokenizer_manager
        original = manager.generate_request
        payloads = self._trace_payloads

        async def generate_request(obj, request=None):
            async for out in original(obj, request):
                meta = out.get("meta_info", {}) if isinstance(out, dict) else {}
                if META_KEY in meta and meta.get("finish_reason") is not None:
                    payloads[str(getattr(obj, "rid", None))] = {META_KEY: meta.pop(META_KEY)}
                yield out

        manager.generate_request = generate_request

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        out = await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
        if getattr(self, "trace", None) is None:
            return out
        payload = self._trace_payloads.pop(str(request_id), None)
        if payload is None or not out.token_ids:  # aborted: counted by the trainer as records_missing
            return out
        from trace_sglang_plugin import record_from_meta_info

        t0 = time.perf_counter()
        record = record_from_meta_info(payload)
        prompt = [int(t) for t in prompt_ids]
        record = _stamp_identity(record, prompt, list(out.token_ids), self.global_steps)
        out.extra_fields[HANDLE_FIELD] = self.trace_store.put(record)
        self.trace_stats["records"] += 1
        self.trace_stats["record_bytes"] += record.nbytes
        self.trace_stats["take_seconds"] += time.perf_counter() - t0
        return out

    def trace_rollout_stats(self) -> dict:
        return dict(self.trace_stats)


class TraceSGLangReplica(SGLangReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(TraceSGLangHttpServer)


def load_replica():
    return TraceSGLangReplica
