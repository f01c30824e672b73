"""Cheaper garbage collections around an in-process vLLM engine's start and stop (test helper).

Why: vLLM runs gc.collect() five times while an engine starts and three while it stops, and
vllm_helpers.shutdown one more. A full collection walks every object alive in the process: in the
pytest process (torch, vLLM, Megatron-Core, transformers, what earlier tests keep) that is 0.4-0.7 s on
2 cores, ~5 s per engine. `freeze()` collects once and moves every survivor into the permanent
generation (gc.freeze), so the engine's own collections walk only the objects made since, the engine's;
`thaw()` (after the engine is stopped) puts them back, so nothing stays out of reach of later
collections. The engine's garbage is younger than the freeze and is collected as before; garbage among
older objects waits until the thaw's next collection.
"""

import gc


def freeze() -> None:
    gc.collect()  # first: garbage made before the engine is not frozen
    gc.freeze()


def thaw() -> None:
    gc.unfreeze()
