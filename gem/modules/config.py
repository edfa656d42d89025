"""Configs of the Kunlun GEM model: features, event tiers, tasks and the model itself.

Everything is a keyword-only, slotted, frozen dataclass; `PRESETS` holds the four sizes
(tiny: tests, small: CPU demo, base and large: GPU); `dataclasses.replace` derives a variant
(a preset with other features, tiers or tasks).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# --------------------------------------------------------------------------- features


@dataclass(kw_only=True, slots=True, frozen=True)
class Table:
    name: str
    """Embedding table name; sparse features and event ids refer to it."""
    num_buckets: int
    """Rows; ids are hashed into them (collisions allowed, unseen ids still get a row)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SparseFeature:
    name: str
    """Key in GemInputs.sparse: a bag of ids per example (values + offsets)."""
    table: str
    """Table the ids are looked up in (shared tables let the candidate ad match history events)."""
    pooling: str = "sum"
    """How a bag is pooled: sum or mean."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ContentFeature:
    name: str
    """Key in GemInputs.content: a precomputed vector from any encoder (text, image, video)."""
    dim: int
    """Width of that vector; it is projected to the model width."""


@dataclass(kw_only=True, slots=True, frozen=True)
class FeatureSchema:
    tables: tuple[Table, ...]
    sparse: tuple[SparseFeature, ...]
    num_dense: int
    """Dense float features per example (already standardised)."""
    content: tuple[ContentFeature, ...] = ()
    event_types: tuple[str, ...] = ("impression", "click", "conversion")
    """Keys in GemInputs.sequences; the position is the event-type id."""
    event_tables: tuple[str, ...] = ("item",)
    """Tables every event's ids are looked up in (their embeddings are summed)."""
    num_surfaces: int = 2
    """Surfaces (feed, reels, ...) of requests and of events."""
    candidate: tuple[str, ...] = ()
    """Sparse features that describe the candidate ad (e.g. ad, campaign), for target-aware events."""

    def table(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"no embedding table named {name!r}; tables: {[t.name for t in self.tables]}")


# --------------------------------------------------------------------------- sequences


@dataclass(kw_only=True, slots=True, frozen=True)
class TierConfig:
    """One merged event sequence with its own capacity (event-level personalisation)."""

    name: str
    event_types: tuple[str, ...]
    """Event types merged (OneSeq) into this tier, by name."""
    dim: int
    """Width of this tier's event tokens."""
    num_heads: int
    max_seq_len: int
    """Most recent merged events kept per example."""
    num_seeds: int = 32
    """Over-complete HSP seeds (first level)."""
    num_summary_tokens: int = 8
    """HSP output tokens after SumKronLinear (second level)."""
    num_recent: int = 4
    """Most recent event tokens added to the summary as they are."""
    block_size: int = 64
    """Block attention block length."""
    block_align: str = "start"
    """Where the blocks are anchored: "start" (from the first event, the kernel library's
    reference) or "end" (the most recent events share one full block; the short block, if any,
    holds the oldest). docs/architecture.md §8."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads


# --------------------------------------------------------------------------- tasks


@dataclass(kw_only=True, slots=True, frozen=True)
class Task:
    name: str
    """Key in GemInputs.labels and in the model's logits."""
    stage: str
    """Funnel stage: awareness, consideration or conversion (documentation and metrics)."""
    requires: str | None = None
    """A label that must be 1 for this one to exist (conversion needs a click), else None."""
    weight: float = 1.0


FUNNEL_TASKS = (
    Task(name="dwell", stage="awareness"),
    Task(name="click", stage="consideration"),
    Task(name="conversion", stage="conversion", requires="click"),
)


# --------------------------------------------------------------------------- model


