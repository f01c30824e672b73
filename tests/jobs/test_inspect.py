"""`trace-fp4 inspect`: the CLI's entry point on records built through trace_kernels (in this process,
which is cheaper; one test runs it as a subprocess, as a user does)."""

import json
import os
import subprocess
import sys

import pytest

import trace_kernels as tk
from record_factory import SHAPE, captured_builder

CONFIG = tk.TraceConfig(guidance="compact", guided_layers=[2, 3], full_layers=[3])


_CAPSYS = []


@pytest.fixture(autouse=True)
def _capture(capsys):
    _CAPSYS[:] = [capsys]


def _cli(*args):
    from trace_fp4.cli import main

    rc = main(["inspect", *map(str, args)])
    out = _CAPSYS[0].readouterr()
    return rc, out.out, out.err


def _subprocess_cli(*args):
    p = subprocess.run([sys.executable, "-m", "trace_fp4.cli", "inspect", *map(str, args)],
                       capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def record_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "r.safetensors"
    record = captured_builder(CONFIG, steps=(5, 1, 1)).build()
    record.save(path)
    return path, record


def test_inspect_reports_what_the_record_holds(record_file):
    path, record = record_file
    rc, out, err = _cli(path, "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert s["model_shape"] == SHAPE.__dict__ and s["num_tokens"] == 7
    assert s["layer_modes"] == [None, None, "compact", "full"]
    assert tk.TraceConfig.from_dict(s["config"]) == CONFIG
    # Bytes computed independently from the shape: full layer 3, compact layer 2, routing everywhere.
    T, H, I, k, kvh, hd = 7, SHAPE.hidden_size, SHAPE.moe_intermediate_size, SHAPE.top_k, SHAPE.num_kv_heads, SHAPE.head_dim
    per_row = {"moe_fc1_in": (1, H), "moe_fc2_in": (k, I), "k": (kvh, hd), "v": (kvh, hd)}
    for site, (rows, K) in per_row.items():
        full = T * rows * (K // 2 + K // 16 + 4)
        compact = T * rows * (K // 8 + K // 16 + 4)
        assert s["bytes_by_layer_and_site"]["3"][site] == full
        assert s["bytes_by_layer_and_site"]["2"][site] == compact
        assert site not in s["bytes_by_layer_and_site"]["0"]
    assert s["bytes_by_layer_and_site"]["0"]["routing"] == T * k * 2
    assert s["payload_bytes"] == record.nbytes == sum(sum(r.values()) for r in s["bytes_by_layer_and_site"].values())
    rc, text, _ = _cli(path)
    assert rc == 0 and "tokens: 7" in text and "3: full" in text and "0: unguided" in text


def test_verify_reports_every_tensor_and_finds_the_damaged_one(record_file, tmp_path):
    path, record = record_file
    rc, out, _ = _cli(path, "--verify")
    assert rc == 0 and f"{len(record.tensors)} of {len(record.tensors)} tensors OK" in out
    # Flip one byte inside the data of one tensor: that tensor, and only it, is reported damaged.
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    name = "layer.3.k.codes"
    start = 8 + header_len + header[name]["data_offsets"][0]
    data[start] ^= 0x11
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    rc, out, err = _cli(bad, "--verify")
    assert rc == 1
    assert f"DAMAGED  {name}" in out
    assert out.count("DAMAGED") == 1 and f"{len(record.tensors) - 1} of {len(record.tensors)} tensors OK, 1 not" in out
    assert "checksum mismatch in tensor layer.3.k.codes" in err
    # Without --verify: one line naming the file and the damage, exit 2.
    rc, out, err = _subprocess_cli(bad)  # the real command
    assert rc == 2 and err.count("\n") == 1 and "layer 3, site k: checksum mismatch" in err and str(bad) in err


def test_unreadable_inputs_are_one_line_and_exit_2(tmp_path):
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{}")
    for arg, match in ((tmp_path / "absent", "no such file"), (junk, "truncated"),
                       ("trace-fp4:file:/nowhere#k", "")):
        rc, out, err = _cli(arg)
        assert rc == 2 and err.startswith("trace-fp4 inspect: error: ") and err.count("\n") == 1 and match in err, err
    rc, _, err = _cli(junk, "--verify")
    assert rc == 2 and "truncated" in err
