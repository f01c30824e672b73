"""RayStore: records in Ray's object store (what verl and slime already run on).

Ownership: an ObjectRef's object dies with the process that owns it, and a rollout worker may exit
before the trainer reads its records. So every record is owned by one named, detached actor per
namespace (`trace_fp4_record_owner`, created on first use, 0 CPUs): the writer sends the bytes to the
actor, which `ray.put`s them itself, so the actor owns the object (Ray 2.56 removed `ray.put(...,
_owner=)`, the one-copy way to give an object to another owner; this way the bytes pass through the
object store twice at put, once at get). The actor outlives every worker and driver
until `ray.kill` or the cluster ends; it keeps the counters (put, taken, deleted, outstanding) for the
whole namespace. Ray is imported lazily, so trace_kernels works without it; a process that has not
called `ray.init` connects to the running cluster (`ray.init(address="auto")`).
"""

from ..records import RecordError
from .base import RecordStore
from .trust import NAMESPACE_RE, remember

OWNER_NAME = "trace_fp4_record_owner"


def _ray():
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("trace_kernels.stores: the ray store needs `pip install ray` (trace-fp4[ray])") from e
    if not ray.is_initialized():
        ray.init(address="auto", log_to_driver=False)
    return ray


class _Owner:
    """Holds the ObjectRefs (wrapped in lists so Ray does not resolve them) and the counters."""

    def __init__(self):
        self.refs = {}
        self.prefix_refs = {}  # prompt key -> [ObjectRef] ; users: prompt key -> set of record keys
        self.users = {}
        self.counts = {"put": 0, "taken": 0, "deleted": 0}

    def add(self, key, data):
        import ray

        self.refs[key] = ray.put(data)  # owned by this actor
        self.counts["put"] += 1

    def take(self, key, consume):
        ref = self.refs.pop(key, None) if consume else self.refs.get(key)
        if ref is None:
            return None
        if consume:
            self.counts["taken"] += 1
        return [ref]

    def note_deleted(self):
        self.counts["taken"] -= 1
        self.counts["deleted"] += 1

    def use_prefix(self, pkey, rkey):
        self.users.setdefault(pkey, set()).add(rkey)
        return pkey in self.prefix_refs

    def set_prefix(self, pkey, data):
        import ray

        if pkey not in self.prefix_refs:
            self.prefix_refs[pkey] = ray.put(data)

    def get_prefix(self, pkey):
        ref = self.prefix_refs.get(pkey)
        return None if ref is None else [ref]

    def release_prefix(self, pkey, rkey):
        users = self.users.get(pkey, set())
        users.discard(rkey)
        if not users:
            self.users.pop(pkey, None)
            self.prefix_refs.pop(pkey, None)

    def stats(self):
        return {**self.counts, "outstanding": len(self.refs), "prompt_parts": len(self.prefix_refs)}


class RayStore(RecordStore):
    """`create=False` (a store opened to read) never starts the namespace's owner actor: a reader that
    names a namespace nobody put into gets RecordError."""

    def __init__(self, namespace: str = "trace_fp4", *, share_prefixes: bool = True, create: bool = True,
                 read_only: bool = False):
        super().__init__(share_prefixes=share_prefixes, read_only=read_only)
        if not isinstance(namespace, str) or not NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"bad ray store namespace {namespace!r} (letters, digits, '_', '.', '-'; at most 128)")
        self.namespace = namespace
        self.spec = f"ray:{namespace}"
        self.create = False
        self._owner = None
        if create and not read_only:
            self.ensure_writable()

    def ensure_writable(self) -> None:
        self.create = True  # opened to write as well: the owner actor may be started
        remember(self.spec)  # a store this process writes to is one it configured

    @property
    def owner(self):
        if self._owner is None:
            ray = _ray()
            if not self.create:
                try:
                    self._owner = ray.get_actor(OWNER_NAME, namespace=self.namespace)
                except ValueError:
                    raise RecordError(f"no record store in ray namespace {self.namespace!r} (nothing was put there; "
                                      "nothing was started)") from None
                return self._owner
            actor = ray.remote(num_cpus=0)(_Owner)
            self._owner = actor.options(
                name=OWNER_NAME, namespace=self.namespace, lifetime="detached", get_if_exists=True
            ).remote()
        return self._owner

    def _write(self, key: str, data: bytes) -> None:
        _ray().get(self.owner.add.remote(key, data))

    def _read(self, key: str, handle: str, *, consume: bool) -> bytes:
        ray = _ray()
        got = ray.get(self.owner.take.remote(key, consume))
        if got is None:
            raise RecordError(f"{handle}: no such record in ray namespace {self.namespace!r} (already taken or deleted, or never put)")
        return bytes(ray.get(got[0]))

    def delete(self, handle: str) -> None:
        super().delete(handle)
        _ray().get(self.owner.note_deleted.remote())  # counted as deleted, not taken

    def _put_prefix(self, prefix_key: str, data: bytes, record_key: str) -> bool:
        ray = _ray()
        if ray.get(self.owner.use_prefix.remote(prefix_key, record_key)):
            return True
        ray.get(self.owner.set_prefix.remote(prefix_key, data))
        return False

    def _read_prefix(self, prefix_key: str, handle: str) -> bytes:
        ray = _ray()
        got = ray.get(self.owner.get_prefix.remote(prefix_key))
        if got is None:
            raise RecordError(f"{handle}: its prompt part {prefix_key} is not in ray namespace {self.namespace!r}")
        return bytes(ray.get(got[0]))

    def _release_prefix(self, prefix_key: str, record_key: str) -> None:
        _ray().get(self.owner.release_prefix.remote(prefix_key, record_key))

    def _outstanding(self) -> int:
        return _ray().get(self.owner.stats.remote())["outstanding"]

    def stats(self) -> dict:
        out = super().stats()
        # The namespace's own counts (every process): what an RL driver logs.
        out["store"] = _ray().get(self.owner.stats.remote())
        return out
