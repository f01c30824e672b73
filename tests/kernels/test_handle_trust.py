"""Record handles are untrusted input (docs/record-format.md, "Trust"): a handle resolves only against
the allowed stores, its key is what `put` makes, reading creates nothing, and nothing outside an allowed
store is ever moved or deleted. A fuzz test throws hostile handle strings at `get`, `delete` and `peek`
and compares a snapshot of the whole temporary tree before and after each."""

import hashlib
import os
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

import trace_kernels as tk
from record_factory import captured_builder
from trace_kernels import stores
from trace_kernels.stores import prefix as _prefix

FULL = tk.TraceConfig(guidance="full", guided_layers="all")


def _record(prompt=None, steps=(5, 1, 1)):
    b = captured_builder(FULL, steps=steps, seed=0)
    b.set_identity(token_ids=list(range(sum(steps))), num_prompt_tokens=prompt, weights_version=1)
    return b.build()


def _snapshot(root) -> dict:
    """Every path under root with its kind and content digest: any create, move, delete or write shows."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        out[dirpath] = "dir"
        for name in filenames:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


def _foreign(directory, record) -> str:
    """A record another process wrote into a store this process never opened: its handle."""
    os.makedirs(directory, exist_ok=True)
    key = uuid.uuid4().hex
    with open(os.path.join(directory, f"{key}.rec"), "wb") as f:
        f.write(record.to_bytes())
    return stores.make_handle(f"file:{os.path.realpath(directory)}", key)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/allowed (the trainer's store, one record in it) and root/victim (someone else's records)."""
    root = tmp_path_factory.mktemp("trust")
    rec = _record()
    allowed = stores.LocalStore(root / "allowed")
    mine = allowed.put(rec)
    victim = _foreign(root / "victim", rec)
    return {"root": str(root), "allowed": allowed, "mine": mine, "victim": victim, "victim_key": victim.rsplit("#", 1)[1]}


# ---- focused rules -------------------------------------------------------------------------------

def test_a_handle_of_a_store_that_is_not_allowed_is_refused_naming_it_and_the_allowed_stores(tree):
    before = _snapshot(tree["root"])
    for call in (lambda h: stores.get(h, allowed=[tree["allowed"]]), lambda h: stores.delete(h, allowed=[tree["allowed"]]),
                 stores.get, stores.delete):
        with pytest.raises(tk.RecordError, match="not an allowed store") as e:
            call(tree["victim"])
        assert tree["victim"] in str(e.value) and "allowed:" in str(e.value)
    assert tree["allowed"].spec in str(_refusal(lambda: stores.get(tree["victim"], allowed=[tree["allowed"]])))
    assert _snapshot(tree["root"]) == before


def _refusal(fn) -> tk.RecordError:
    with pytest.raises(tk.RecordError) as e:
        fn()
    return e.value


def test_the_store_a_process_opened_or_allowed_resolves(tree, tmp_path, monkeypatch):
    rec = _record()
    h = _foreign(tmp_path / "a", rec)
    with pytest.raises(tk.RecordError, match="not an allowed store"):
        stores.get(h, consume=False)
    assert stores.get(h, consume=False, allowed=[f"file:{tmp_path / 'a'}"]).to_bytes() == rec.to_bytes()
    monkeypatch.setenv(stores.ALLOWED_ENV, f"file:{tmp_path / 'elsewhere'}, file:{tmp_path / 'a'}")
    assert stores.get(h, consume=False).to_bytes() == rec.to_bytes()
    monkeypatch.delenv(stores.ALLOWED_ENV)
    h2 = _foreign(tmp_path / "b", rec)
    stores.allow(tmp_path / "b")  # a plain path, as in a config
    assert stores.get(h2).to_bytes() == rec.to_bytes()


def test_reading_never_creates_a_directory(tmp_path):
    absent = tmp_path / "absent" / "deeper"
    h = stores.make_handle(f"file:{absent}", uuid.uuid4().hex)
    with pytest.raises(tk.RecordError, match="no such record store directory .*nothing was created"):
        stores.get(h, allowed=[f"file:{absent}"])
    with pytest.raises(tk.RecordError, match="no such record store directory"):
        stores.peek(h)
    with pytest.raises(tk.RecordError, match="not an allowed store"):
        stores.get(h)
    assert not (tmp_path / "absent").exists()
    assert stores.open_store(f"file:{absent}", create=False).stats()["outstanding"] == 0
    assert not (tmp_path / "absent").exists()


@pytest.mark.parametrize("key", ["", "abc", "../victim/x", ".taken-x", "A" * 32, "0" * 31, "0" * 33, "0" * 31 + "/",
                                 "0" * 32 + "\0", "prompt-" + "0" * 64, "ff" * 16 + ".rec", "\u0661" * 32])
def test_keys_other_than_what_put_makes_are_refused(tree, key):
    before = _snapshot(tree["root"])
    h = f"{stores.HANDLE_PREFIX}{tree['allowed'].spec}#{key}"
    with pytest.raises(tk.RecordError, match="bad key"):
        stores.get(h, allowed=[tree["allowed"]])
    with pytest.raises(tk.RecordError, match="bad key"):
        stores.peek(h)
    assert _snapshot(tree["root"]) == before


