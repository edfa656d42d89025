"""AdamW and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from gem.api.types import TrainingSpec

MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak, not 0: the last steps still learn


def lr_factor(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak LR after `step` optimizer steps: linear warmup, then cosine."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _is_embedding(module: nn.Module) -> bool:
    # nn.Embedding, or a row-sharded table standing in for one (gem.parallel.sharded_embedding)
    return isinstance(module, nn.Embedding) or (
        hasattr(module, "num_embeddings") and hasattr(module, "embedding_dim")
        and isinstance(getattr(module, "weight", None), nn.Parameter))


def build_optimizer(model: nn.Module, training: TrainingSpec, params: list[nn.Parameter] | None = None,
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` (default: all of the model's, in its order) and its warmup + cosine schedule."""
    # No weight decay on embeddings, norms and biases: decaying rarely-seen id rows to zero
    # hurts more than it regularises.
    embeddings = {id(m.weight) for m in model.modules() if _is_embedding(m)}
    chosen = None if params is None else {id(p) for p in params}
    decay, no_decay = [], []
    for p in model.parameters():
        if chosen is None or id(p) in chosen:
            (decay if p.ndim >= 2 and id(p) not in embeddings else no_decay).append(p)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=training.learning_rate, betas=(0.9, 0.98),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup_steps=training.warmup_steps, total_steps=training.steps)
    )
    return optimizer, scheduler


class ShardOptimizer:
    """The second optimizer of a run with expert or embedding-row shards (ep / sparse_shard > 1).

    DeepSpeed cannot reduce those shards (docs/parallelism.md §7), so gem.parallel's
    split_for_deepspeed leaves them out of its optimizer. Each step, after engine.backward:

        shard_opt.sync()          # sum each shard's gradient over its replicas / data ranks; its norm²
        engine.step()             # DeepSpeed clips the dense gradients with the global norm (both sets)
        shard_opt.step(engine)    # clip the shards with the same norm, AdamW, the same warmup + cosine

    One global norm: DeepSpeed's ZeRO-1/2 optimizer computes the dense norm in scaled_global_norm;
    `attach` wraps that method of the engine's optimizer instance so it adds the shards' squared
    norm (each shard counted once, however many replicas hold it). The shards are this rank's own:
    state_dict / load_state_dict are saved per rank in the checkpoint (gem/train/checkpoint.py).
    """

    def __init__(self, model: nn.Module, shards: list[nn.Parameter], mesh, training: TrainingSpec):
        from gem.parallel.parallelize import grad_group

        self.shards, self.mesh, self.clip = shards, mesh, float(training.grad_clip or 0.0)
        self.optimizer, self.scheduler = build_optimizer(model, training, params=shards)
        # ranks holding the same shard: its replica group, times tp unless tp splits it too (tp peers
        # hold the same experts and rows: their groups lie inside one tp index)
        tp = mesh.size("tp")
        self.copies = [mesh.size(grad_group(p)) * (1 if getattr(p, "tensor_model_parallel", False) else tp)
                       for p in shards]
        self._norm_sq = torch.zeros(())

    def attach(self, engine) -> None:
        """Make the engine's gradient norm the global one (dense + shards). Call once after deepspeed.initialize."""
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        opt = engine.optimizer
        if not isinstance(opt, DeepSpeedZeroOptimizer):
            raise TypeError(f"ep / sparse_shard need DeepSpeed's ZeRO-1/2 optimizer, got {type(opt).__name__} "
                            "(bf16 at ZeRO-1 uses DeepSpeed's BF16_Optimizer: use zeroStage 2 or fp32)")
        dense_norm = opt.scaled_global_norm
        shards = self

        def scaled_global_norm(norm_type: int = 2):
            norm = dense_norm(norm_type)
            extra = shards._norm_sq.to(norm.device, torch.float32) * float(opt.loss_scale) ** 2
            # keep DeepSpeed's invalid-norm sentinel (-1) as it is
            return torch.where(norm >= 0, torch.sqrt(norm.float() ** 2 + extra), norm.float())

        opt.scaled_global_norm = scaled_global_norm

    @torch.no_grad()
    def sync(self) -> None:
        """Reduce the shards' gradients (sync_parameter_gradients) and their global squared norm. Collective."""
        import torch.distributed as dist

        from gem.parallel.parallelize import sync_parameter_gradients

        sync_parameter_gradients(self.shards, self.mesh)
        # on the shards' device: NCCL groups take no CPU tensors
        local = torch.zeros((), dtype=torch.float64, device=self.shards[0].device if self.shards else "cpu")
        for p, copies in zip(self.shards, self.copies):
            local += p.grad.detach().double().pow(2).sum() / copies
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(local)
        self._norm_sq = local.float()

    @torch.no_grad()
    def step(self, engine) -> None:
        """Clip with the engine's global norm (DeepSpeed's formula), step, advance the schedule, zero the grads."""
        if getattr(engine.optimizer, "overflow", False):
            # DeepSpeed skipped this step (inf / NaN gradient norm): weights and LR schedule stay as they
            # were; so do the shards', whose gradients are likely NaN too
            self.optimizer.zero_grad(set_to_none=True)
            return
        if self.clip > 0:
            total = getattr(engine.optimizer, "_global_grad_norm", None)  # set by DeepSpeed's step
            if total is None:
                raise RuntimeError("DeepSpeed computed no gradient norm this step: cannot clip the shards with it")
            total = float(total)
            factor = (total + 1e-6) / self.clip
            if factor > 1:
                for p in self.shards:
                    p.grad.mul_(1.0 / factor)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return {"params": [p.detach().cpu().clone() for p in self.shards],
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        params = state["params"]
        if len(params) != len(self.shards) or any(t.shape != p.shape for t, p in zip(params, self.shards)):
            raise ValueError("the checkpoint's expert / embedding-row shards do not match this run's "
                             "(resume with the parallel plan and world size that saved it)")
        for p, t in zip(self.shards, params):
            p.copy_(t)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
