"""Handles are untrusted input (docs/record-format.md, "Trust"): they cross processes and machines
inside batches, so a handle is checked before it opens, reads, moves or deletes anything.

  keys          exactly what `put` makes (32 lowercase hex digits, a uuid4); anything else is refused
  prompt parts  a record's reference to its shared prompt part is "prompt-" + 64 lowercase hex digits
                (a SHA-256) and names a part of the same store (stores never hold paths)
  stores        a handle resolves only against an explicit set of allowed stores (its spec must be one
                of them); the error names the handle and the allowed stores
"""

import re
import threading

from ..records import RecordError

KEY_RE = re.compile(r"[0-9a-f]{32}")
PROMPT_KEY_RE = re.compile(r"prompt-[0-9a-f]{64}")
NAMESPACE_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # a ray namespace is a name, never a path or another spec
MAX_HANDLE_CHARS = 4096  # a real handle is a spec plus 33 characters; longer ones are refused unparsed


_allowed: set[str] = set()  # canonical specs of the stores this process opened to write or allowed
_lock = threading.Lock()


def remember(spec: str) -> None:
    """A store this process configured (opened to write, or named by `stores.allow`): its handles resolve."""
    with _lock:
        _allowed.add(spec)


def remembered() -> frozenset[str]:
    with _lock:
        return frozenset(_allowed)


def check_key(key, handle) -> str:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise RecordError(f"{shown(handle)}: bad key {shown(key)} in record handle (expected the 32 hex digits `put` makes)")
    return key


def check_spec(spec, handle) -> str:
    """The store part of a handle: 'file:' and an absolute path, or 'ray:' and a namespace name.
    Whether it is an allowed store is `check_allowed`'s question."""
    ok = "\0" not in spec and (spec.startswith("file:/") or
                                (spec.startswith("ray:") and NAMESPACE_RE.fullmatch(spec[len("ray:"):])))
    if not ok:
        raise RecordError(f"{shown(handle)}: bad store {shown(spec)} in record handle "
                          "(expected 'file:/<abs dir>' or 'ray:<namespace>': letters, digits, '_', '.', '-')")
    return spec


def check_prompt_key(key, handle) -> str:
    """A stored record's prompt-part reference: a digest, never a path or another store's name."""
    if not isinstance(key, str) or not PROMPT_KEY_RE.fullmatch(key):
        raise RecordError(f"{shown(handle)}: bad prompt-part reference {shown(key)} in the stored record "
                          "(expected 'prompt-' and 64 hex digits, a part of the same store)")
    return key


def check_allowed(handle, spec: str, allowed) -> None:
    """RecordError unless `spec` (the handle's store) is one of `allowed` (canonical specs)."""
    if spec not in allowed:
        names = ", ".join(sorted(allowed)) or "none"
        raise RecordError(f"{shown(handle)}: handle of store {shown(spec)}, which is not an allowed store "
                          f"(allowed: {names}); see docs/record-format.md, 'Trust'")


def shown(value) -> str:
    """repr, cut short: an error must name the handle but never print megabytes of it."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:160]}...({len(text)} chars)"
