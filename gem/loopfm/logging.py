"""Logging a foundation model's user representation into the embedding memory.

The FM (gem.train.checkpoint.load_model(dir)) is run over the synthetic world's impressions in
time order, and for every impression we log (user_id, request_time, model_version, embedding).
Two user representations (`kind`):

* "history" (what LoopFM logs, `LOGGED_KIND`): the FM's own event embeddings (its item + campaign
  tables) mean-pooled over the request's event history, the window the FM reads (its max_seq_len
  most recent events, all strictly before the request)   [B, d]
  Candidate-independent: a pure user vector, the user's interests as the FM's embedding space
  places them. Pooled again over the user's k most recent logged rows it summarises a few days of
  history, several times the student's own window.
* "tokens" (the default of `UserRepresentation`, which the Solaris scorer uses): read with a
  forward hook on the GEM model's output norm (no change to gem/model),
      norm_out(Q)  [B, Nq, d]   Nq = 5 non-sequence tokens (user, ad, campaign, surface, dense) + seeds
      embedding  = [ user token ‖ mean of the seed tokens ]   [B, 2d]
  the query tokens after they have read the history. The candidate enters the FM's sequence
  encoders and interaction layers, so this is a user x candidate embedding more than a user one:
  logged into the memory it explains a third as much of the user's interest (docs/loopfm.md).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gem.data.batch import make_batch
from gem.data.synthetic import Examples
from gem.loopfm.memory import EmbeddingMemory
from gem.model.jagged import segment_ids

LOG_BATCH = 512
#: History events per logging batch, at most: the FM's [ΣL, d] event tensors grow with its window (512
#: examples of a large teacher's 16,384 events are ~17 GB per table), so long histories get fewer examples.
LOG_EVENTS = LOG_BATCH * 64


#: sha1 of weights files already read by this process, by (path, device, inode, size, mtime_ns) of the file.
_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def _weights_digest(path: Path) -> str:
    """sha1 of a weights file, read once per process: a distillation asks for its teacher's version several
    times per start (resume check, teacher record, memory version), and a teacher's model.pt may be GBs.
    A file rewritten or replaced at the same path (another size, mtime or inode) is read again."""
    def key_of() -> tuple[str, int, int, int, int]:
        st = os.stat(path)
        return str(Path(path).resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns

    key = key_of()
    with _DIGESTS_LOCK:
        if key in _DIGESTS:
            return _DIGESTS[key]
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    digest = h.hexdigest()
    if key_of() == key:  # not rewritten while it was read: the digest is this key's
        with _DIGESTS_LOCK:
            _DIGESTS[key] = digest
    return digest


def model_version_of(ckpt_dir: str | Path) -> str:
    """A stable version id of a checkpoint: its directory name + a hash of its weights file."""
    ckpt_dir = Path(ckpt_dir)
    return f"{ckpt_dir.name}-{_weights_digest(ckpt_dir / 'model.pt')[:12]}"


KINDS = ("tokens", "history")
LOGGED_KIND = "history"  # what LoopFM's memory holds (gem.loopfm.task, benchmarks/transfer.py)


def logged_version(ckpt_dir: str | Path, kind: str = LOGGED_KIND) -> str:
    """The memory's model_version of a checkpoint's `kind` rows ("tokens" keeps the bare version id)."""
    version = model_version_of(ckpt_dir)
    return version if kind == "tokens" else f"{version}+{kind}"


class UserRepresentation:
    """Wraps a GEM model: calling it on a batch returns (logits, user embedding [B, dim]).

    kind "tokens": [user token ‖ mean of seed tokens] after the output norm (2d); kind "history":
    the mean of the FM's item + campaign embeddings over the batch's event history (d), see above.
    """

    def __init__(self, model: nn.Module, kind: str = "tokens"):
        if kind not in KINDS:
            raise ValueError(f"unknown user representation {kind!r}: one of {KINDS}")
        if not hasattr(model, "norm_out"):
            raise TypeError(f"{type(model).__name__} is not a GEM model (no norm_out to hook)")
        if kind == "history" and not hasattr(getattr(model, "embeddings", None), "lookup"):
            raise TypeError(f"{type(model).__name__} has no embedding tables to pool the history with")
        self.model = model
        self.kind = kind
        self._captured: torch.Tensor | None = None
        # hooked on the first call, not here: a reader made only for its `dim` leaves the model alone
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    def _hook(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self._captured = output

    def close(self) -> None:
        """Unhook the model (kind "tokens", once called): a hook left behind runs on every later forward of it."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def __enter__(self) -> "UserRepresentation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def dim(self) -> int:
        d = int(self.model.norm_out.normalized_shape[0])
        return 2 * d if self.kind == "tokens" else d

    @torch.no_grad()
    def history(self, batch) -> torch.Tensor:
        """[B, d]: mean of the FM's item + campaign embeddings over each example's events (zeros if none)."""
        tables = self.model.embeddings
        events = (tables.lookup("item", batch.seq_ad_id) + tables.lookup("campaign", batch.seq_campaign_id))
        seg = segment_ids(batch.seq_offsets, events.shape[0])  # [ΣL]; the count given: no device sync
        total = events.new_zeros(batch.size, events.shape[1]).index_add(0, seg, events)
        count = batch.seq_offsets.diff().clamp_min(1).to(total.dtype)
        return (total / count.unsqueeze(1)).float()

    @torch.no_grad()
    def __call__(self, batch, *, logits: bool = True) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor]:
        if self.kind == "history":
            return (self.model(batch) if logits else None), self.history(batch)
        if self._handle is None:
            self._handle = self.model.norm_out.register_forward_hook(self._hook)
        out = self.model(batch)
        q = self._captured  # [B, Nq, d]
        self._captured = None
        user = q[:, 0]  # [B, d]
        seeds = q[:, self.model.cfg.num_non_seq_tokens:].mean(dim=1)  # [B, d]: the summaries
        return out, torch.cat([user, seeds], dim=1).float()


