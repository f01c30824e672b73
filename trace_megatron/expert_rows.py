"""The routed experts' sites of one MoE layer, worked out once for all local experts.

The payload that followed the dispatcher (token_rows.py) holds one row per (token, expert) pair, expert
after expert. Everything a site needs from it (positions, slots, which rows have a guide, the guide rows,
the fallback counts) is computed here over all of the layer's rows at once and then split per expert
(views), instead of a dozen small torch ops per expert. Sparse sites go further:
- their rows decode in one call per site (every expert's `moe_fc1_in` once dispatched, every
  `moe_fc2_in` once all fc1s ran), each expert's site then takes its share (`SiteInput.predecoded`);
- their comparisons with the trainer's own rounding and with the record's audit are made once per site
  too (`SiteCounts`): each expert's site hands over its codes, the layer counts them after the loop.
Every count is a sum over rows and the decode works row by row, so the numbers are those of one site per
expert, bit for bit.
"""

import numpy as np
import torch
from trace_kernels import NVFP4Tensor, quantize
from trace_kernels.guides.full import codeword_mismatches

from .site_quant import SiteInput, rtn_amax, rtn_from_decode, add_report, count_audit
from . import expert_rows_host
from .token_rows import decode_rows


def _split_guide(g, sizes: list[int]) -> list:
    """Guide rows split into consecutive parts of `sizes` rows (views)."""
    return [type(g)(*parts) for parts in zip(*(t.split(sizes) for t in g.fields()))]


class SiteCounts:
    """Everything one (layer, site) of the routed experts counts, for all its experts at once: the guided
    rows and values, the fallbacks, the decode's report, the comparisons with the trainer's own rounding
    and with the record's audit. `predecode` hands over the layer's decode and RTN codes of the guided
    rows (in expert order); `flush` counts them once the experts ran (each expert's site counts nothing
    itself). Every count is a sum over rows, so these are the numbers of one count per expert."""

    def __init__(self, batch, layer: int, site: str, positions: torch.Tensor, slots: torch.Tensor | None,
                 fallback: dict[str, int], recompute: bool):
        self.batch, self.layer, self.site = batch, layer, site
        self.positions, self.slots = positions, slots  # of the guided rows, in expert order
        self.fallback, self.recompute = fallback, recompute  # rows per reason, over every expert
        self.decoded = None  # (RTN codes, decoded NVFP4Tensor, DecodeReport) of the guided rows; None: none
        self.ran = False  # the experts' sites quantized (predecode ran): then there is something to count

    def set_decoded(self, rtn_codes: torch.Tensor, decoded, report) -> None:
        self.decoded = (rtn_codes, decoded, report)

    def flush(self) -> None:
        if not self.ran or self.recompute or self.batch is None:  # a recompute pass counts nothing
            return
        self.ran = False
        stats = self.batch.site_stats(self.layer, self.site)
        for reason, rows in self.fallback.items():
            setattr(stats, f"fallback_{reason}", getattr(stats, f"fallback_{reason}") + int(rows))
        if self.decoded is None:  # no expert had guided rows
            return
        rtn, q, report = self.decoded
        self.decoded = None
        ours = q.codes
        if rtn.shape[0] != self.positions.shape[0]:
            raise RuntimeError(f"trace_megatron: layer {self.layer} {self.site}: {rtn.shape[0]} guided rows counted, "
                               f"{self.positions.shape[0]} expected")
        stats.guided_rows += rtn.shape[0]
        stats.guided_elements += ours.numel() * 2
        stats.mismatch_rtn += codeword_mismatches(rtn, ours)
        add_report(stats, report)
        count_audit(stats, self.batch, self.layer, self.site, self.positions, self.slots, rtn, ours)


