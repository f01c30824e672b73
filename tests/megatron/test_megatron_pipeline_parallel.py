"""Pipeline parallelism 2 on two CPU processes: each stage builds only its layers and reads its layers
of the records (trace modules use Megatron's global layer number, PP offset included).

The two stages are driven by hand (stage 0's hidden states are sent to stage 1 with send / recv), which
is what a pipeline schedule does for one micro-batch, without its buffers and overlap.
"""

import os
import re

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("megatron.core")
import megatron_cpu as mc  # noqa: E402
import trace_megatron  # noqa: E402
from trace_kernels import TraceConfig  # noqa: E402

FULL = TraceConfig(guidance="full", guided_layers="all")
LENGTHS, SEQ = [16, 13], 16
SITES = ("moe_fc1_in", "moe_fc2_in", "k", "v")


def _stage_state(full_state: dict, stage: int, layers_per_stage: int) -> dict:
    state = {}
    for key, value in full_state.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)", key)
        if m:
            layer = int(m.group(1))
            if layer // layers_per_stage != stage:
                continue
            key = f"decoder.layers.{layer - stage * layers_per_stage}.{m.group(2)}"
        elif key.startswith("embedding.") and stage != 0:
            continue
        elif (key.startswith("output_layer.") or key.startswith("decoder.final_layernorm.")) and stage != 1:
            continue
        state[key] = value
    return state


def _worker(rank: int, world: int, port: int, workdir: str):
    import megatron_cpu as mcw

    mcw.init_parallel(rank, world, port, pp=world)
    import trace_megatron as tm
    from trace_kernels import GuidanceRecord as GR

    data = torch.load(os.path.join(workdir, "inputs.pt"), weights_only=False)
    ids, pos, mask = data["inputs"]
    records = [GR.from_bytes(b) for b in data["records"]]
    layout = tm.TokenLayout.padded(LENGTHS, SEQ)
    cfg = mcw.tiny_config(num_layers=4, pipeline_model_parallel_size=world, pipeline_dtype=torch.float32)
    model = mcw.tiny_model(cfg, trace_config=FULL, seed=17, pre_process=rank == 0, post_process=rank == world - 1)
    missing, unexpected = model.load_state_dict(_stage_state(data["state"], rank, 2), strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected, (missing, unexpected)
    layers = sorted({m.trace_layer for m in tm.trace_modules(model)})
    with torch.no_grad(), tm.guidance(model, records, layout) as batch:
        if rank == 0:
            hidden = model(ids, pos, mask)
            torch.distributed.send(hidden.contiguous(), dst=1)
            out = None
        else:
            hidden = torch.empty(SEQ, len(LENGTHS), cfg.hidden_size)
            torch.distributed.recv(hidden, src=0)
            model.set_input_tensor(hidden)
            out = model(None, pos, mask)
    torch.save({"layers": layers, "out": out, "metrics": batch.metrics()}, os.path.join(workdir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def test_pipeline_stages_read_their_own_layers(tmp_path):
    mc.init_parallel()
    model = mc.tiny_model(mc.tiny_config(num_layers=4), trace_config=FULL, seed=17)
    ids, pos, mask = mc.padded_batch(LENGTHS, SEQ, seed=6)
    layout = trace_megatron.TokenLayout.padded(LENGTHS, SEQ)
    engine = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
    with torch.no_grad(), trace_megatron.capture(model, layout, perturb=engine) as cap:
        engine_out = model(ids, pos, mask)
    records = cap.build_records()
    torch.save(
        {"state": model.state_dict(), "inputs": (ids, pos, mask), "records": [r.to_bytes() for r in records]},
        tmp_path / "inputs.pt",
    )
    mp.start_processes(_worker, args=(2, mc.free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    stages = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert stages[0]["layers"] == [0, 1] and stages[1]["layers"] == [2, 3]
    for stage in stages:
        m = stage["metrics"]
        for layer in stage["layers"]:
            for site in SITES:
                assert m[f"trace/layer{layer}/{site}/guided_rows"] > 0, (layer, site)
                assert m[f"trace/layer{layer}/{site}/mismatch_guided"] == 0, (layer, site)
        other = [l for l in range(4) if l not in stage["layers"]]
        assert not any(f"trace/layer{l}/" in k for l in other for k in m)
    valid = layout.sample.view(SEQ, len(LENGTHS)).t() >= 0
    torch.testing.assert_close(stages[1]["out"][valid], engine_out[valid], rtol=0, atol=0)  # the engine's forward