@dataclass(kw_only=True, slots=True, frozen=True)
class KunlunConfig:
    features: FeatureSchema
    tiers: tuple[TierConfig, ...]
    dim: int
    """Width d of the non-sequence tokens and of the interaction."""
    num_layers: int
    num_sum_tokens: int = 8
    """n_sum: tokens of the non-sequence summary X_sum (keys/values of the personalised FFN)."""
    num_dense_tokens: int = 1
    compskip: bool = True
    """Alternate layers: even = summary + personalised FFN, odd = block attention (cached summary)."""
    seq_ffn: str = "pffn"
    """pffn (GDPA over X_sum) or token_ffn (an ordinary per-token FFN, for comparison)."""
    token_ffn_mult: int = 4
    """Hidden width of token_ffn as a multiple of the tier width."""
    gdpa_activation: str = "gelu"
    """GDPA's activation (act(0) = 0). GELU as in GEM; the erf form, 2-3x cheaper than the tanh
    form on CPU (GPUs use tanh or a polynomial instead)."""
    sum_kron_rank: int = 4
    """k in SumKronLinear: Y = sum_i Z_iᵀ H W_i."""
    num_experts: int = 2
    """Wukong experts in the mixture (dense ensemble members; expert parallelism shards them)."""
    expert_tokens: int = 8
    """Tokens each expert reads and writes (n_F + n_L)."""
    fm_rank: int = 8
    """Rank k of the Wukong FM block's projection."""
    fm_hidden: int = 128
    target_aware_events: bool = True
    """Add Proj(e_event ⊙ e_candidate) to every event token (shared tables make matches visible)."""
    match_flags: bool = False
    """With target_aware_events: also add E_match, an embedding of which candidate ids (ad,
    campaign) the event shares. Off by default since the affinity branch learns that affinity
    better: beside a DLRM branch the flags stop the branch learning it (docs/quality.md). Without
    either, GEM `small` barely learns the history term."""
    rotary_scale: float = 16.0
    """Rotary phase = rotary_scale · log1p(age / 60 s)."""
    num_time_buckets: int = 32
    head_hidden: int = 128
    """Width of the shared input of the task heads."""
    num_shared_experts: int = 2
    num_surface_experts: int = 1
    """Head experts per surface."""
    head_expert_dim: int = 64
    tower_dim: int = 32
    wide_heads: bool = True
    """A second set of task heads over the raw non-sequence tokens X⁰, added to the logits: the
    memorisation path of Wide & Deep (docs/architecture.md §11). Per-id effects (an ad's own
    conversion rate) reach the logit through a small input instead of the deep head's flattened
    trunk, whose noise hides them from a sparse label such as post-click conversion."""
    wide_dots: bool = False
    """The wide heads also read the pairwise dot products of the raw tokens [X⁰ ‖ each event type's
    sum-pooled history] (the FM part of DeepFM, DLRM's interaction): a user x ad affinity is a dot
    product, which an MLP over concatenated embeddings learns slowly (docs/quality.md). Needs wide_heads."""
    affinity_branch: bool = True
    """A DLRM dot-interaction branch beside the trunk (gem.modules.dot_interaction: its own tables,
    each event type's history pooled with a learnt age decay, pairwise dot products, MLPs), its
    logits added to the heads'. DLRM learns the user x ad affinity through such dot products;
    beside GEM it does so only without match_flags (docs/quality.md, docs/architecture.md §11)."""
    generative_loss_weight: float = 0.0
    """Weight of the generative objective over the event history (gem.modules.generative: each
    event's ids predicted from the rest of its history, on the trunk's and the branch's tables),
    added to the task losses in training; 0: off, and the model has no parameters for it."""
    tasks: tuple[Task, ...] = FUNNEL_TASKS

    def __post_init__(self) -> None:
        # Sizes below 1 failed later with ZeroDivisionError, 'NoneType' has no attribute 'to'
        # (num_layers=0) or a reshape error, or (num_layers < 0) built a model without layers.
        _at_least(1, "", dim=self.dim, num_layers=self.num_layers, num_sum_tokens=self.num_sum_tokens,
                  token_ffn_mult=self.token_ffn_mult, sum_kron_rank=self.sum_kron_rank, num_experts=self.num_experts,
                  expert_tokens=self.expert_tokens, fm_rank=self.fm_rank, fm_hidden=self.fm_hidden,
                  num_time_buckets=self.num_time_buckets, head_hidden=self.head_hidden,
                  head_expert_dim=self.head_expert_dim, tower_dim=self.tower_dim,
                  **{"features.num_surfaces": self.features.num_surfaces})
        _at_least(0, "", num_dense_tokens=self.num_dense_tokens, num_shared_experts=self.num_shared_experts,
                  num_surface_experts=self.num_surface_experts)
        if self.num_shared_experts + self.num_surface_experts < 1:  # a gate over no experts: NaN logits
            raise ValueError("num_shared_experts + num_surface_experts must be >= 1: the heads' gates need an expert")
        if not (math.isfinite(self.generative_loss_weight) and self.generative_loss_weight >= 0):
            raise ValueError(f"generative_loss_weight must be a finite number >= 0, got {self.generative_loss_weight!r}")
        if not math.isfinite(self.rotary_scale):
            raise ValueError(f"rotary_scale must be a finite number, got {self.rotary_scale!r}")
        if not self.tiers:
            raise ValueError("tiers must name at least one event tier (e.g. gem.modules.config.two_tiers(...))")
        _unique("tiers", [t.name for t in self.tiers])
        if not self.tasks:
            raise ValueError("tasks must name at least one task (e.g. gem.modules.config.FUNNEL_TASKS)")
        _unique("tasks", [t.name for t in self.tasks])
        for t in self.features.tables:
            _at_least(1, f"features.tables[{t.name}].", num_buckets=t.num_buckets)
        _at_least(0, "features.", num_dense=self.features.num_dense)
        for c in self.features.content:
            _at_least(1, f"features.content[{c.name}].", dim=c.dim)
        tables = [t.name for t in self.features.tables]
        for field, names in (("features.sparse", [s.table for s in self.features.sparse]),
                             ("features.event_tables", list(self.features.event_tables))):
            if not set(names) <= set(tables):
                raise ValueError(f"{field} name tables {sorted(set(names) - set(tables))} that are not in "
                                 f"features.tables {tables}")
        for s in self.features.sparse:
            if s.pooling not in ("sum", "mean"):  # anything else was pooled as a sum
                raise ValueError(f"sparse feature {s.name}: pooling must be 'sum' or 'mean', got {s.pooling!r}")
        for t in self.tiers:
            _at_least(1, f"tier {t.name}: ", dim=t.dim, num_heads=t.num_heads, max_seq_len=t.max_seq_len,
                      num_seeds=t.num_seeds, num_recent=t.num_recent, block_size=t.block_size)
            _at_least(0, f"tier {t.name}: ", num_summary_tokens=t.num_summary_tokens)
            if not t.event_types:
                raise ValueError(f"tier {t.name}: event_types must name at least one event type")
            if t.dim % t.num_heads or t.head_dim % 2:
                raise ValueError(f"tier {t.name}: dim ({t.dim}) must split into {t.num_heads} heads of even width")
            if t.block_align not in ("start", "end"):  # gem.ops.common.BLOCK_ALIGNS; this module stays torch-free
                raise ValueError(f"tier {t.name}: block_align must be 'start' or 'end', got {t.block_align!r}")
            unknown = set(t.event_types) - set(self.features.event_types)
            if unknown:
                raise ValueError(f"tier {t.name} names unknown event types {sorted(unknown)}; "
                                 f"known: {list(self.features.event_types)}")
        sparse = [s.name for s in self.features.sparse]
        if not set(self.features.candidate) <= set(sparse):
            raise ValueError(f"candidate features {list(self.features.candidate)} must be sparse features {sparse}")
        if self.wide_dots and not self.wide_heads:
            raise ValueError("wide_dots=True needs wide_heads=True: the dot products are an input of the wide heads")
        if self.seq_ffn not in ("pffn", "token_ffn"):
            raise ValueError(f"seq_ffn must be pffn or token_ffn, got {self.seq_ffn!r}")
        names = {t.name for t in self.tasks}
        for t in self.tasks:
            if t.requires is not None and t.requires not in names:
                raise ValueError(f"task {t.name} requires unknown task {t.requires!r}")

    @property
    def num_non_seq_tokens(self) -> int:
        f = self.features
        return len(f.sparse) + self.num_dense_tokens + len(f.content) + 1  # + the request surface

    @property
    def num_summary_tokens_total(self) -> int:
        return sum(t.num_summary_tokens + t.num_recent for t in self.tiers)

    def layer_runs(self, index: int) -> tuple[bool, bool]:
        """(global path: HSP + personalised FFN, local path: block attention) of layer `index`."""
        if not self.compskip:
            return True, True
        return index % 2 == 0, index % 2 == 1


