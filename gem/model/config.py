"""Model sizes: a table of presets plus the overrides a ModelSpec may carry.

`GEMConfig` is what the trainer and the API see (the ModelSpec fields plus table sizes);
`kunlun_config(cfg)` expands it into the full Kunlun architecture config
(gem.modules.config.PRESETS holds the rest of each preset: tiers, summaries, experts, heads).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gem.api.types import ModelSpec


@dataclass(kw_only=True, slots=True, frozen=True)
class GEMConfig:
    embedding_dim: int
    """Width d of the non-sequence tokens; event tiers are multiples of it (clicks 2d, impressions d)."""
    num_heads: int
    """Attention heads of every event tier; each tier's head width must be even (rotary)."""
    num_layers: int
    """Kunlun layers (with CompSkip, even layers: summary + personalised FFN, odd: block attention)."""
    max_seq_len: int
    """Most recent events kept per example (and per tier after merging)."""
    preset: str = "tiny"
    """The Kunlun preset (gem.modules.config.PRESETS) that fixes everything not listed here."""
    user_buckets: int = 1 << 14
    """Hash buckets of the user id table (users are many: they are hashed, collisions allowed)."""
    item_buckets: int = 1 << 13
    """Hash buckets of the ad id table, shared by the candidate ad and history events."""
    campaign_buckets: int = 1 << 11
    """Hash buckets of the campaign table."""
    num_time_buckets: int = 32
    """Log-spaced buckets of an event's age (see gem.modules.oneseq.time_bucket)."""
    affinity_branch: bool = True
    """KunlunConfig.affinity_branch; without it the trunk gets KunlunConfig.match_flags, the best
    design measured without the branch (docs/quality.md)."""
    generative_loss_weight: float = 0.0
    """KunlunConfig.generative_loss_weight: the generative objective over the history (0: off)."""
    tasks: tuple[str, ...] = ("click", "conversion", "dwell")
    """Funnel tasks with a head, trained (losses masked where a label is unknown) and evaluated
    (gem/eval): consideration (click), conversion (post-click) and awareness (dwell)."""


PRESETS: dict[str, GEMConfig] = {
    # tests and CPU demos
    "tiny": GEMConfig(embedding_dim=32, num_heads=2, num_layers=2, max_seq_len=64, preset="tiny",
                      user_buckets=1 << 12, item_buckets=1 << 11, campaign_buckets=1 << 9),
    "small": GEMConfig(embedding_dim=128, num_heads=4, num_layers=2, max_seq_len=2048, preset="small"),
    # GPU
    "base": GEMConfig(embedding_dim=256, num_heads=8, num_layers=4, max_seq_len=4096, preset="base",
                      user_buckets=1 << 20, item_buckets=1 << 18, campaign_buckets=1 << 15),
    "large": GEMConfig(embedding_dim=512, num_heads=8, num_layers=8, max_seq_len=16384, preset="large",
                       user_buckets=1 << 22, item_buckets=1 << 20, campaign_buckets=1 << 16),
}


def config_from_spec(spec: ModelSpec) -> GEMConfig:
    """The preset named by spec.preset with spec's explicit fields applied over it."""
    cfg = PRESETS[str(spec.preset)]
    overrides = {
        name: getattr(spec, name)
        for name in ("embedding_dim", "num_heads", "num_layers", "max_seq_len")
        if getattr(spec, name) is not None
    }
    cfg = replace(cfg, **overrides, affinity_branch=spec.affinity_branch,
                  generative_loss_weight=spec.generative_loss_weight)
    if cfg.embedding_dim % cfg.num_heads:
        raise ValueError(
            f"model.embeddingDim ({cfg.embedding_dim}) must be divisible by model.numHeads ({cfg.num_heads}) "
            f"(preset {spec.preset} with overrides {overrides or 'none'})"
        )
    if (cfg.embedding_dim // cfg.num_heads) % 2:
        raise ValueError(
            f"model.embeddingDim / model.numHeads ({cfg.embedding_dim} / {cfg.num_heads}) must be even: "
            f"time rotary rotates pairs of channels (preset {spec.preset} with overrides {overrides or 'none'})"
        )
    return cfg


def kunlun_config(cfg: GEMConfig):
    """The Kunlun architecture config of a GEMConfig: its preset, resized to cfg's four fields."""
    from gem.modules.config import PRESETS as KUNLUN_PRESETS
    from gem.modules.config import v1_features

    base = KUNLUN_PRESETS[cfg.preset]
    by_name = {t.name: t for t in base.tasks}
    unknown = [t for t in cfg.tasks if t not in by_name]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}: the model knows {list(by_name)}")
    scale = cfg.embedding_dim / base.dim
    tiers = tuple(replace(t, dim=round(t.dim * scale), num_heads=cfg.num_heads, max_seq_len=cfg.max_seq_len)
                  for t in base.tiers)
    features = v1_features(cfg.user_buckets, cfg.item_buckets, cfg.campaign_buckets)
    return replace(base, features=features, tiers=tiers, dim=cfg.embedding_dim, num_layers=cfg.num_layers,
                   num_time_buckets=cfg.num_time_buckets, tasks=tuple(by_name[t] for t in cfg.tasks),
                   affinity_branch=cfg.affinity_branch, match_flags=not cfg.affinity_branch,
                   generative_loss_weight=cfg.generative_loss_weight)
