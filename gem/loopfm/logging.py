"""Logging a foundation model's user representation into the embedding memory.

The FM (gem.train.checkpoint.load_model(dir)) is run over the synthetic world's impressions in
time order, and for every impression we log (user_id, request_time, model_version, embedding),
where the embedding is the FM's intermediate user representation, read with a forward hook on
the GEM model's output norm (no change to gem/model):

    norm_out(Q)  [B, Nq, d]   Nq = 5 non-sequence tokens (user, ad, campaign, surface, dense) + seeds
    embedding  = [ user token ‖ mean of the seed tokens ]   [B, 2d]

Both are the query tokens after they have read the user's event history: the user token is the
user's id embedding refined by the history, the seeds summarise the history. (Event tokens carry a
same-campaign flag relative to the candidate, so the summary is mildly candidate-aware: a user x ad
embedding more than a pure user one.)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gem.data.batch import make_batch
from gem.data.synthetic import Examples
from gem.loopfm.memory import EmbeddingMemory
from gem.model.embeddings import NUM_NON_SEQ_TOKENS

LOG_BATCH = 512


def model_version_of(ckpt_dir: str | Path) -> str:
    """A stable version id of a checkpoint: its directory name + a hash of its weights file."""
    ckpt_dir = Path(ckpt_dir)
    h = hashlib.sha1()
    with open(ckpt_dir / "model.pt", "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{ckpt_dir.name}-{h.hexdigest()[:12]}"


class UserRepresentation:
    """Wraps a GEM model: calling it on a batch returns (logits, user embedding [B, 2d])."""

    def __init__(self, model: nn.Module):
        if not hasattr(model, "norm_out"):
            raise TypeError(f"{type(model).__name__} is not a GEM model (no norm_out to hook)")
        self.model = model
        self._captured: torch.Tensor | None = None
        model.norm_out.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._captured = output

    @property
    def dim(self) -> int:
        return 2 * int(self.model.norm_out.normalized_shape[0])

    @torch.no_grad()
    def __call__(self, batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        logits = self.model(batch)
        q = self._captured  # [B, Nq, d]
        self._captured = None
        user = q[:, 0]  # [B, d]
        seeds = q[:, NUM_NON_SEQ_TOKENS:].mean(dim=1)  # [B, d]
        return logits, torch.cat([user, seeds], dim=1).float()


@torch.no_grad()
def embed_examples(model: nn.Module, examples: Examples, *, batch_size: int = LOG_BATCH
                   ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(user embeddings [N, 2d], teacher logits per task [N]) for every example, in example order."""
    rep = UserRepresentation(model.eval())
    embs, logits = [], {"click": [], "conversion": []}
    for lo in range(0, len(examples), batch_size):
        idx = np.arange(lo, min(lo + batch_size, len(examples)))
        out, emb = rep(make_batch(examples, idx, max_seq_len=model.max_seq_len))
        embs.append(emb.numpy())
        for task in logits:
            logits[task].append(out[task].float().numpy())
    return np.concatenate(embs), {k: np.concatenate(v) for k, v in logits.items()}


def log_stream(model: nn.Module, streams: list[Examples], memory: EmbeddingMemory, model_version: str,
               *, shard_rows: int = 8192) -> int:
    """Run the FM over the impressions of `streams` in request-time order and append one row per impression."""
    rows = 0
    for examples in streams:
        emb, _ = embed_examples(model, examples)
        order = np.argsort(examples.request_time, kind="stable")
        for lo in range(0, len(order), shard_rows):  # time-ordered shards, as a live logger would write
            sel = order[lo : lo + shard_rows]
            memory.append(examples.user_id[sel], examples.request_time[sel], model_version, emb[sel])
            rows += len(sel)
    return rows
