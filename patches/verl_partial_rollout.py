"""Keep the record handle of a partial rollout's sample in verl's fully async client.

verl's `FullyAsyncLLMServerClient.generate` (fully async policy, partial rollout) calls the server once
per attempt: an attempt aborted at a weight update returns the tokens so far, the next attempt sends
prompt + those tokens to continue under the new weights. It merges the attempts' tokens, log-probs and
routes into a fresh `TokenOutput` whose `extra_fields` it rebuilds with its own keys only, so the
server's `extra_fields[<handle field>]` (the sample's guidance record handle) is dropped. verl has no
hook there. This wraps:

  - `LLMServerClient.generate` (which the fully async client's loop reaches through `super()` at call
    time): inside a fully async `generate`, each attempt's handle is handed to that call's context;
  - `FullyAsyncLLMServerClient.generate`: the last attempt's handle goes into the merged output. The
    TRACE server stitches every attempt of a request onto the first one's record under one handle
    (trace_verl/trajectories.py), so the last handle holds the whole sample with each token's version.

Each asyncio task has its own context, so concurrent samples never see each other's handles; outside a
fully async `generate` the wrapper returns what verl returned, untouched.

Supported: verl 0.9.1, whose fully async `generate` calls `super().generate(...)` per attempt and
returns a `TokenOutput` with `extra_fields`; anything else fails at install.
"""

import contextvars
import functools
import inspect

SUPPORTED_VERL = ("0.9.1",)

_sink: contextvars.ContextVar = contextvars.ContextVar("trace_fp4_verl_attempt_handles", default=None)


def _check(llm_server) -> None:
    import verl

    version = getattr(verl, "__version__", "unknown")
    if version not in SUPPORTED_VERL:
        raise RuntimeError(
            f"trace_fp4_patches.verl_partial_rollout supports verl {', '.join(SUPPORTED_VERL)}; this is verl {version}"
        )
    client = getattr(llm_server, "FullyAsyncLLMServerClient", None)
    base = getattr(llm_server, "LLMServerClient", None)
    # verl decorates generate (rollout_trace_op, functools.wraps): the check reads the function it wraps.
    code = getattr(inspect.unwrap(getattr(client, "generate", None) or (lambda: None)), "__code__", None)
    if client is None or base is None or not issubclass(client, base) or code is None or "super" not in code.co_names:
        raise RuntimeError(
            "trace_fp4_patches.verl_partial_rollout: verl.workers.rollout.llm_server.FullyAsyncLLMServerClient.generate "
            "no longer calls LLMServerClient.generate per attempt; this verl is not the one it was checked against"
        )


def install(handle_field: str):
    """Wrap both `generate`s once (idempotent); returns verl's llm_server module."""
    from verl.workers.rollout import llm_server

    client, base = llm_server.FullyAsyncLLMServerClient, llm_server.LLMServerClient
    if getattr(client.generate, "__trace_fp4_wrapped__", False):
        return llm_server
    _check(llm_server)
    attempt, merged = base.generate, client.generate

    @functools.wraps(attempt)
    async def generate_attempt(self, *args, **kwargs):
        out = await attempt(self, *args, **kwargs)
        sink = _sink.get()
        if sink is not None and out.extra_fields.get(handle_field):
            sink.append(out.extra_fields[handle_field])
        return out

    @functools.wraps(merged)
    async def generate_merged(self, *args, **kwargs):
        handles = []
        token = _sink.set(handles)
        try:
            out = await merged(self, *args, **kwargs)
        finally:
            _sink.reset(token)
        if handles and handle_field not in out.extra_fields:
            out.extra_fields[handle_field] = handles[-1]
        return out

    generate_attempt.__trace_fp4_wrapped__ = True
    generate_merged.__trace_fp4_wrapped__ = True
    base.generate = generate_attempt
    client.generate = generate_merged
    return llm_server
