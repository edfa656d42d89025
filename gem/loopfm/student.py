"""The LoopFM vertical model: the KD student's backbone + FM-memory features + ExFM-style heads.

    backbone inputs = the KD student's 7 tokens (user, ad, campaign, surface, dense, history, ad ⊙ history)
                      + memory features from the user's k most recent FM embeddings before the request:
        mean   = W_m LN(masked mean of e_1..e_k)          [B, d]   (e_i: logged FM user embeddings,
        recent = W_m LN(e_1)                              [B, d]    most recent first; pooled before
        + mean ⊙ ad                                       [B, d]    projecting: 2 projections per request)
    h = MLP([... 10 tokens ...])                            [B, hidden]

    serving head  y   = heads(h)                  trained on labels only (what is served)
    aux head      y'  = aux_heads(scale(h, β))    trained on the teacher's soft labels; the gradient
                                                  into the backbone is multiplied by β
    adapter       a   = adapter(teacher logit)    trained on labels (teacher gradient stopped): maps the FM's
                                                  prediction to a label estimate for this vertical's data,
                                                  and sigmoid(a) is a second soft target of the aux head

So the serving head never regresses onto the teacher's logits and does not inherit its bias; the
teacher's knowledge reaches it only through the shared backbone (scaled by β) and the memory
features. Serving cost: the KD student's MLP with 3 more input tokens + two [D] x [D, d]
projections (see `serving_flops`); the memory read itself is a key-value fetch.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from gem.api.types import StudentSpec
from gem.data.batch import Batch
from gem.distill.student import CAMPAIGN_BUCKETS, ITEM_BUCKETS, USER_BUCKETS, StudentModel
from gem.loopfm.memory import MemoryIndex
from gem.model.embeddings import hash_ids

MEMORY_K = 8  # FM embeddings of the user read per request
DEFAULT_BETA = 0.5  # gradient scale from the aux head into the backbone


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by `scale` backward."""
    return _ScaleGrad.apply(x, scale)


