"""Model sizes: a table of presets plus the overrides a ModelSpec may carry."""

from __future__ import annotations

from dataclasses import dataclass, replace

from gem.api.types import ModelSpec


@dataclass(kw_only=True, slots=True, frozen=True)
class GEMConfig:
    embedding_dim: int
    """Width d of every token."""
    num_heads: int
    """Attention heads; d must be divisible by it."""
    num_layers: int
    """Cross-attention blocks in which the query tokens read the event sequence."""
    max_seq_len: int
    """Most recent events kept per example."""
    num_seeds: int = 4
    """Learned query tokens that summarise the history independently of the candidate."""
    hidden_dim: int = 256
    """Width of the interaction MLP."""
    user_buckets: int = 1 << 14
    """Hash buckets of the user id table (users are many: they are hashed, collisions allowed)."""
    item_buckets: int = 1 << 13
    """Hash buckets of the ad id table, shared by the candidate ad and history events."""
    campaign_buckets: int = 1 << 11
    """Hash buckets of the campaign and advertiser tables."""
    num_time_buckets: int = 32
    """Log-spaced buckets of an event's age (see gem.model.embeddings.time_bucket)."""


PRESETS: dict[str, GEMConfig] = {
    # tests and CPU demos
    "tiny": GEMConfig(embedding_dim=32, num_heads=2, num_layers=1, max_seq_len=64, num_seeds=2, hidden_dim=64,
                      user_buckets=1 << 12, item_buckets=1 << 11, campaign_buckets=1 << 9),
    "small": GEMConfig(embedding_dim=64, num_heads=4, num_layers=2, max_seq_len=128, num_seeds=4, hidden_dim=128),
    # GPU
    "base": GEMConfig(embedding_dim=256, num_heads=4, num_layers=4, max_seq_len=512, num_seeds=8, hidden_dim=1024,
                      user_buckets=1 << 20, item_buckets=1 << 18, campaign_buckets=1 << 15),
    "large": GEMConfig(embedding_dim=512, num_heads=8, num_layers=8, max_seq_len=2048, num_seeds=16,
                       hidden_dim=2048, user_buckets=1 << 22, item_buckets=1 << 20, campaign_buckets=1 << 16),
}


def config_from_spec(spec: ModelSpec) -> GEMConfig:
    """The preset named by spec.preset with spec's explicit fields applied over it."""
    cfg = PRESETS[str(spec.preset)]
    overrides = {
        name: getattr(spec, name)
        for name in ("embedding_dim", "num_heads", "num_layers", "max_seq_len")
        if getattr(spec, name) is not None
    }
    cfg = replace(cfg, **overrides)
    if cfg.embedding_dim % cfg.num_heads:
        raise ValueError(
            f"model.embeddingDim ({cfg.embedding_dim}) must be divisible by model.numHeads ({cfg.num_heads}) "
            f"(preset {spec.preset} with overrides {overrides or 'none'})"
        )
    return cfg