def _with_reference(rest: bytes, reference) -> bytes:
    meta = _prefix._metadata(rest)
    meta[_prefix.PREFIX_KEY] = reference
    return st_save(st_load(rest), metadata=meta)


@pytest.mark.parametrize("reference", ["../victim/x", "/etc/passwd", "prompt-" + "0" * 63, "prompt-../../x",
                                       "trace-fp4:file:/tmp#" + "0" * 32, ""])
def test_the_prompt_part_reference_is_validated_like_a_key(tmp_path, reference):
    """A stored rest blob names its prompt part; a forged name never reads, moves or deletes a file."""
    store = stores.LocalStore(tmp_path / "s")
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    (victim_dir / "x.part").write_bytes(b"keep")
    (victim_dir / "x.refs").mkdir()
    _, _, rest = _prefix.split(_record(prompt=130, steps=(130, 1, 1)))
    key = uuid.uuid4().hex
    (tmp_path / "s" / f"{key}.rec").write_bytes(_with_reference(rest, reference))
    h = stores.make_handle(store.spec, key)
    before = _snapshot(victim_dir)
    if reference == "":
        # an empty reference reads as "no prompt part": the rest alone is not a whole record
        with pytest.raises(tk.RecordError):
            stores.get(h, consume=False)
    else:
        with pytest.raises(tk.RecordError, match="bad prompt-part reference"):
            stores.get(h, consume=False)
        with pytest.raises(tk.RecordError, match="bad prompt-part reference"):
            stores.delete(h)
    assert _snapshot(victim_dir) == before


def test_peek_opens_any_store_read_only(tree, tmp_path):
    rec = _record()
    h = _foreign(tmp_path / "foreign", rec)
    before = _snapshot(tmp_path)
    assert stores.peek(h).to_bytes() == rec.to_bytes()
    ro = stores.LocalStore(tmp_path / "foreign", read_only=True)
    for call in (lambda: ro.get(h), lambda: ro.delete(h), lambda: ro.put(rec)):
        with pytest.raises(tk.RecordError, match="read-only"):
            call()
    assert _snapshot(tmp_path) == before


def test_ray_namespaces_follow_the_same_rule(tree):
    """Refused before Ray is touched: not allowed, or not a namespace name."""
    h = stores.make_handle("ray:someone_else", uuid.uuid4().hex)
    with pytest.raises(tk.RecordError, match="not an allowed store"):
        stores.get(h, allowed=[tree["allowed"]])
    for ns in ("", "../x", "a/b", "a b", "x" * 129, "a\0b"):
        with pytest.raises(tk.RecordError, match="bad store"):
            stores.peek(stores.make_handle(f"ray:{ns}", uuid.uuid4().hex))
        with pytest.raises(ValueError, match="bad ray store namespace|NUL"):
            stores.open_store(f"ray:{ns}")


# ---- fuzz ----------------------------------------------------------------------------------------

def _specs(root):
    return st.one_of(
        st.sampled_from([f"file:{root}/victim", f"file:{root}/allowed/..", f"file:{root}/allowed/../victim",
                         f"file:{root}/allowed/", f"file:{root}//allowed", f"file:{root}/new/dir", "file:relative",
                         "file:", "file:/", f"file:{root}/allowed\0x", "ray:other", "ray:../x", "ray:", "", "/tmp",
                         f"trace-fp4:file:{root}/allowed", f"file:{root}/\u00e9\u202e", f"file:{root}/{'d' * 300}"]),
        st.text(max_size=60),
    )


def _keys(victim_key):
    return st.one_of(
        st.sampled_from(["", "..", "../victim/" + victim_key, victim_key, victim_key.upper(), "/" + victim_key,
                         victim_key + "\0", victim_key + "#", "." + victim_key[1:], "x" * 5000, "\uff10" * 32]),
        st.text(max_size=40),
        st.text(alphabet="0123456789abcdef", min_size=30, max_size=34),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_handles_touch_nothing_outside_the_allowed_store(tree, data):
    root = tree["root"]
    spec = data.draw(_specs(root))
    key = data.draw(_keys(tree["victim_key"]))
    handle = data.draw(st.sampled_from([f"{stores.HANDLE_PREFIX}{spec}#{key}", f"{spec}#{key}",
                                        f"{stores.HANDLE_PREFIX}{spec}#{key}#{key}", f"{stores.HANDLE_PREFIX}{spec}"]))
    if handle == tree["mine"]:
        return
    before = _snapshot(root)
    for call in (lambda: stores.get(handle, allowed=[tree["allowed"]]),
                 lambda: stores.get(handle, consume=False, allowed=[tree["allowed"]]),
                 lambda: stores.delete(handle, allowed=[tree["allowed"]])):
        with pytest.raises(tk.RecordError) as e:
            call()
        assert repr(handle)[:100] in str(e.value) or handle[:100] in str(e.value), str(e.value)
    if not handle.startswith(f"{stores.HANDLE_PREFIX}ray:"):  # a ray namespace would connect to a cluster
        try:
            stores.peek(handle)  # any store, read-only: may read a record, never changes one
        except (tk.RecordError, ValueError):
            pass
    assert _snapshot(root) == before
    assert not os.path.exists(os.path.join(root, "new")) and not os.path.exists("relative")
