"""The student: a small vertical model a GEM teacher is distilled into.

    tokens  = user, ad, campaign, surface, dense                 each [B, d]
    history = mean over the most recent max_seq_len events of (item + campaign + type)   [B, d]
    h = MLP([tokens ‖ history ‖ ad ⊙ history])                    [B, hidden]
    logits = {click: [B], conversion: [B]}

Cheap to serve: no attention, one pooled history vector, widths from spec.student.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.api.types import StudentSpec
from gem.data.batch import Batch
from gem.data.synthetic import NUM_DENSE
from gem.modules.embeddings import hash_ids
from gem.model.jagged import segment_ids

USER_BUCKETS, ITEM_BUCKETS, CAMPAIGN_BUCKETS = 1 << 12, 1 << 11, 1 << 9  # a vertical model is small
NUM_SURFACE_BUCKETS = NUM_EVENT_TYPE_BUCKETS = 8  # more than the synthetic world has: room for new ones
TASKS = ("click", "conversion")  # the distillation tasks (gem.model.loss.task_labels)


class StudentModel(nn.Module):
    def __init__(self, spec: StudentSpec):
        super().__init__()
        d, hidden = spec.embedding_dim, spec.hidden_dim
        self._max_seq_len = spec.max_seq_len
        self.user = nn.Embedding(USER_BUCKETS, d)
        self.item = nn.Embedding(ITEM_BUCKETS, d)
        self.campaign = nn.Embedding(CAMPAIGN_BUCKETS, d)
        self.surface = nn.Embedding(NUM_SURFACE_BUCKETS, d)
        self.event_type = nn.Embedding(NUM_EVENT_TYPE_BUCKETS, d)
        self.dense = nn.Linear(NUM_DENSE, d)
        for emb in (self.user, self.item, self.campaign, self.surface, self.event_type):
            nn.init.normal_(emb.weight, std=1.0 / math.sqrt(d))
        self.mlp = nn.Sequential(nn.Linear(7 * d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.heads = nn.ModuleDict({task: nn.Linear(hidden, 1) for task in TASKS})

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    def pooled_history(self, batch: Batch) -> torch.Tensor:
        """Mean event embedding over each example's last max_seq_len events, [B, d] (zeros if none)."""
        offsets = batch.seq_offsets
        seg = segment_ids(offsets, batch.seq_ad_id.numel())  # [ΣL]; the count given: no device sync
        # The batch may carry a longer history (the teacher's): keep only the most recent events.
        from_end = offsets[1:].index_select(0, seg) - 1 - torch.arange(seg.numel(), device=seg.device)  # [ΣL]
        keep = (from_end < self._max_seq_len).float()  # [ΣL]
        events = (self.item(hash_ids(batch.seq_ad_id, ITEM_BUCKETS, salt=2))
                  + self.campaign(hash_ids(batch.seq_campaign_id, CAMPAIGN_BUCKETS, salt=3))
                  + self.event_type(batch.seq_type % NUM_EVENT_TYPE_BUCKETS))  # [ΣL, d]
        B = batch.size
        # Summed in float32: a bf16 student's (precision bf16) running sums stop growing near 256 events
        # (a count of 600 ones reads 256), which made its mean of 512 events twice the mean.
        total = keep.new_zeros(B, events.shape[1]).index_add(0, seg, events.float() * keep.unsqueeze(1))  # [B, d]
        count = keep.new_zeros(B).index_add(0, seg, keep).clamp_min(1.0)  # [B]
        return (total / count.unsqueeze(1)).to(events.dtype)

    def forward(self, batch: Batch) -> dict[str, torch.Tensor]:
        ad = self.item(hash_ids(batch.ad_id, ITEM_BUCKETS, salt=2))  # [B, d]
        history = self.pooled_history(batch)  # [B, d]
        x = torch.cat([
            self.user(hash_ids(batch.user_id, USER_BUCKETS, salt=1)),
            ad,
            self.campaign(hash_ids(batch.campaign_id, CAMPAIGN_BUCKETS, salt=3)),
            self.surface(batch.surface % NUM_SURFACE_BUCKETS),
            self.dense(batch.dense),
            history,
            ad * history,  # a cheap candidate-history interaction in place of attention
        ], dim=1)  # [B, 7d]
        h = self.mlp(x)  # [B, hidden]
        return {task: head(h).squeeze(-1) for task, head in self.heads.items()}


def build_student(spec: StudentSpec) -> StudentModel:
    return StudentModel(spec)
