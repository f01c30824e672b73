"""The weights identity a record carries: the engine's weights version and the digest of its expert weights.

Each routed-expert layer reports when it (re)quantized its expert weights. The version is the number
of weight updates since load (0 after load, +1 per update; the least-updated layer decides), unless the
RL driver named the weights with `set_version` (the next update clears that name, counted). The digest
is `trace_kernels.weight_digest.model_digest` over the layers' digests: the same function in every
engine, so records of either engine name the same weights the same way.

An RL sync may call only the model's `load_weights` (no after-loading step follows it), so a layer can
also report that its weights changed without a digest (`changed`): the new digest and version are
settled lazily, once per update, the next time the identity is read.
"""

import threading

from ..weight_digest import model_digest


class WeightsIdentity:
    def __init__(self, counters):
        self.counters = counters  # an EngineCounters (or any Counter)
        self.lock = threading.RLock()
        self.layer_digests: dict[int, str | None] = {}
        self.layer_versions: dict[int, int] = {}  # per layer: quantizations so far (1 at load)
        self._pending: dict = {}  # layer -> digest function, for updates not settled yet
        self.version_override = None
        self._digest = None
        # Per model digest, the layer digests it was made of (the latest few): a pipeline stage holds
        # some layers only, and the driver rebuilds the whole model's digest from every stage's layers.
        self._layers_of: dict[str, dict[int, str]] = {}

    def updated(self, layer: int, digest: str | None, version: int | None = None) -> None:
        """`layer` re-quantized its expert weights (`version`: how many times, 1 at load; default: one
        more than before). `digest` is None when the weights are not quantized (ablation)."""
        with self.lock:
            self._pending.pop(layer, None)
            if version is None:
                version = self.layer_versions.get(layer, 0) + 1
            self._set(layer, digest, version)

    def changed(self, layer: int, digest_fn) -> None:
        """An expert of `layer` was requantized by its weight loader; `digest_fn()` gives the new digest."""
        with self.lock:
            self._pending[layer] = digest_fn

    def set_version(self, version) -> None:
        with self.lock:
            self.version_override = version

    def _set(self, layer: int, digest: str | None, version: int) -> None:
        self.layer_digests[layer] = digest
        self.layer_versions[layer] = version
        self._digest = None
        if self.version_override is not None:
            self.version_override = None  # it named the previous weights; the update counter takes over
            self.counters["weights_version_override_cleared"] += 1

    def layers_of(self, digest: str | None) -> dict[int, str] | None:
        """The layer digests `digest` (a value `current()` returned) was computed from, or None."""
        with self.lock:
            layers = self._layers_of.get(digest)
            return None if layers is None else dict(layers)

    def _settle(self) -> None:
        pending, self._pending = self._pending, {}
        for layer, digest_fn in sorted(pending.items()):
            self._set(layer, digest_fn(), self.layer_versions.get(layer, 0) + 1)
            self.counters["weights_updates_settled_lazily"] += 1

    def current(self) -> tuple:
        """(weights version, expert-weights digest); (None, None) before any layer reported."""
        if self._pending:
            with self.lock:
                self._settle()
        if not self.layer_versions:
            return None, None
        if self._digest is None and all(d is not None for d in self.layer_digests.values()):
            self._digest = model_digest(self.layer_digests)
            self._layers_of[self._digest] = dict(self.layer_digests)
            while len(self._layers_of) > 8:
                self._layers_of.pop(next(iter(self._layers_of)))
        version = self.version_override
        if version is None:
            version = min(self.layer_versions.values()) - 1
        return version, self._digest
