"""Spec-time substitutions that are not what the user literally asked for (each also warns).

One counter per spec build, shared by the layers built from it: TraceMoELayer keeps it, and the batch of
a model reports it with its metrics (`trace/spec/<name>`), so a substitution is never silent and never
leaks into another model's figures.
"""


class SpecFallbacks(dict):
    NAMES = ("grouped_gemm_experts_as_sequential",)

    def __init__(self):
        super().__init__({name: 0 for name in self.NAMES})


def model_spec_fallbacks(modules) -> SpecFallbacks:
    """The substitutions counted for the specs the given trace modules were built from (summed over the
    distinct counters, e.g. layer specs built one by one)."""
    total = SpecFallbacks()
    seen = set()
    for m in modules:
        counter = getattr(m, "spec_fallbacks", None)
        if counter is None or id(counter) in seen:
            continue
        seen.add(id(counter))
        for name, n in counter.items():
            total[name] = total.get(name, 0) + n
    return total


def spec_fallbacks_of(spec) -> SpecFallbacks | None:
    """The counter a layer spec or decoder block spec carries (None: no routed-expert layer)."""
    layer_specs = getattr(spec, "layer_specs", None) or [spec]
    for layer_spec in layer_specs:
        mlp = getattr(layer_spec.submodules, "mlp", None)
        counter = getattr(mlp, "keywords", {}).get("spec_fallbacks")
        if counter is not None:
            return counter
    return None