def _at_least(low: int, where: str, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{where}{name} must be an integer >= {low}, got {value!r}")


def _unique(field: str, names: list[str]) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:  # modules and outputs are keyed by name: a second entry silently replaced the first
        raise ValueError(f"{field} must have distinct names; repeated: {dup}")


# --------------------------------------------------------------------------- presets


def v1_features(user_buckets: int, item_buckets: int, campaign_buckets: int) -> FeatureSchema:
    """The features of the synthetic ads world (gem/data): ids, 2 dense, a typed event history
    (ad impressions, clicks, conversions and organic engagement) over 4 surfaces.

    Non-sequence tokens: user, ad, campaign, dense, surface (5, like GEM v1, so tools that read
    the head input's first token as the user keep working).
    """
    return FeatureSchema(
        tables=(Table(name="user", num_buckets=user_buckets), Table(name="item", num_buckets=item_buckets),
                Table(name="campaign", num_buckets=campaign_buckets)),
        sparse=(SparseFeature(name="user", table="user"), SparseFeature(name="ad", table="item"),
                SparseFeature(name="campaign", table="campaign")),
        num_dense=2,
        event_types=("impression", "click", "conversion", "organic"),  # gem.data.synthetic.EVENT_TYPES
        event_tables=("item", "campaign"),
        num_surfaces=4,  # feed, stories, reels, off-site (gem.data.synthetic.SURFACES)
        candidate=("ad", "campaign"),
    )


def two_tiers(dim: int, heads: int, max_len: int, *, seeds: int, summary: int, recent: int,
              block: int) -> tuple[TierConfig, ...]:
    """High-signal events (clicks, conversions, organic likes/shares) at 2x the model width, impressions at 1x."""
    return (
        TierConfig(name="engaged", event_types=("click", "conversion", "organic"), dim=2 * dim, num_heads=heads,
                   max_seq_len=max_len, num_seeds=seeds, num_summary_tokens=summary, num_recent=recent,
                   block_size=block),
        TierConfig(name="impressions", event_types=("impression",), dim=dim, num_heads=heads,
                   max_seq_len=max_len, num_seeds=seeds // 2, num_summary_tokens=summary // 2, num_recent=recent,
                   block_size=block),
    )


PRESETS: dict[str, KunlunConfig] = {
    # tests
    "tiny": KunlunConfig(
        features=v1_features(1 << 12, 1 << 11, 1 << 9),
        tiers=two_tiers(32, 2, 64, seeds=8, summary=4, recent=4, block=16),
        dim=32, num_layers=2, num_sum_tokens=4, num_experts=2, expert_tokens=8, fm_rank=4, fm_hidden=64,
        head_hidden=64, head_expert_dim=32, tower_dim=16,
    ),
    # CPU demo and the benchmarks
    "small": KunlunConfig(
        features=v1_features(1 << 14, 1 << 13, 1 << 11),
        tiers=two_tiers(128, 4, 2048, seeds=32, summary=8, recent=8, block=64),
        dim=128, num_layers=2, num_sum_tokens=16, num_experts=4, expert_tokens=16, fm_rank=8, fm_hidden=256,
        head_hidden=256, head_expert_dim=128, tower_dim=64,
    ),
    # GPU
    "base": KunlunConfig(
        features=v1_features(1 << 20, 1 << 18, 1 << 15),
        tiers=two_tiers(256, 8, 4096, seeds=64, summary=16, recent=8, block=64),
        dim=256, num_layers=4, num_sum_tokens=16, num_experts=4, expert_tokens=32, fm_rank=16, fm_hidden=1024,
        head_hidden=1024, num_shared_experts=4, num_surface_experts=2, head_expert_dim=512, tower_dim=256,
    ),
    "large": KunlunConfig(
        features=v1_features(1 << 22, 1 << 20, 1 << 16),
        tiers=two_tiers(512, 8, 16384, seeds=128, summary=32, recent=16, block=64),
        dim=512, num_layers=8, num_sum_tokens=32, num_experts=8, expert_tokens=32, fm_rank=32, fm_hidden=2048,
        head_hidden=2048, num_shared_experts=4, num_surface_experts=2, head_expert_dim=1024, tower_dim=256,
    ),
}