class LayerExpertRows:
    """Per local expert its (moe_fc1_in, moe_fc2_in) SiteInputs, from the layer's dispatched payload rows."""

    def __init__(self, pending, counts: list[int], local_expert_indices: list[int], tp_group, trace_config, columns):
        batch, recompute, layer, spec, payload = pending
        self.config = trace_config
        E, N = len(counts), payload.shape[0]
        self.counts = counts
        host = N > 0 and payload.device.type == "cpu"  # the row bookkeeping below with numpy (expert_rows_host.py)
        if host:
            local_np = expert_rows_host.local_expert_of_rows(counts, N)
            local = torch.from_numpy(local_np)
            expert_ids = torch.from_numpy(np.asarray(local_expert_indices, dtype=np.int64)[local_np])
        else:
            local = torch.repeat_interleave(torch.arange(E), torch.tensor(counts, dtype=torch.int64), output_size=N)
            expert_ids = torch.tensor(local_expert_indices, dtype=torch.int64)[local]
        rows = decode_rows(spec, payload, expert_ids)
        common = dict(batch=batch, layer=layer, recompute=recompute)
        positions, slots = rows.positions.split(counts), rows.slots.split(counts)
        self.fc1_counts = self.fc2_counts = None
        if spec.guide is None:
            reason = "not_guided" if batch is not None and batch.records is not None else None
            self.sites = [(SiteInput(site="moe_fc1_in", fallback={reason: n} if reason else {}, positions=p, **common),
                           SiteInput(site="moe_fc2_in", fallback={reason: n} if reason else {}, positions=p, slots=s,
                                     **common))
                          for n, p, s in zip(counts, positions, slots)]
            return
        if host:
            idx1, idx2, row_in_expert, (both, route_mismatch, no_record) = expert_rows_host.guided_rows(
                local_np, counts, rows.has_record.numpy(), rows.fc2_has.numpy())
        else:
            has = rows.has_record
            idx1 = torch.nonzero(has).flatten()
            idx2 = torch.nonzero(has & rows.fc2_has).flatten()
            start = torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0) - torch.tensor(counts, dtype=torch.int64)
            row_in_expert = torch.arange(N) - start[local]
            # per expert, in one bincount: rows guided at both sites (0), record rows the record routed
            # elsewhere (1: guided at fc1 only), rows without a record (2)
            kind = torch.where(has, (~rows.fc2_has).to(torch.int64), 2)
            both, route_mismatch, no_record = torch.bincount(local * 3 + kind, minlength=3 * E).reshape(E, 3).t().tolist()
        # every row guided (the usual case): the selections below are the tensors themselves, no gathers
        all1, all2 = idx1.numel() == N, idx2.numel() == N
        n1, n2 = [a + b for a, b in zip(both, route_mismatch)], both
        fc1_guide = rows.fc1_guide if all1 else rows.fc1_guide[idx1]
        fc2_guide = rows.fc2_guide if all2 else rows.fc2_guide[idx2]
        if tp_group is not None:  # linear_fc2's input is split over expert-TP ranks: this rank's columns
            fc2_guide = columns(fc2_guide, tp_group.rank(), tp_group.size())
        self.idx1, self.idx2, self.n1, self.n2 = idx1, idx2, n1, n2
        self.fc1_guide, self.fc2_guide = fc1_guide, fc2_guide
        if fc1_guide.encoding == "sparse":  # (a recompute pass adds nothing to count: flush is then a no-op)
            self.fc1_counts = SiteCounts(batch, layer, "moe_fc1_in", rows.positions if all1 else rows.positions[idx1], None,
                                         {"no_record": N - sum(n1)}, recompute)
            self.fc2_counts = SiteCounts(batch, layer, "moe_fc2_in", rows.positions if all2 else rows.positions[idx2],
                                         rows.slots if all2 else rows.slots[idx2],
                                         {"no_record": sum(no_record), "route_mismatch": sum(route_mismatch)}, recompute)
        self.sites = []
        guided1 = row_in_expert if all1 else row_in_expert[idx1]
        guided2 = row_in_expert if all2 else row_in_expert[idx2]
        for e, (i1, g1, i2, g2) in enumerate(zip(guided1.split(n1), _split_guide(fc1_guide, n1),
                                                   guided2.split(n2), _split_guide(fc2_guide, n2))):
            self.sites.append((
                SiteInput(site="moe_fc1_in", guide=g1, guided_idx=i1, fallback={"no_record": counts[e] - n1[e]},
                          positions=positions[e], site_counts=self.fc1_counts, **common),
                SiteInput(site="moe_fc2_in", guide=g2, guided_idx=i2, slots=slots[e],
                          fallback={"no_record": no_record[e], "route_mismatch": route_mismatch[e]},
                          positions=positions[e], site_counts=self.fc2_counts, **common)))

    def predecode(self, which: int, inputs: list[torch.Tensor]) -> None:
        """Decode every expert's sparse rows of site `which` (0: moe_fc1_in of `inputs` = the experts' tokens,
        1: moe_fc2_in of `inputs` = their activations) in one call, and round them to nearest in one call
        (the trainer's own codes, which the counts compare and a wholly guided site needs no more of);
        each site takes its share."""
        config = self.config
        if config is None or not config.quantize_expert_inputs or self.fc1_counts is None:
            return
        idx, sizes, guide = (self.idx1, self.n1, self.fc1_guide) if which == 0 else (self.idx2, self.n2, self.fc2_guide)
        counts = self.fc1_counts if which == 0 else self.fc2_counts
        counts.ran = True  # the sites quantize now; the layer counts for them (flush)
        if not idx.numel():
            return
        from trace_kernels.guides.sparse import DecodeReport

        site = counts.site
        with torch.no_grad():
            x_all = torch.cat([x.detach() for x in inputs])
            if idx.numel() != x_all.shape[0]:  # (every row guided: the rows as they are)
                x_all = x_all.index_select(0, idx)
            # per row, as each site would round its own rows (static amax: the config's, per token: the row's):
            # per token, the native decode's own pass hands it over (rtn_out); else one call here
            rtn_out = [] if rtn_from_decode(config, None, config.block_scale) else None
            q, report, values = guide.rounding_target_values(x_all, block_scale=config.block_scale, rtn_out=rtn_out)
            if rtn_out:
                rtn = rtn_out[0]
            else:
                probe = SiteInput(batch=None, layer=counts.layer, site=site)
                rtn = quantize(x_all, rtn_amax(x_all, probe, config, None), block_scale=config.block_scale)
        counts.set_decoded(rtn.codes, q, report)
        parts = zip(q.codes.split(sizes), q.scales.split(sizes), q.global_amax.split(sizes), values.split(sizes),
                    rtn.codes.split(sizes), rtn.scales.split(sizes), rtn.global_amax.split(sizes))
        for sites, x, n, (c, s, a, v, rc, rs, ra) in zip(self.sites, inputs, sizes, parts):
            if n:
                sites[which].predecoded = (x, NVFP4Tensor(c, s, a), DecodeReport(), v, NVFP4Tensor(rc, rs, ra),
                                           x._version)

    def flush(self, which: int) -> None:
        """Count the site's rows and comparisons (after every expert quantized its rows of it)."""
        counts = self.fc1_counts if which == 0 else self.fc2_counts
        if counts is not None:
            counts.flush()