def model_device(model: nn.Module) -> torch.device:
    """Where `model`'s weights are (its first parameter's device; the CPU for a model without any)."""
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _batches(examples: Examples, max_seq_len: int, batch_size: int, max_events: int) -> Iterator[np.ndarray]:
    """Consecutive example indices, at most batch_size examples and max_events kept events (one example at least)."""
    kept = np.minimum(examples.seq_lengths, max_seq_len)
    ends = np.concatenate([[0], np.cumsum(kept)])  # ends[i]: events before example i
    lo = 0
    while lo < len(examples):
        fit = int(np.searchsorted(ends, ends[lo] + max_events, side="right")) - 1  # examples [lo, fit) fit
        hi = max(lo + 1, min(lo + batch_size, fit))
        yield np.arange(lo, hi)
        lo = hi


@torch.no_grad()
def embed_examples(model: nn.Module, examples: Examples, *, batch_size: int = LOG_BATCH, kind: str = "tokens",
                   logits: bool = True, max_events: int = LOG_EVENTS) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(user embeddings [N, dim], teacher logits per task [N]) for every example, in example order, on the CPU
    (numpy), the model run on the device its weights are on.

    logits=False skips the FM's forward where the representation does not need it ("history"),
    and returns no logits. A batch holds at most batch_size examples and max_events history events.
    """
    need_logits = logits or kind == "tokens"
    embs, out_logits = [], {"click": [], "conversion": []}
    device = model_device(model)  # a teacher on a GPU scores there; its outputs come back to the CPU
    with UserRepresentation(model.eval(), kind) as rep:
        for idx in _batches(examples, model.max_seq_len, batch_size, max_events):
            batch = make_batch(examples, idx, max_seq_len=model.max_seq_len).to(device)
            out, emb = rep(batch, logits=need_logits)
            embs.append(emb.cpu().numpy())
            if logits:
                for task in out_logits:
                    out_logits[task].append(out[task].float().cpu().numpy())
    return np.concatenate(embs), ({k: np.concatenate(v) for k, v in out_logits.items()} if logits else {})


def _in_memory_chunks(streams: list) -> Iterator[Examples]:
    """Each stream as in-memory Examples: a streamed Parquet train split (gem.data.parquet.ParquetSource,
    what spec.data.source: parquet trains from) one row group at a time."""
    for stream in streams:
        if isinstance(stream, Examples):
            yield stream
        else:
            for g in range(len(stream.groups)):
                yield stream.read_group(g)


def log_stream(model: nn.Module, streams: list[Examples], memory: EmbeddingMemory, model_version: str,
               *, shard_rows: int = 8192, kind: str = "tokens") -> int:
    """Run the FM over the impressions of `streams` in request-time order and append one row per impression
    (its `kind` user representation, see above). A stream is Examples or a ParquetSource (read a row group
    at a time, each group's rows in request-time order: the index sorts all rows by time anyway)."""
    rows = 0
    for examples in _in_memory_chunks(streams):
        emb, _ = embed_examples(model, examples, kind=kind, logits=False)
        order = np.argsort(examples.request_time, kind="stable")
        for lo in range(0, len(order), shard_rows):  # time-ordered shards, as a live logger would write
            sel = order[lo : lo + shard_rows]
            memory.append(examples.user_id[sel], examples.request_time[sel], model_version, emb[sel])
            rows += len(sel)
    return rows
