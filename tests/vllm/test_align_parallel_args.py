"""`trace-fp4 align`'s parallel layouts: what ran goes to the JSON, and a layout that cannot be guided
is refused before any engine starts, in one line naming the setting (no engine here)."""

import pytest

from trace_fp4.align import AlignError, _parallel_layout
from trace_fp4.cli import _parser
from trace_fp4.recompute import parse_trainer_parallel


def _args(*extra):
    return _parser().parse_args(["align", *extra])


def test_the_layout_keys_say_what_ran():
    rollout, trainer = _parallel_layout(_args("--tensor-parallel-size", "2", "--expert-parallel"))
    assert rollout == {"tensor_parallel_size": 2, "expert_parallel": True, "pipeline_parallel_size": 1,
                       "bf16_expert_parallel": False}
    assert trainer == {"tp": 1, "ep": 1, "cp": 1, "pp": 1}
    rollout, _ = _parallel_layout(_args("--pipeline-parallel-size", "2"))
    assert rollout == {"tensor_parallel_size": 1, "expert_parallel": False, "pipeline_parallel_size": 2}
    assert parse_trainer_parallel("tp=2, cp=2") == {"tp": 2, "ep": 1, "cp": 2, "pp": 1}
    _, trainer = _parallel_layout(_args("--trainer-parallel", "tp=2,ep=2,cp=2,pp=2"))
    assert trainer == {"tp": 2, "ep": 2, "cp": 2, "pp": 2}


def test_a_model_that_does_not_split_is_refused_naming_the_setting():
    from types import SimpleNamespace

    from trace_fp4.trainer_layout import check_layout

    hf = SimpleNamespace(num_attention_heads=4, num_kv_heads=2, vocab_size=384, num_experts=8, num_layers=4,
                         model_shape=lambda: SimpleNamespace(kv_kind="mha"))
    check_layout({"tp": 2, "ep": 2, "cp": 2, "pp": 2}, hf)  # the embedded tiny model's shape splits so
    with pytest.raises(ValueError, match="tp=4: 4 attention heads / 2 KV heads do not split over 4 ranks") as e:
        check_layout({"tp": 4, "ep": 1, "cp": 1, "pp": 1}, hf)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="pp=3: 4 layers"):
        check_layout({"tp": 1, "ep": 1, "cp": 1, "pp": 3}, hf)


@pytest.mark.parametrize("extra, words", [
    (["--pipeline-parallel-size", "2", "--engine", "sglang"], "--pipeline-parallel-size 2: rollout pipeline parallelism"),
    (["--expert-parallel"], "--expert-parallel: needs --engine vllm and --tensor-parallel-size 2"),
    (["--tensor-parallel-size", "2", "--engine", "sglang"], "--tensor-parallel-size 2: rollout tensor parallelism"),
    (["--trainer-parallel", "tp=4,cp=4"], "--trainer-parallel tp=4,cp=4: 16 processes"),
    (["--trainer-parallel", "ep=2"], "--trainer-parallel ep=2: expert parallelism must divide tp x cp"),
    (["--trainer-parallel", "dp=2"], "expected items like tp=2"),
    (["--tensor-parallel-size", "0"], "must be at least 1"),
])
def test_layouts_that_cannot_be_guided_are_refused_in_one_line(extra, words):
    with pytest.raises(AlignError, match=words) as e:
        _parallel_layout(_args(*extra))
    assert "\n" not in str(e.value)


def test_a_trainer_layout_with_the_4over6_block_scale_is_refused_before_any_engine(tmp_path):
    from trace_fp4.align import run_align

    args = _args("--trainer-parallel", "tp=2,ep=2", "--block-scale", "4over6", "--workdir", str(tmp_path / "w"))
    with pytest.raises(AlignError, match="--block-scale 4over6 with --trainer-parallel") as e:
        run_align(args)
    assert "\n" not in str(e.value) and not (tmp_path / "w").exists()
