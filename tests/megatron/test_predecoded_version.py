"""An expert's input decoded ahead (expert_rows.LayerExpertRows.predecode) and then written in place before
its linear quantizes it: refused with a clear error (the decode is of values the tensor no longer holds),
also through another tensor object over the same memory; unwritten, it goes on."""

import pytest
import torch

import trace_kernels as tk
from trace_kernels.guides import sparse as sg
from trace_megatron.site_quant import SiteInput, fake_quantize_site


def _site(x):
    q = tk.quantize(x, tk.row_amax(x))
    guide = sg.encode(q, "moe_fc1_in")
    decoded, report, values = guide.rounding_target_values(x)
    pre = (x, decoded, sg.DecodeReport(), values, None, x._version)
    return SiteInput(batch=None, layer=0, site="moe_fc1_in", guide=guide, guided_idx=torch.arange(x.shape[0]),
                     predecoded=pre), values


@pytest.mark.parametrize("write", ["itself", "view"])
def test_in_place_write_after_predecode_is_refused(write):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 128, generator=g) * 3).to(torch.bfloat16)
    site, values = _site(x)
    out = fake_quantize_site(x.view_as(x), site)  # a new tensor object over the same memory, unwritten: goes on
    assert torch.equal(out.view(torch.int16), values.view(torch.int16))
    (x if write == "itself" else x.view_as(x)).mul_(2)
    with pytest.raises(RuntimeError, match="written in place after its rows were decoded ahead"):
        fake_quantize_site(x, site)
