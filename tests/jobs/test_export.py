"""`trace-fp4 export`: what the NVFP4 checkpoint holds, and what it refuses (no engine, no
compressed-tensors import: the fast tier). The stock loaders' side is test_export_loaders.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from trace_fp4.cli import main
from vllm_helpers import checkpoint_expert_codes, tiny_moe


def _export(capsys, model, out, *extra):
    rc = main(["export", "--model", str(model), "--out", str(out), *map(str, extra)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture(scope="module")
def model():
    return tiny_moe()


def _stacked(t, pre, e, field):
    """w13 rows as the engines hold them: gate rows, then up rows."""
    return torch.cat([t[f"{pre}.{e}.gate_proj.{field}"], t[f"{pre}.{e}.up_proj.{field}"]])


@pytest.mark.parametrize("fmt,packed,scale2", [("compressed-tensors", "weight_packed", "weight_global_scale"),
                                                ("modelopt", "weight", "weight_scale_2")])
def test_experts_hold_the_codes_and_scales_a_fresh_engine_load_holds(model, tmp_path, capsys, fmt, packed, scale2):
    rc, out, err = _export(capsys, model, tmp_path / "out", "--format", fmt)
    assert rc == 0, err
    assert json.loads(out)["experts"] == 4 * 8
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = checkpoint_expert_codes(model / "model.safetensors")  # what the engines' resident weights hold
    for layer, w in want.items():
        pre = f"model.layers.{layer}.mlp.experts"
        for e in range(w["w13_codes"].shape[0]):
            assert torch.equal(_stacked(got, pre, e, packed), w["w13_codes"][e])
            assert torch.equal(_stacked(got, pre, e, "weight_scale").view(torch.uint8), w["w13_scales"][e])
            assert torch.equal(got[f"{pre}.{e}.down_proj.{packed}"], w["w2_codes"][e])
            assert torch.equal(got[f"{pre}.{e}.down_proj.weight_scale"].view(torch.uint8), w["w2_scales"][e])
            assert got[f"{pre}.{e}.gate_proj.weight_scale"].dtype == torch.float8_e4m3fn
            # One global scale for gate and up (the amax covers both), its own for down; the value is
            # the contract's step 1 on the engine's amax: g_enc = 2688 / amax (ModelOpt: 1 / g_enc).
            for proj, amax in (("gate_proj", w["w13_amax"][e]), ("up_proj", w["w13_amax"][e]), ("down_proj", w["w2_amax"][e])):
                g_enc = torch.tensor(2688.0, dtype=torch.float32) / amax
                expect = g_enc if fmt == "compressed-tensors" else torch.tensor(1.0, dtype=torch.float32) / g_enc
                assert got[f"{pre}.{e}.{proj}.{scale2}"].reshape(()).item() == expect.item()
    if fmt == "compressed-tensors":  # no BF16 copy of an expert is left behind
        assert not any(".mlp.experts." in k and k.endswith(".weight") for k in got)


def test_everything_but_the_routed_experts_is_unchanged(model, tmp_path, capsys):
    assert _export(capsys, model, tmp_path / "out")[0] == 0
    src = load_file(str(model / "model.safetensors"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    others = {k: v for k, v in src.items() if ".mlp.experts." not in k}
    assert others and all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in others.items())
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    q = cfg["quantization_config"]
    assert q["format"] == "nvfp4-pack-quantized" and q["config_groups"]["group_0"]["input_activations"] is None
    # Attention, router, embeddings and lm_head are named in `ignore` (and vLLM's fused qkv_proj).
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.3.self_attn.qkv_proj", "model.layers.3.self_attn.o_proj"} <= set(q["ignore"])
    assert not any(".experts." in n for n in q["ignore"])


def test_a_static_activation_amax_becomes_the_input_scales(model, tmp_path, capsys):
    amax = {f"{i}.{s}": 1.5 + i + (s == "moe_fc2_in") for i in range(4) for s in ("moe_fc1_in", "moe_fc2_in", "k", "v")}
    tc = tmp_path / "tc.json"
    tc.write_text(json.dumps({"activation_scale": "static", "static_activation_amax": amax}))
    for fmt, name, expect in (("compressed-tensors", "input_global_scale", lambda a: 2688.0 / a),
                              ("modelopt", "input_scale", lambda a: 1.0 / (2688.0 / a))):
        out = tmp_path / fmt
        rc, summary, err = _export(capsys, model, out, "--format", fmt, "--trace-config", tc)
        assert rc == 0, err
        assert "W4A4" in json.loads(summary)["activations"]
        got = load_file(str(out / "model.safetensors"))
        for layer, proj, site in ((2, "up_proj", "moe_fc1_in"), (3, "down_proj", "moe_fc2_in")):
            a = torch.tensor(amax[f"{layer}.{site}"], dtype=torch.float32)
            want = torch.tensor(2688.0, dtype=torch.float32) / a
            if fmt == "modelopt":
                want = torch.tensor(1.0, dtype=torch.float32) / want
            assert got[f"model.layers.{layer}.mlp.experts.5.{proj}.{name}"].reshape(()).item() == want.item()
    cfg = json.loads((tmp_path / "modelopt" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_algo"] == "NVFP4"
    assert json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"


def _copy_with(model, dst, edit_state=None, edit_cfg=None):
    dst.mkdir()
    state = load_file(str(model / "model.safetensors"))
    if edit_state:
        edit_state(state)
    save_file(state, str(dst / "model.safetensors"))
    cfg = json.loads((model / "config.json").read_text())
    if edit_cfg:
        edit_cfg(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
    return dst


def test_an_expert_not_divisible_into_16_value_blocks_is_refused_naming_the_tensor(model, tmp_path, capsys):
    name = "model.layers.2.mlp.experts.3.down_proj.weight"

    def narrow(state):
        state[name] = state[name][:, :24].contiguous()  # [H, 24]: one and a half blocks

    bad = _copy_with(model, tmp_path / "bad", narrow)
    rc, _, err = _export(capsys, bad, tmp_path / "out")
    assert rc == 2
    assert name in err and "24" in err and "16" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case,needle", [
    ("quantized", "already quantized"),
    ("no_experts", "no routed-expert weights"),
    ("half_expert", "has no up_proj"),
    ("out_is_model", "is the input checkpoint"),
])
def test_bad_input_is_refused_with_one_line(model, tmp_path, capsys, case, needle):
    out = tmp_path / "out"
    if case == "quantized":
        src = _copy_with(model, tmp_path / "m", edit_cfg=lambda c: c.update(quantization_config={"quant_method": "fp8"}))
    elif case == "no_experts":
        src = _copy_with(model, tmp_path / "m", lambda s: [s.pop(k) for k in [k for k in s if ".experts." in k]])
    elif case == "half_expert":
        src = _copy_with(model, tmp_path / "m", lambda s: s.pop("model.layers.1.mlp.experts.7.up_proj.weight"))
    else:
        src = out = _copy_with(model, tmp_path / "m")
    rc, _, err = _export(capsys, src, out)
    assert rc == 2 and needle in err and err.count("\n") == 1, err


def test_a_non_empty_out_dir_needs_overwrite(model, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, _, err = _export(capsys, model, out)
    assert rc == 2 and "--overwrite" in err
    assert _export(capsys, model, out, "--overwrite")[0] == 0


def test_trained_megatron_weights_export_like_their_hf_checkpoint(model, tmp_path, capsys):
    """--megatron-state: a GPTModel state dict goes back to HF names (the converter's inverse) and
    exports to the same bytes as the HF checkpoint it came from."""
    from trace_fp4 import hf_to_megatron as h2m
    from trace_fp4.hf_checkpoint import read_config

    hf = read_config(model)
    state = h2m.convert_state_dict(load_file(str(model / "model.safetensors")), hf, dtype=torch.bfloat16)
    torch.save(state, tmp_path / "megatron.pt")
    assert _export(capsys, model, tmp_path / "from_hf")[0] == 0
    rc, _, err = _export(capsys, model, tmp_path / "from_megatron", "--megatron-state", tmp_path / "megatron.pt")
    assert rc == 0, err
    a = load_file(str(tmp_path / "from_hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "from_megatron" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                                                    b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]) for k in a)
    state.pop("decoder.layers.1.mlp.router.weight")
    torch.save(state, tmp_path / "broken.pt")
    rc, _, err = _export(capsys, model, tmp_path / "x", "--megatron-state", tmp_path / "broken.pt")
    assert rc == 2 and "decoder.layers.1.mlp.router.weight" in err
