"""The micro-batch's guidance records as the layers read them: per (layer, site) one table of every
sample's guide rows, and the row of that table each flat token position reads.

Every table depends on the records and the layout only (never on weights or activations), so each is
built once and kept: lazily on first use, or all at once ahead of the step (`build_all`, what
`trace_megatron.prepare` does), which lets a trainer that runs several forwards on the same records
(old log-probs then the update, PPO epochs) or a data loader pay for them once. No decode is kept here:
a sparse decode depends on the trainer's own values."""

import numpy as np
import torch
from trace_kernels import Guide, GuidanceRecord, ModelShape, RecordError, TraceConfig
from trace_kernels.guides.sparse import SparseGuide
from trace_kernels.identity import describe
from trace_kernels.records.site_batch import sparse_sites_of_all

from .layout import TokenLayout


class RecordTables:
    def __init__(self, shape: ModelShape, config: TraceConfig, layout: TokenLayout, records: list[GuidanceRecord],
                 device: torch.device):
        self.shape, self.config, self.layout = shape, config, layout
        self.records = records
        self.device = device
        self._tables: dict[tuple[int, str], object] = {}  # concatenated lazily, on first use
        self._check_records()
        counts = torch.tensor([r.num_tokens for r in records], dtype=torch.int64)
        offsets = torch.cumsum(counts, 0) - counts
        self._counts, self._offsets = counts, offsets
        has = (self.layout.sample >= 0)
        has &= self.layout.token < counts[self.layout.sample.clamp(min=0)]
        row = offsets[self.layout.sample.clamp(min=0)] + self.layout.token
        self._row_of = torch.where(has, row, -1).to(self.device)  # [N]: row in the concatenated records
        # host copies for the tables built with numpy (audit_by_position)
        self._row_of_host = torch.where(has, row, -1).numpy()
        self._offset_list, self._total_rows = offsets.tolist(), int(counts.sum())
        self._with_rows = None  # _positions_with_rows, found on first use
        self._sites_batched = False  # _batch_sparse_sites tried
        self._audit_rows = None  # _audit_gather, found on first use

    def _check_records(self) -> None:
        n = self.layout.num_samples
        if len(self.records) != n:
            raise ValueError(f"{len(self.records)} guidance records for a micro-batch of {n} samples (one per sample)")
        lengths = self.layout.sample_lengths()
        for i, rec in enumerate(self.records):
            name = describe(rec, f"record of sample {i}")
            rec.check_compatible(self.shape, self.config, source=name)
            if rec.num_tokens > lengths[i]:
                raise RecordError(
                    f"{name}: length differs: it covers {rec.num_tokens} tokens but the micro-batch "
                    f"holds {lengths[i]} tokens of that sample"
                )
            if rec.num_tokens < lengths[i] - 1:
                # Every token but the last sampled one went through the rollout model, so a record has
                # T rows for a sample of T or T + 1 tokens; fewer rows belong to another sample.
                raise RecordError(
                    f"{name}: length differs: it covers {rec.num_tokens} tokens but the micro-batch "
                    f"holds {lengths[i]} tokens of that sample (expected {lengths[i] - 1} or {lengths[i]})"
                )

    def build_all(self) -> "RecordTables":
        """Every table a forward reads, now: per layer its routing ids and, per guided site, the
        concatenated guide rows, the audit map and (whole-position sites: K / V, the MLA latent) the guided
        rows; per guided MoE layer the payload bytes the token dispatcher carries."""
        for layer in range(self.shape.num_layers):
            if self.shape.has_moe(layer):
                self.routing_table(layer)
            if self.guide_type(layer) is None:
                continue
            for site in self.shape.layer_sites(layer):
                self.site_table(layer, site)
                self.audit_by_position(layer, site)
                if site not in ("moe_fc1_in", "moe_fc2_in"):
                    self.position_rows(layer, site)
            if self.shape.has_moe(layer):
                self.payload_bytes(layer)
        return self

    def guide_type(self, layer: int) -> type[Guide] | None:
        """The Guide type of `layer`'s encoding, None where it is not guided; every record agrees (equal configs)."""
        return self.records[0].guide_type(layer) if self.records else None

    def record_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Row in the concatenated records of each flat position (-1: no record)."""
        return self._row_of[positions]

    def site_table(self, layer: int, site: str) -> Guide | None:
        """All samples' guide rows of (layer, site), concatenated: [sum T, *row shape], or None where the
        layer is not guided."""
        key = (layer, site)
        if key not in self._tables and not self._sites_batched:
            self._batch_sparse_sites()
        if key not in self._tables:
            # one unpack over every record's payload of this site (GuidanceRecord.site_of_all)
            table = GuidanceRecord.site_of_all(self.records, layer, site) if self.records else None
            self._tables[key] = None if table is None else table.to(self.device)
        return self._tables[key]

    def _batch_sparse_sites(self) -> None:
        """Every sparse (layer, site)'s table at once (records/site_batch.py: a few numba calls in place of
        16 site_of_all calls), on the first site table asked for: a forward reads all of them. Where the
        batch is not the native path's case it leaves them to site_of_all one by one (same tables; a
        record it refuses is refused there, naming it)."""
        self._sites_batched = True
        keys = [(layer, site) for layer in range(self.shape.num_layers) if self.guide_type(layer) is SparseGuide
                for site in self.shape.layer_sites(layer)]
        for key, table in (sparse_sites_of_all(self.records, keys) or {}).items():
            self._tables[key] = table.to(self.device)

    def position_rows(self, layer: int, site: str):
        """(flat positions that have a record row: int64 [n], their guide rows of (layer, site)) for a site
        whose rows are every token position in order (K / V, the MLA latent: positions 0..N-1), or None
        where the layer is not guided."""
        key = (layer, site, "position_rows")
        if key not in self._tables:
            table = self.site_table(layer, site)
            if table is None:
                self._tables[key] = None
            else:
                idx, rows = self._positions_with_rows()
                self._tables[key] = (idx, table[rows])
        return self._tables[key]

    def _positions_with_rows(self):
        """(flat positions that have a record row, their rows): the same for every whole-position site, so
        found once per batch."""
        if self._with_rows is None:
            idx = torch.nonzero(self._row_of >= 0).flatten()
            self._with_rows = (idx, self._row_of[idx])
        return self._with_rows

    def payload_bytes(self, layer: int):
        """(fc1 guide rows as payload bytes uint8 [sum T, w1], fc2 guide rows per record slot uint8
        [sum T, top_k, w2]) of a guided MoE layer: the bytes token_rows.build_payload puts in each token's
        payload (Guide.to_row_bytes of the same rows), so a step only gathers them."""
        key = (layer, "payload_bytes")
        if key not in self._tables:
            fc1 = self.site_table(layer, "moe_fc1_in")
            fc2 = self.site_table(layer, "moe_fc2_in")
            n, k = fc2.shape[0], fc2.shape[1]
            fc2_bytes = fc2.map_rows(lambda t: t.reshape(-1, *t.shape[2:])).to_row_bytes(n * k)
            self._tables[key] = (fc1.to_row_bytes(n), fc2_bytes.reshape(n, k, fc2_bytes.shape[1]))
        return self._tables[key]

    def audit_by_position(self, layer: int, site: str):
        """(audit row of each flat token position, -1 where its token is not audited or has no record: int64
        [N]; the audited rows' packed codes, concatenated: uint8 [n, ..., K // 2]) of (layer, site), or None
        where no record carries an audit there. Built once per batch, so a site's audit lookup is one
        gather; compared packed (the codeword of a nibble folds -0 into +0, see _count_audit)."""
        key = (layer, site, "audit_by_position")
        if key not in self._tables:
            # numpy on the host: 16 (layer, site)s x every record per step, a few small index ops each, which
            # cost ~10x as much as torch ops on a loaded two-core host (same integers either way)
            index = None  # audit row of each record row; made at the first audited row (most sites have none)
            rows, n = [], 0
            for rec, off in zip(self.records, self._offset_list):
                if rec.modes[layer] != "sparse":
                    continue
                # numpy arrays straight from a host record's tensor (audit_host); a record elsewhere through
                # the torch reader (the same rows and codes)
                audit = rec.audit_host(layer, site)
                if audit is None:
                    audit = rec.audit(layer, site)
                    if audit is None:
                        continue
                    audit = (audit[0].numpy(), audit[1].cpu().numpy())
                r, q = audit
                if r.size:  # most records audit no row of a site (0.25% of its tokens)
                    if index is None:
                        index = np.full(self._total_rows, -1, dtype=np.int64)
                    index[off + r] = np.arange(n, n + r.size, dtype=np.int64)
                    n += r.size
                rows.append(q)
            if not rows:
                self._tables[key] = None
            else:
                if index is None:  # no record audits a row of this site: every position -1
                    by_pos = torch.from_numpy(np.full(self._row_of_host.shape[0], -1, dtype=np.int64))
                else:
                    has, row = self._audit_gather()
                    by_pos = torch.from_numpy(np.where(has, index[row], -1))
                codes = np.concatenate(rows)  # a copy, as torch.cat made
                # (an empty numpy array comes through torch.from_numpy with zero strides: made plainly)
                codes = torch.from_numpy(codes) if codes.size else torch.empty(codes.shape, dtype=torch.uint8)
                self._tables[key] = (by_pos.to(self.device), codes.to(self.device))
        return self._tables[key]

    def _audit_gather(self):
        """(positions with a record row, each position's record row or 0): the same for every site's audit
        map, so found once per batch."""
        if self._audit_rows is None:
            row_of = self._row_of_host
            self._audit_rows = (row_of >= 0, np.maximum(row_of, 0))
        return self._audit_rows

    def routing_table(self, layer: int) -> torch.Tensor:
        key = (layer, "routing")
        if key not in self._tables:
            self._tables[key] = torch.cat([r.routed_experts(layer) for r in self.records]).to(self.device)
        return self._tables[key]

    def routing_target(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """int64 [n, top_k]: the record's expert ids per position, -1 rows where there is no record."""
        rows = self.record_rows(positions)
        ids = self.routing_table(layer)[rows.clamp(min=0)]
        return torch.where((rows >= 0)[:, None], ids, -1)
