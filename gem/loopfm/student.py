"""The LoopFM vertical model: the KD student's backbone + FM-memory features + ExFM-style heads.

    backbone inputs = the KD student's 7 tokens (user, ad, campaign, surface, dense, history, ad ⊙ history)
                      + 2 memory tokens from the user's k most recent FM embeddings e_1..e_k before
                        the request (k = distillation.memoryK, most recent first):
        m      = W_m · Σ_i softmax_i(r_i | valid) · LN(e_i)    [B, d]   r: k learned recency logits;
                                                                        pooled before projecting (1 projection)
        c      = ad + campaign                                [B, d]   the candidate (its campaign table is
                                                                        learned from 8x the examples of its ad's)
        m ⊙ c                                                 [B, d]   the candidate reads the memory
    h = MLP([... 9 tokens ...])                               [B, hidden]
    s_t = c · (B_t m)                                         [B]      per task: a direct bilinear score

    The memory holds the user's interests (gem.loopfm.logging, kind "history"); what they do to a
    label is user x ad (the synthetic world's affinity is interest · ad latent), so the read is
    bilinear in (memory, candidate) and reaches the logit directly, not only through the MLP.

    serving head  y   = heads(h) + s              trained on labels only (what is served)
    aux head      y'  = aux_heads(scale(h, β)) + scale(s, β)   trained on the teacher's soft labels; the gradient
                                                  into the backbone is multiplied by β (distillation.beta)
    adapter       a   = adapter(teacher logit)    trained on labels (teacher gradient stopped): maps the FM's
                                                  prediction to a label estimate for this vertical's data,
                                                  and sigmoid(a) is a second soft target of the aux head

So the serving head never regresses onto the teacher's logits and does not inherit its bias; the
teacher's knowledge reaches it through the memory features and the shared backbone (scaled by β).
Serving cost (`student_flops`): the KD student's MLP with 2 more input tokens + one D x d
projection + the k-slot pooling + one d x d bilinear per task; the memory read itself is a
key-value fetch. The aux heads and the adapter are training-only (s_t is shared body: it is served
and takes the aux head's gradient, scaled by β, like h).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from gem.api.types import DistillationSpec, StudentSpec
from gem.data.batch import Batch
from gem.distill.student import CAMPAIGN_BUCKETS, ITEM_BUCKETS, NUM_SURFACE_BUCKETS, USER_BUCKETS, StudentModel
from gem.loopfm.memory import MemoryIndex
from gem.modules.embeddings import hash_ids

log = logging.getLogger("gem.loopfm")

_DEFAULTS = DistillationSpec()
TRAINING_ONLY = ("aux_heads.", "adapter.")  # parameter prefixes that are never served


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
    def __init__(self, spec: StudentSpec, memory_dim: int, *, memory_k: int = _DEFAULTS.memory_k,
                 beta: float = _DEFAULTS.beta, memory_max_age_s: int | None = _DEFAULTS.memory_retention_seconds,
                 memory_bilinear: bool = True, memory_campaign: bool = True):
        super().__init__(spec)
        self.memory_bilinear, self.memory_campaign = memory_bilinear, memory_campaign
        d, hidden = spec.embedding_dim, spec.hidden_dim
        self.memory_dim, self.memory_k, self.beta = memory_dim, memory_k, beta
        self.memory_max_age_s = memory_max_age_s  # retention: older embeddings are gone at request time
        # Per-embedding LayerNorm without affine: the logged vectors of different FM versions differ in
        # scale; the projection after pooling carries the learned scale.
        self.memory_norm = nn.LayerNorm(memory_dim, elementwise_affine=False)
        self.memory_recency = nn.Parameter(torch.zeros(memory_k))  # starts as the masked mean
        self.memory_proj = nn.Linear(memory_dim, d)
        self.mlp = nn.Sequential(nn.Linear(9 * d, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        # Per task, a direct bilinear score candidate^T B_t m added to the serving logit (and the aux one):
        # the FM memory's value is the user's interest, whose effect on the label is user x ad.
        self.memory_score = nn.ModuleDict({task: nn.Linear(d, d, bias=False) for task in self.heads}) \
            if memory_bilinear else None
        if memory_bilinear:
            for lin in self.memory_score.values():
                nn.init.zeros_(lin.weight)
        self.aux_heads = nn.ModuleDict({task: nn.Linear(hidden, 1) for task in self.heads})
        # Adapter: FM logit -> label logit for this vertical (a tiny MLP with a residual identity).
        self.adapter = nn.ModuleDict({task: nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
                                      for task in self.heads})
        for a in self.adapter.values():
            nn.init.zeros_(a[2].weight)
            nn.init.zeros_(a[2].bias)
        self._memory: MemoryIndex | None = None

    @classmethod
    def from_spec(cls, student: StudentSpec, distillation: DistillationSpec, memory_dim: int,
                  **reader) -> "LoopFMStudent":
        """reader: memory_bilinear / memory_campaign (both on by default; off: the first reader, kept to
        load its checkpoints and for ablations)."""
        return cls(student, memory_dim, memory_k=distillation.memory_k, beta=distillation.beta,
                   memory_max_age_s=distillation.memory_retention_seconds, **reader)

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
        emb, _, valid = self._memory.lookup(batch.user_id.cpu().numpy(), batch.request_time.cpu().numpy(), k,
                                            max_age_s=self.memory_max_age_s)
        return torch.from_numpy(emb).to(device), torch.from_numpy(valid).to(device)

    def read_memory(self, emb: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[B, k, D], [B, k] -> [B, d]: recency-weighted mean of the normalised embeddings, projected
        (zeros for a user with no memory yet)."""
        logits = self.memory_recency.masked_fill(~valid, float("-inf"))  # [B, k]
        has = valid.any(1, keepdim=True)  # [B, 1]
        w = torch.softmax(torch.where(has, logits, torch.zeros_like(logits)), dim=1) * valid  # [B, k]
        pooled = (w.unsqueeze(-1) * self.memory_norm(emb.float())).sum(1)  # [B, D]
        return self.memory_proj(pooled) * has  # [B, d]

    # ------------------------------------------------------------------ forward

    def backbone(self, batch: Batch, memory: tuple[torch.Tensor, torch.Tensor] | None = None,
                 *, scores: bool = False):
        """h [B, hidden]; with scores=True also the memory scores {task: [B]} (zeros without the bilinear)."""
        emb, valid = self.memory_features(batch) if memory is None else memory  # [B,k,D], [B,k]
        ad = self.item(hash_ids(batch.ad_id, ITEM_BUCKETS, salt=2))  # [B, d]
        campaign = self.campaign(hash_ids(batch.campaign_id, CAMPAIGN_BUCKETS, salt=3))  # [B, d]
        history = self.pooled_history(batch)  # [B, d]
        mem = self.read_memory(emb, valid).to(ad.dtype)  # [B, d]
        cand = ad + campaign if self.memory_campaign else ad  # [B, d]: what the user's interest meets
        x = torch.cat([
            self.user(hash_ids(batch.user_id, USER_BUCKETS, salt=1)),
            ad,
            campaign,
            self.surface(batch.surface % NUM_SURFACE_BUCKETS),
            self.dense(batch.dense),
            history,
            ad * history,
            mem,
            cand * mem,
        ], dim=1)  # [B, 9d]
        h = self.mlp(x)  # [B, hidden]
        if not scores:
            return h
        if self.memory_score is None:
            return h, {task: h.new_zeros(h.shape[0]) for task in self.heads}
        return h, {task: (cand * lin(mem)).sum(-1) for task, lin in self.memory_score.items()}  # [B] each

    def forward(self, batch: Batch, teacher_logits: dict[str, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        """Serving logits {click, conversion}; with teacher_logits also aux/<task> and adapter/<task>."""
        h, score = self.backbone(batch, scores=True)
        out = {task: head(h).squeeze(-1) + score[task] for task, head in self.heads.items()}
        if teacher_logits is not None:
            h_aux = scale_grad(h, self.beta)
            for task in self.heads:
                out[f"aux/{task}"] = self.aux_heads[task](h_aux).squeeze(-1) + scale_grad(score[task], self.beta)
                t = teacher_logits[task].detach().float().unsqueeze(-1)  # [B, 1]
                out[f"adapter/{task}"] = (t + self.adapter[task](t)).squeeze(-1)
        return out


def student_flops(model: StudentModel) -> int:
    """Multiply-adds of one request on the serving path (embedding lookups and memory fetch excluded):
    every Linear of the MLP and heads, the history/interaction products, and for LoopFM the
    memory normalisation, pooling and projection."""
    d = model.item.embedding_dim
    hidden = model.heads["click"].in_features
    mlp = sum(m.in_features * m.out_features for m in model.mlp if isinstance(m, nn.Linear))
    flops = mlp + len(model.heads) * hidden + model.dense.in_features * d + d  # + dense proj + ad ⊙ history
    if isinstance(model, LoopFMStudent):
        k, D = model.memory_k, model.memory_dim
        flops += 2 * k * D + k * D + D * d + d  # LayerNorm of k embeddings, weighted pool, projection, cand ⊙ mem
        if model.memory_campaign:
            flops += d  # ad + campaign
        if model.memory_score is not None:
            flops += len(model.memory_score) * (d * d + d)  # per task: B_t m, then · cand
    return flops


def serving_params(model: StudentModel) -> int:
    """Parameters on the serving path (a LoopFM student's aux heads and adapter are training-only)."""
    return sum(p.numel() for n, p in model.named_parameters() if not n.startswith(TRAINING_ONLY))


def load_loopfm_student(ckpt: str | Path, memory_dir: str | Path | None = None,
                        *, map_location: str | torch.device = "cpu") -> tuple[LoopFMStudent, object]:
    """Rebuild a LoopFM student from its checkpoint (gem.yaml + model.pt) and attach its memory.

    memory_dir defaults to the `memory/` directory next to the checkpoint (the job directory's); a
    memory_dir that does not exist is a FileNotFoundError (a student without its memory would silently
    read zeros). The memory version is the one the student was trained with (recorded in its gem.yaml
    by the task).
    """
    from gem.api import parse_object
    from gem.train.checkpoint import MODEL_FILE, read_manifest

    ckpt = Path(ckpt)
    manifest = parse_object(read_manifest(ckpt))
    state = torch.load(ckpt / MODEL_FILE, map_location=map_location, weights_only=True)
    memory_dim = int(state["memory_proj.weight"].shape[1])
    first_reader = not any(k.startswith("memory_score.") for k in state)  # a checkpoint of the ad ⊙ mem reader
    reader = dict(memory_bilinear=False, memory_campaign=False) if first_reader else {}
    model = LoopFMStudent.from_spec(manifest.spec.student, manifest.spec.distillation, memory_dim, **reader)
    model.load_state_dict(state)
    memory_dir = Path(memory_dir) if memory_dir else ckpt.parent / "memory"
    if not memory_dir.is_dir():
        # Without its memory the student reads zeros for every user: predictions that look fine and are
        # not the model that was trained (a checkpoint copied out of its job dir, MLflow's checkpoint/).
        raise FileNotFoundError(
            f"{ckpt} is a LoopFM student and its memory {memory_dir} is not there: a LoopFM student reads "
            "the job's embedding memory (<checkpoint.path>/<namespace>/<name>/memory/, beside its step "
            "directories); load the checkpoint from its job directory, or pass memory_dir=")
    model.attach_memory(_trained_memory(memory_dir, manifest, memory_dim, ckpt))
    return model.eval(), manifest


def _trained_memory(memory_dir: Path, manifest, memory_dim: int, ckpt: Path) -> MemoryIndex:
    """The index of the memory version the checkpoint records; checkpoints from before that record
    was kept get the old guess (the last version, in sorted order, of the student's width), with a warning."""
    from gem.loopfm.memory import EmbeddingMemory
    from gem.loopfm.task import MEMORY_VERSION_ANNOTATION

    memory = EmbeddingMemory(memory_dir)
    versions = memory.model_versions()
    recorded = manifest.metadata.annotations.get(MEMORY_VERSION_ANNOTATION)
    if recorded is not None:
        if recorded not in versions:
            raise ValueError(f"{ckpt} was trained on memory version {recorded!r}, which {memory_dir} no longer "
                             f"holds (it has {versions}): pass the memory_dir it was trained with")
        return memory.index(recorded)
    if len(versions) <= 1:
        return memory.index()
    # A job's memory may also hold another teacher version's rows, or another representation's of a
    # different width.
    fits = [v for v in versions if memory.index(v).dim == memory_dim]
    guess = fits[-1] if fits else None
    log.warning("%s does not record its memory version (%s annotation, written since it was added); %s holds "
                "%s: reading %r, the last of the student's width, which may not be the one it was trained on",
                ckpt, MEMORY_VERSION_ANNOTATION, memory_dir, versions, guess)
    return memory.index(guess)
