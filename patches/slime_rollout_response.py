"""Let the caller of slime's SGLang `generate` see the /generate response it got.

slime's `slime.rollout.sglang_rollout.generate` posts the request to SGLang's /generate and copies into
its `Sample` only the meta_info fields it has a field for; `meta_info["trace_fp4"]` (the record's handle,
trace_sglang_plugin/transport.py) is dropped. slime offers no hook there. This wraps the module's `post`
(which `generate` looks up at call time) so that, inside `capture_responses()`, every response is also
appended to the caller's list. Each asyncio task has its own context, so concurrent samples never see
each other's responses; outside `capture_responses()` the wrapper only returns what `post` returned.

Supported: slime 0.3.1 (THUDM/slime 624b824), whose `generate` calls `post(url, payload, headers=...)`.
A source tree without package metadata is checked by that shape; anything else fails at the first use.
"""

import contextvars
import inspect
from contextlib import contextmanager

SUPPORTED_SLIME = ("0.3.1",)

_sink: contextvars.ContextVar = contextvars.ContextVar("trace_fp4_slime_responses", default=None)


def _check(sglang_rollout) -> None:
    from importlib import metadata

    try:
        version = metadata.version("slime")
    except metadata.PackageNotFoundError:
        version = None  # slime on PYTHONPATH (a source checkout): the shape below is the check
    if version is not None and version not in SUPPORTED_SLIME:
        raise RuntimeError(
            f"trace_fp4_patches.slime_rollout_response supports slime {', '.join(SUPPORTED_SLIME)}; this is "
            f"slime {version}"
        )
    generate = getattr(sglang_rollout, "generate", None)
    post = getattr(sglang_rollout, "post", None)
    if (generate is None or post is None or "post" not in generate.__code__.co_names
            or list(inspect.signature(post).parameters)[:2] != ["url", "payload"]):
        raise RuntimeError(
            "trace_fp4_patches.slime_rollout_response: slime.rollout.sglang_rollout.generate no longer posts "
            "through the module's post(url, payload, ...); this slime is not the one it was checked against"
        )


def install():
    """Wrap `slime.rollout.sglang_rollout.post` once; returns the module."""
    from slime.rollout import sglang_rollout

    if getattr(sglang_rollout.post, "__trace_fp4_wrapped__", False):
        return sglang_rollout
    _check(sglang_rollout)
    original = sglang_rollout.post

    async def post(url, payload, *args, **kwargs):
        out = await original(url, payload, *args, **kwargs)
        sink = _sink.get()
        if sink is not None:
            sink.append(out)
        return out

    post.__trace_fp4_wrapped__ = True
    post.__wrapped__ = original
    sglang_rollout.post = post
    return sglang_rollout


@contextmanager
def capture_responses():
    """`with capture_responses() as responses:` the /generate responses of this task, in order."""
    sink: list = []
    token = _sink.set(sink)
    try:
        yield sink
    finally:
        _sink.reset(token)