class LoopFMStudent(StudentModel):
    def __init__(self, spec: StudentSpec, memory_dim: int, *, memory_k: int = MEMORY_K, beta: float = DEFAULT_BETA):
        super().__init__(spec)
        d, hidden = spec.embedding_dim, spec.hidden_dim
        self.memory_dim, self.memory_k, self.beta = memory_dim, memory_k, beta
        self.memory_proj = nn.Linear(memory_dim, d)
        self.memory_norm = nn.LayerNorm(memory_dim)
        self.mlp = nn.Sequential(nn.Linear(10 * d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.aux_heads = nn.ModuleDict({task: nn.Linear(hidden, 1) for task in self.heads})
        # Adapter: FM logit -> label logit for this vertical (a tiny MLP with a residual identity).
        self.adapter = nn.ModuleDict({task: nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
                                      for task in self.heads})
        for a in self.adapter.values():
            nn.init.zeros_(a[2].weight)
            nn.init.zeros_(a[2].bias)
        self._memory: MemoryIndex | None = None

    # ------------------------------------------------------------------ memory

    def attach_memory(self, index: MemoryIndex) -> "LoopFMStudent":
        if len(index) and index.dim != self.memory_dim:
            raise ValueError(f"memory holds {index.dim}-d embeddings, the student expects {self.memory_dim}")
        self._memory = index
        return self

    def memory_features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(FM embeddings [B, k, D], valid [B, k]) strictly before each request (zeros without a memory)."""
        B, k, D = batch.size, self.memory_k, self.memory_dim
        device = self.memory_proj.weight.device
        if self._memory is None or len(self._memory) == 0:
            return torch.zeros(B, k, D, device=device), torch.zeros(B, k, dtype=torch.bool, device=device)
        emb, _, valid = self._memory.lookup(batch.user_id.cpu().numpy(), batch.request_time.cpu().numpy(), k)
        return torch.from_numpy(emb).to(device), torch.from_numpy(valid).to(device)

    # ------------------------------------------------------------------ forward

    def backbone(self, batch: Batch, memory: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        emb, valid = self.memory_features(batch) if memory is None else memory  # [B,k,D], [B,k]
        ad = self.item(hash_ids(batch.ad_id, ITEM_BUCKETS, salt=2))  # [B, d]
        history = self.pooled_history(batch)  # [B, d]
        w = valid.to(ad.dtype).unsqueeze(-1)  # [B, k, 1]
        raw_mean = (emb.to(ad.dtype) * w).sum(1) / w.sum(1).clamp_min(1.0)  # [B, D]: pool first, project once
        has = valid.any(1, keepdim=True).to(ad.dtype)  # [B, 1]
        mean = self.memory_proj(self.memory_norm(raw_mean)) * has  # [B, d]
        recent = self.memory_proj(self.memory_norm(emb[:, 0].to(ad.dtype))) * has  # [B, d], the latest
        x = torch.cat([
            self.user(hash_ids(batch.user_id, USER_BUCKETS, salt=1)),
            ad,
            self.campaign(hash_ids(batch.campaign_id, CAMPAIGN_BUCKETS, salt=3)),
            self.surface(batch.surface % 8),
            self.dense(batch.dense),
            history,
            ad * history,
            mean,
            recent,
            ad * mean,
        ], dim=1)  # [B, 10d]
        return self.mlp(x)  # [B, hidden]

    def forward(self, batch: Batch, teacher_logits: dict[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        """Serving logits {click, conversion}; with teacher_logits also aux/<task> and adapter/<task>."""
        h = self.backbone(batch)
        out = {task: head(h).squeeze(-1) for task, head in self.heads.items()}
        if teacher_logits is not None:
            h_aux = scale_grad(h, self.beta)
            for task in self.heads:
                out[f"aux/{task}"] = self.aux_heads[task](h_aux).squeeze(-1)
                t = teacher_logits[task].detach().float().unsqueeze(-1)  # [B, 1]
                out[f"adapter/{task}"] = (t + self.adapter[task](t)).squeeze(-1)
        return out

    def serving_flops(self) -> int:
        """Multiply-adds of one request (embedding lookups excluded)."""
        d = self.memory_proj.out_features
        mlp = sum(m.in_features * m.out_features for m in self.mlp if isinstance(m, nn.Linear))
        return mlp + 2 * self.memory_dim * d + 2 * self.heads["click"].in_features


def student_flops(model: StudentModel) -> int:
    """Multiply-adds of one KD-student request (embedding lookups excluded)."""
    if isinstance(model, LoopFMStudent):
        return model.serving_flops()
    mlp = sum(m.in_features * m.out_features for m in model.mlp if isinstance(m, nn.Linear))
    return mlp + 2 * model.heads["click"].in_features


def load_loopfm_student(ckpt: str | Path, memory_dir: str | Path | None = None) -> tuple[LoopFMStudent, object]:
    """Rebuild a LoopFM student from its checkpoint (gem.yaml + model.pt) and attach its memory.

    memory_dir defaults to the `memory/` directory next to the checkpoint's job directory.
    """
    from gem.api import parse_object
    from gem.loopfm.memory import EmbeddingMemory
    from gem.train.checkpoint import MODEL_FILE, read_manifest

    ckpt = Path(ckpt)
    manifest = parse_object(read_manifest(ckpt))
    state = torch.load(ckpt / MODEL_FILE, map_location="cpu", weights_only=True)
    memory_dim = int(state["memory_proj.weight"].shape[1])
    model = LoopFMStudent(manifest.spec.student, memory_dim)
    model.load_state_dict(state)
    memory_dir = Path(memory_dir) if memory_dir else ckpt.parent / "memory"
    if memory_dir.is_dir():
        model.attach_memory(EmbeddingMemory(memory_dir).index())
    return model.eval(), manifest

