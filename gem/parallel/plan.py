"""The parallel plan: five degrees, their rank layout, validation and automatic choice.

    world = dp_replicate x dp_shard x cp x tp          ep borrows from dp_shard (ep | dp_shard)

    mesh axes, outermost first (global rank = node_rank x procs_per_node + local_rank):
        dp_replicate     replicas of the shard group (DeepSpeed's ZeRO still spans them: see _replicate_why)
        dp_shard_mod_ep  the part of the ZeRO shard group outside the expert-parallel group
        ep               dense Wukong experts on different ranks (GEM-26: EP borrows data ranks)
        cp               context parallel: the sequences of one batch split across ranks
        tp               tensor parallel: big MLP / projection matrices split inside a node

Derived groups (see `ParallelPlan.group_ranks`): dp_shard = (dp_shard_mod_ep, ep) is the shard group
(for DeepSpeed the hpZ group at ZeRO-3 with replicas); data = (dp_replicate, dp_shard_mod_ep, ep, cp)
holds every rank that sees different examples or different sequences, is the group dense gradients
are averaged over and the group DeepSpeed partitions ZeRO over, at every stage;
expert_data = data without ep holds the replicas of one expert; sparse groups row-shard the
embedding tables over `sparse_shard` consecutive data ranks and sparse_replica joins the copies.

tp is innermost so its groups are consecutive local ranks of one node; ep and cp come next so
their groups stay inside a block; dp_replicate is outermost so only it (and the data group) crosses blocks.
Torch-free: the operator validates and logs the same plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from gem.parallel.topology import Level, Topology

MESH_AXES = ("dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")
"""The mesh axes, outermost first. "axis" is a mesh axis; "dim" is a tensor dimension."""

#: Derived groups: name -> the mesh axes they flatten.
FLAT_GROUPS = {
    "dp_shard": ("dp_shard_mod_ep", "ep"),
    "dp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
    "data": ("dp_replicate", "dp_shard_mod_ep", "ep", "cp"),
    "expert_data": ("dp_replicate", "dp_shard_mod_ep", "cp"),
}

#: Minimum output columns per tensor-parallel shard: narrower GEMMs waste the GPU and their
#: per-layer all-reduces cost more than the split saves (Megatron's guidance is similar).
TP_MIN_SHARD_WIDTH = 2048
#: Longest history one rank should hold; longer ones are split across context-parallel ranks.
CP_MAX_TOKENS_PER_RANK = 16384
#: Fraction of GPU memory auto_plan lets parameters + optimizer state take (rest: activations).
STATE_MEMORY_FRACTION = 0.5
#: Bytes of training state per parameter: bf16 weight + fp32 master + two fp32 Adam moments + bf16 grad.
STATE_BYTES_PER_PARAM = 16
#: Bytes per embedding row element kept by the sparse side (fp32 row + row-wise Adagrad state).
SPARSE_BYTES_PER_ELEMENT = 8


class PlanError(ValueError):
    """An impossible plan. The message names the dimension, its degree, the world size and the level."""

    def __init__(self, message: str, *, dimension: str, degree: int, world_size: int, level: str | None = None):
        super().__init__(message)
        self.dimension = dimension
        self.degree = degree
        self.world_size = world_size
        self.level = level


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelPlan:
    """The five parallel degrees of one job, checked against the world size when built."""

    world_size: int
    """Processes in the job (numNodes x procsPerNode)."""
    dp_replicate: int = 1
    """HSDP replicas (outermost axis); -1 means the ranks left after the others."""
    dp_shard: int = -1
    """Shard group size (DeepSpeed: the hpZ group at ZeRO-3 with replicas); -1 means the ranks left after the others."""
    ep: int = 1
    """Expert-parallel degree, carved from dp_shard: the experts are split over ep ranks."""
    cp: int = 1
    """Context-parallel degree: one batch's sequences are split over cp ranks."""
    tp: int = 1
    """Tensor-parallel degree: big MLP / projection matrices are split over tp ranks of a node."""
    sparse_shard: int = 0
    """Data ranks that row-shard each big embedding table; 0 means dp_shard x cp (one HSDP shard group)."""
    zero_stage: int = 1
    """DeepSpeed ZeRO stage, partitioned over the data group (0: plain data parallel; see _replicate_why)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: resolve -1 / 0 defaults in place
        w = self.world_size
        if w < 1:
            raise PlanError(f"world size must be >= 1, got {w}", dimension="world", degree=w, world_size=w)
        for name in ("ep", "cp", "tp"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)} must be >= 1 (world size {w})",
                                dimension=name, degree=getattr(self, name), world_size=w)
        if not 0 <= self.zero_stage <= 3:
            raise PlanError(f"zero_stage={self.zero_stage} must be 0..3", dimension="zero_stage",
                            degree=self.zero_stage, world_size=w)
        if self.dp_replicate == -1 and self.dp_shard == -1:
            set_(self, "dp_replicate", 1)
        fixed = self.cp * self.tp * max(self.dp_replicate, 1) * max(self.dp_shard, 1)
        for name in ("dp_replicate", "dp_shard"):
            if getattr(self, name) == -1:
                if w % fixed:
                    raise PlanError(self._product_message(f"{name}=-1 (the rest) is not a whole number"),
                                    dimension=name, degree=-1, world_size=w)
                set_(self, name, w // fixed)
            elif getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)} must be >= 1 or -1 (world size {w})",
                                dimension=name, degree=getattr(self, name), world_size=w)
        if self.dp_replicate * self.dp_shard * self.cp * self.tp != w:
            raise PlanError(self._product_message("the degrees do not multiply to the world size"),
                            dimension="world", degree=self.dp_replicate * self.dp_shard * self.cp * self.tp,
                            world_size=w)
        if self.dp_shard % self.ep:
            raise PlanError(
                f"ep={self.ep} must divide dp_shard={self.dp_shard}: expert parallelism borrows ranks of "
                f"the ZeRO shard group ({self.describe()}, world size {w})",
                dimension="ep", degree=self.ep, world_size=w)
        if self.sparse_shard == 0:
            set_(self, "sparse_shard", self.dp_shard * self.cp)
        if self.sparse_shard < 1 or self.data_world % self.sparse_shard:
            raise PlanError(
                f"sparse_shard={self.sparse_shard} must divide the {self.data_world} data ranks "
                f"(dp_replicate x dp_shard x cp; {self.describe()}, world size {w})",
                dimension="sparse_shard", degree=self.sparse_shard, world_size=w)

    def _product_message(self, what: str) -> str:
        return (f"{what}: dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x cp({self.cp}) "
                f"x tp({self.tp}) must equal the world size {self.world_size}")

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, world_size: int, zero_stage: int = 1) -> "ParallelPlan":
        """From camelCase or snake_case keys (dpReplicate, dpShard, ep, cp, tp, sparseShard, zeroStage)."""
        keys = {"dpReplicate": "dp_replicate", "dpShard": "dp_shard", "sparseShard": "sparse_shard",
                "zeroStage": "zero_stage"}
        known = {"dp_replicate", "dp_shard", "ep", "cp", "tp", "sparse_shard", "zero_stage"}
        kwargs: dict[str, int] = {"zero_stage": zero_stage}
        for key, value in config.items():
            name = keys.get(key, key)
            if name not in known:
                raise ValueError(f"unknown parallel plan key {key!r}; known: {', '.join(sorted(known))}")
            kwargs[name] = int(value)
        return cls(world_size=world_size, **kwargs)

    # ------------------------------------------------------------------ degrees

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def data_world(self) -> int:
        """Ranks that see different data: dp_replicate x dp_shard x cp."""
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp_replicate, self.dp_shard_mod_ep, self.ep, self.cp, self.tp)

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def sparse_enabled(self) -> bool:
        return self.sparse_shard > 1

    def axis_size(self, axis: str) -> int:
        return self.mesh_shape[MESH_AXES.index(axis)]

    def span(self, axis: str) -> int:
        """Consecutive ranks one group of `axis` lies in: its size times every inner axis."""
        i = MESH_AXES.index(axis)
        return math.prod(self.mesh_shape[i:])

    # ------------------------------------------------------------------ groups

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's coordinate on every mesh axis."""
        out, rest = {}, rank
        for axis, size in zip(reversed(MESH_AXES), reversed(self.mesh_shape)):
            out[axis] = rest % size
            rest //= size
        return {axis: out[axis] for axis in MESH_AXES}

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of `name` (a mesh axis, a FLAT_GROUPS name, sparse or sparse_replica), as rank lists."""
        if name in ("sparse", "sparse_replica"):
            return self._sparse_groups(replica=name == "sparse_replica")
        axes = FLAT_GROUPS.get(name, (name,))
        if any(a not in MESH_AXES for a in axes):
            raise KeyError(f"no group {name!r}; known: {', '.join(MESH_AXES + tuple(FLAT_GROUPS))}, sparse, sparse_replica")
        shape = self.mesh_shape
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        inner = [i for i, a in enumerate(MESH_AXES) if a in axes]
        outer = [i for i, a in enumerate(MESH_AXES) if a not in axes]
        groups = []
        for fixed in itertools.product(*(range(shape[i]) for i in outer)):
            base = sum(c * strides[i] for c, i in zip(fixed, outer))
            groups.append([base + sum(c * strides[i] for c, i in zip(var, inner))
                           for var in itertools.product(*(range(shape[i]) for i in inner))])
        return groups

    def _sparse_groups(self, *, replica: bool) -> list[list[int]]:
        s, tp, n = self.sparse_shard, self.tp, self.data_world
        groups = []
        for t in range(tp):
            data_ranks = [t + tp * i for i in range(n)]  # tp is innermost: data ranks of one tp index
            chunks = [data_ranks[g * s:(g + 1) * s] for g in range(n // s)]
            groups.extend([list(col) for col in zip(*chunks)] if replica else chunks)
        return groups

    def group_of(self, name: str, rank: int) -> list[int]:
        for group in self.group_ranks(name):
            if rank in group:
                return group
        raise AssertionError(f"rank {rank} is in no {name} group")  # pragma: no cover

    # ------------------------------------------------------------------ topology

    def required_levels(self, topology: Topology, overrides: Mapping[str, str] | None = None) -> dict[str, Level]:
        """The level each constrained dimension's groups must stay inside.

        tp: the node (its all-reduces run every layer, only NVLink keeps up). ep and cp: the
        topology's block (activations cross them every layer). dp_shard and dp_replicate have no
        hard limit: GEM shards FSDP across nodes; auto_plan keeps dp_shard in a block when it can.
        """
        names = {"tp": topology.node.name, "ep": topology.block.name, "cp": topology.block.name}
        names.update(overrides or {})
        return {dim: topology.level(level) for dim, level in names.items()}

    def validate(self, topology: Topology, *, levels: Mapping[str, str] | None = None) -> None:
        """Raise PlanError unless the plan fits the topology (world size and group placement)."""
        w = self.world_size
        if topology.world_size != w:
            raise PlanError(
                f"the plan is for {w} ranks but the topology has {topology.world_size} "
                f"({topology.num_nodes} nodes x {topology.procs_per_node} procs/node)",
                dimension="world", degree=w, world_size=topology.world_size)
        spans = {"tp": ("tp", self.span("tp")), "cp": ("cp x tp", self.span("cp")),
                 "ep": ("ep x cp x tp", self.span("ep"))}
        for dim, level in self.required_levels(topology, levels).items():
            what, span = spans[dim]
            degree = getattr(self, dim)
            if degree == 1:
                continue
            if span > level.size or level.size % span:
                label = f", node label {level.label}" if level.label else ""
                raise PlanError(
                    f"{dim}={degree} does not fit the topology: each {_LONG[dim]} group spans {what} = "
                    f"{span} consecutive ranks, which must divide one {level.name!r} domain "
                    f"({level.size} ranks{label}); world size {w}, {self.describe()}",
                    dimension=dim, degree=degree, world_size=w, level=level.name)

    def group_levels(self, topology: Topology) -> dict[str, str]:
        """Innermost level each axis's groups stay inside (for logs and the status)."""
        return {axis: topology.innermost_level_holding(self.span(axis)).name
                for axis in MESH_AXES if self.axis_size(axis) > 1}

    # ------------------------------------------------------------------ reporting

    def describe(self) -> str:
        return (f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} ep={self.ep} cp={self.cp} "
                f"tp={self.tp} sparse_shard={self.sparse_shard} zero_stage={self.zero_stage}")

    def to_dict(self) -> dict[str, int]:
        """camelCase degrees, as the trainer reports them and the operator shows them in status."""
        camel = {"dp_replicate": "dpReplicate", "dp_shard": "dpShard", "sparse_shard": "sparseShard",
                 "zero_stage": "zeroStage", "world_size": "worldSize"}
        return {camel.get(k, k): v for k, v in asdict(self).items()}


_LONG = {"tp": "tensor-parallel", "cp": "context-parallel", "ep": "expert-parallel"}


# ---------------------------------------------------------------------------- auto plan


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShapeHints:
    """What auto_plan needs to know about the model; zero means "unknown / not present"."""

    dense_params: int = 0
    """Parameters outside the embedding tables and the experts."""
    hidden_dim: int = 0
    """Output width of the widest layer tensor parallelism can split (the model's tp plan: attention
    heads' q width, an MLP's hidden width); 0: none or unknown."""
    hidden_units: int = 0
    """Indivisible pieces of that width (attention heads): tp must divide it; 0: any divisor of hidden_dim."""
    num_experts: int = 0
    """Dense ensemble experts (Wukong/DHEN); 0 or 1 means no expert parallelism."""
    expert_params: int = 0
    """Parameters of one expert."""
    max_seq_len: int = 0
    """Longest event history of one example, in tokens."""
    sparse_params: int = 0
    """Elements of all big embedding tables (rows x dim)."""
    gpu_memory_bytes: int = 80 * 2**30
    """Memory of one GPU."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


DIMS = frozenset({"dp_replicate", "dp_shard", "ep", "cp", "tp", "sparse_shard"})


#: The dimensions the automatic plan always may choose on the DeepSpeed trainer path (gem/parallel/deepspeed_config.py).
#: ep and sparse_shard also run there, at ZeRO-1/2, with their shards stepped outside DeepSpeed's optimizer
#: (gem/train/optim.py ShardOptimizer): deepspeed_auto_dims adds ep when the job's stage and precision allow
#: it; sparse_shard only runs when given explicitly (spec.parallelism.plan).
DEEPSPEED_DIMS = frozenset({"dp_replicate", "dp_shard", "cp", "tp"})

#: ZeRO stages that can keep expert and embedding-row shards out of DeepSpeed (split_for_deepspeed).
SHARD_ZERO_STAGES = (1, 2)


def deepspeed_auto_dims(zero_stage: int, precision: str = "fp32") -> tuple[frozenset[str], dict[str, str]]:
    """(the dims the automatic plan may choose on the DeepSpeed path, why each other one stays 1).

    ep joins DEEPSPEED_DIMS when the job can run expert shards outside DeepSpeed's optimizer
    (gem/train/optim.py ShardOptimizer): ZeRO-1/2 and fp32. sparse_shard stays explicit-only: it
    changes every big table's layout and checkpoint, which a job that never asked for it should not get.
    The trainer (gem/parallel/job.py choose_plan) and the operator both come through here.
    """
    precision = str(getattr(precision, "value", precision))
    why = {"sparse_shard": "row sharding runs on the DeepSpeed path only when given in spec.parallelism.plan"}
    if zero_stage == 0:
        why["ep"] = "ZeRO-0 all-reduces every module gradient over the data group, expert shards cannot stay outside"
    elif zero_stage == 3:
        why["ep"] = "ZeRO-3 partitions every parameter, expert shards cannot stay outside"
    elif precision != "fp32":
        why["ep"] = f"precision {precision}: expert shards would train outside DeepSpeed without fp32 master weights"
    else:
        return DEEPSPEED_DIMS | {"ep"}, why
    return DEEPSPEED_DIMS, why


#: Precisions that run DeepSpeed's bf16 mode (mxfp8: MX matmuls inside it, gem/train/precision.py).
BF16_PRECISIONS = ("bf16", "mxfp8")
_SPEC_FIELD = {"ep": "ep", "sparse_shard": "sparseShard"}


def check_deepspeed_plan(plan: ParallelPlan, precision: Any = None) -> None:
    """Raise PlanError for what the DeepSpeed path cannot run (named dimension, degree, world).

    `precision` (spec.training.precision; None: not checked) matters to the shards kept outside
    DeepSpeed: see the bf16 rule below. The operator (gem_operator/parallel.py) and the trainer
    (gem/parallel/setup.py) both pass it, so a spec the trainer refuses is Invalid before it runs.
    """
    for dim, degree in (("ep", plan.ep), ("sparse_shard", plan.sparse_shard)):
        if degree > 1 and plan.zero_stage not in SHARD_ZERO_STAGES:
            raise PlanError(
                f"{dim}={degree} is not supported with DeepSpeed at zero_stage {plan.zero_stage}: its shards are "
                f"reduced over the {'expert_data' if dim == 'ep' else 'sparse_replica'} group and stepped outside "
                f"DeepSpeed's optimizer, which needs zero_stage 1 or 2 (stage 0 all-reduces every module gradient, "
                f"stage 3 partitions every module parameter); set zeroStage to 1 or 2, or {dim} to 1 "
                f"(world size {plan.world_size}, {plan.describe()})", dimension=dim, degree=degree,
                world_size=plan.world_size)
    precision = str(getattr(precision, "value", precision)) if precision is not None else None
    if precision not in BF16_PRECISIONS:
        return
    # DeepSpeed's bf16 mode casts the whole module to bf16 and keeps the fp32 master weights in its
    # own optimizer only. The expert / embedding-row shards are stepped outside it (ShardOptimizer,
    # gem/train/optim.py: a plain AdamW on the module's own parameters), so they would be updated
    # in bf16 with no fp32 master copy: updates below bf16's 8-bit mantissa vanish. (At ZeRO-1,
    # DeepSpeed's bf16 optimizer is also not the ZeRO optimizer ShardOptimizer.attach hooks into.)
    for dim, degree in (("ep", plan.ep), ("sparse_shard", plan.sparse_shard)):
        if degree > 1:
            what = "expert" if dim == "ep" else "embedding-row"
            raise PlanError(
                f"spec.parallelism.plan.{_SPEC_FIELD[dim]}={degree} with spec.training.precision {precision} is not "
                f"supported: DeepSpeed's bf16 mode{' (which mxfp8 runs in)' if precision == 'mxfp8' else ''} keeps "
                f"fp32 master weights only for the parameters of its own optimizer, and the {what} shards are "
                f"stepped outside it, so they would train in bf16 without fp32 master weights. Set "
                f"spec.training.precision to fp32, or spec.parallelism.plan.{_SPEC_FIELD[dim]} to 1 "
                f"(world size {plan.world_size}, {plan.describe()})",
                dimension=dim, degree=degree, world_size=plan.world_size)


#: Where fixed degrees come from, for the reason text.
GIVEN = "given in spec.parallelism.plan"


def auto_plan(world_size: int, topology: Topology, hints: ModelShapeHints = ModelShapeHints(), *,
              zero_stage: int = 1, allowed: frozenset[str] = DIMS, fixed: Mapping[str, int] | None = None,
              given: str = GIVEN, why_not: Mapping[str, str] | None = None) -> tuple[ParallelPlan, str]:
    """A plan for world_size ranks on topology, with the most talkative dimension on the fastest links.

    Rules, in order: tp inside a node (only for matrices wide enough to split); cp and ep inside
    the node if they fit, else inside the block; the ZeRO shard group over the rest of one block;
    replicas across blocks. Dimensions not in `allowed` stay at 1 (the caller cannot run them;
    `why_not[dim]` says why in the reason).
    `fixed` (snake_case degrees, dp_* may be -1 for "the rest") are kept as given and the others
    chosen around them. Returns the plan and the reasons, one clause per decision, joined by "; ".
    """
    if topology.world_size != world_size:
        raise PlanError(f"world size {world_size} does not match the topology ({topology.describe()})",
                        dimension="world", degree=world_size, world_size=topology.world_size)
    fixed = dict(fixed or {})
    why_not = dict(why_not or {})
    unknown = sorted(set(fixed) - DIMS)
    if unknown:
        raise ValueError(f"unknown parallel degrees {unknown}; known: {', '.join(sorted(DIMS))}")
    node, block = topology.node.size, topology.block.size
    why: list[str] = []
    shard_given = fixed.get("dp_shard", -1)
    replicate_given = fixed.get("dp_replicate", -1)
    # The ranks the given data degrees leave for tp x cp: the free degrees are chosen inside them, so
    # a feasible spec is not refused because an automatic choice ignored a given degree.
    fixed_dp = max(shard_given, 1) * max(replicate_given, 1)
    room = world_size // fixed_dp if world_size % fixed_dp == 0 else world_size  # else the plan names it

    # tp: per-layer all-reduces of activations -> only NVLink, only for wide matrices.
    tp = fixed.get("tp", 1)
    if "tp" in fixed:
        why.append(f"tp={tp}: {given}")
    elif hints.hidden_dim and "tp" in allowed:
        for cand in _divisors(node):
            if hints.hidden_dim % cand == 0 and hints.hidden_dim // cand >= TP_MIN_SHARD_WIDTH \
                    and (not hints.hidden_units or hints.hidden_units % cand == 0) \
                    and room % (cand * fixed.get("cp", 1)) == 0:  # heads stay whole; fits the given degrees
                tp = cand
    units = f", {hints.hidden_units} heads" if hints.hidden_units else ""
    if "tp" not in fixed:
        why.append(f"tp={tp}: " + (
        f"the widest projection tp can split ({hints.hidden_dim}{units}) splits into {tp} shards of >= "
        f"{TP_MIN_SHARD_WIDTH} columns inside one node ({node} ranks, NVLink)" if tp > 1 else
        f"no projection is wide enough to split (needs >= {2 * TP_MIN_SHARD_WIDTH} columns, "
        f"widest tp can split {hints.hidden_dim or 'unknown'}{units})"))

    # cp: per-layer key/value traffic -> inside a node if possible, else a block.
    cp = fixed.get("cp", 1)
    if "cp" in fixed:
        why.append(f"cp={cp}: {given}")
    elif hints.max_seq_len > CP_MAX_TOKENS_PER_RANK and "cp" in allowed:
        need = math.ceil(hints.max_seq_len / CP_MAX_TOKENS_PER_RANK)
        options = [d for d in _divisors(block // tp) if room % (d * tp) == 0]  # none: a given tp that cannot fit
        fits = [d for d in options if d >= need]
        cp = min(fits) if fits else max(options, default=1)
    if "cp" not in fixed:
        why.append(f"cp={cp}: " + (
        f"histories up to {hints.max_seq_len} tokens are split so each rank holds <= "
        f"{math.ceil(hints.max_seq_len / cp)} tokens, inside one {_level_for(topology, cp * tp)}"
        if cp > 1 else f"histories (max {hints.max_seq_len or 'unknown'} tokens) fit one rank "
        f"(<= {CP_MAX_TOKENS_PER_RANK})"))

    if world_size % (tp * cp):  # the plan's own check names the product
        ParallelPlan(world_size=world_size, tp=tp, cp=cp, dp_shard=-1, zero_stage=zero_stage)
    data_world = world_size // (tp * cp)
    data_in_block = max(1, block // (tp * cp)) if block >= tp * cp else 1
    # ep borrows ranks of dp_shard: the given one, or what the given dp_replicate leaves
    shard_target = shard_given if shard_given >= 1 else data_world // max(replicate_given, 1)

    # ep: activations all-gathered and reduce-scattered around every expert layer -> fastest links.
    ep = fixed.get("ep", 1)
    if "ep" in fixed:
        _check_given_ep(ep, hints.num_experts, world_size, given)
        why.append(f"ep={ep}: {given}")
    elif hints.num_experts > 1 and "ep" in allowed:
        cands = [d for d in _divisors(hints.num_experts) if d * cp * tp <= block and block % (d * cp * tp) == 0
                 and data_world % d == 0 and shard_target % d == 0]
        in_node = [d for d in cands if node % (d * cp * tp) == 0]  # aligned groups that divide a node stay in it
        ep = max(in_node) if in_node and max(in_node) > 1 else max(cands, default=1)
    if "ep" not in fixed:
        why.append(f"ep={ep}: " + (
        f"{hints.num_experts} dense experts, {hints.num_experts // ep} per rank, each expert-parallel "
        f"group inside one {_level_for(topology, ep * cp * tp)}" if ep > 1 else
        (why_not.get("ep") or "expert parallelism is not available here") if "ep" not in allowed else
        "no dense expert ensemble" if hints.num_experts <= 1 else
        "the experts cannot be split inside a block"))

    # dp_shard: ZeRO all-gathers/reduce-scatters every step -> one block; at least what memory needs.
    if shard_given >= 1 or (shard_given == -1 and "dp_shard" in fixed) or replicate_given >= 1:
        if shard_given >= 1:
            dp_shard = shard_given
        else:  # the rest after the given replicas (or all data ranks)
            dp_shard = max(1, data_world // max(replicate_given, 1))
        why.append(f"dp_shard={dp_shard}: " + (given if shard_given >= 1 else
                                                 f"the data ranks left after dp_replicate={max(replicate_given, 1)} "
                                                 f"({given})"))
    elif zero_stage == 0:
        dp_shard = ep
        why.append(f"dp_shard={dp_shard}: zeroStage 0 keeps a full copy of the state on every rank")
    else:
        per_rank_budget = hints.gpu_memory_bytes * STATE_MEMORY_FRACTION
        state = (hints.dense_params + hints.num_experts * hints.expert_params / max(ep, 1)) * STATE_BYTES_PER_PARAM / tp
        need = max(1, math.ceil(state / per_rank_budget)) if state else 1
        cands = [d for d in _divisors(data_world) if d % ep == 0]
        in_block = [d for d in cands if d <= data_in_block and data_in_block % d == 0]
        dp_shard = max(in_block) if in_block else ep
        if need > dp_shard:
            dp_shard = min((d for d in cands if d >= need), default=data_world)
            why.append(f"dp_shard={dp_shard}: the training state ({state / 2**30:.0f} GiB) needs >= {need} "
                       f"shards, more than one {topology.block.name} holds, so ZeRO shards cross "
                       f"{_level_for(topology, dp_shard * cp * tp)} boundaries")
        else:
            why.append(f"dp_shard={dp_shard}: " + _shard_why(zero_stage, data_world // dp_shard, dp_shard,
                                                             _level_for(topology, dp_shard * cp * tp)))
    dp_replicate = replicate_given if replicate_given >= 1 else max(1, data_world // dp_shard)
    if replicate_given >= 1:
        why.append(f"dp_replicate={dp_replicate}: {given}")
    else:
        why.append(f"dp_replicate={dp_replicate}: " + (
            _replicate_why(zero_stage, data_world * cp, dp_shard, _level_for(topology, dp_shard * cp * tp))
            if dp_replicate > 1 else "a single replica"))

    # sparse: row-wise shards inside the shard group (all-to-all stays in the block) unless too big.
    sparse = fixed.get("sparse_shard", dp_shard * cp if "sparse_shard" in allowed else 1)
    data_ranks = data_world * cp  # what row shards range over: cp peers are data ranks too (plan.data_world)
    if "sparse_shard" in fixed:
        why.append(f"sparse_shard={sparse}: {given}")
    elif hints.sparse_params and "sparse_shard" in allowed:
        budget = hints.gpu_memory_bytes * STATE_MEMORY_FRACTION
        need = math.ceil(hints.sparse_params * SPARSE_BYTES_PER_ELEMENT / budget)
        if need > sparse:
            sparse = min((d for d in _divisors(data_ranks) if d >= need), default=data_ranks)
    if "sparse_shard" not in fixed:
        why.append(f"sparse_shard={sparse}: embedding rows are sharded over {sparse} data ranks "
               f"(inside one {_level_for(topology, sparse * tp)}) and replicated {data_ranks // sparse}x"
               if sparse > 1 else "sparse_shard=1: embedding tables are replicated" +
               ("" if "sparse_shard" in allowed else
                f" ({why_not.get('sparse_shard', 'row sharding is not available here')})"))

    plan = ParallelPlan(world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp_shard, ep=ep, cp=cp,
                        tp=tp, sparse_shard=sparse, zero_stage=zero_stage)
    plan.validate(topology)
    return plan, "; ".join(why)


def _check_given_ep(ep: int, num_experts: int, world_size: int, given: str) -> None:
    """A given ep must split the model's experts evenly: parallelize would refuse it on every rank at setup,
    after the operator had accepted the spec (0 or 1 experts: nothing to split, parallelize warns)."""
    if num_experts > 1 and ep > 1 and num_experts % ep:
        options = [str(d) for d in _divisors(num_experts)]
        raise PlanError(
            f"ep={ep} ({given}) cannot split the model's {num_experts} dense experts evenly over the ranks of an "
            f"expert-parallel group; set ep to {', '.join(options[:-1])} or {options[-1]} (world size {world_size})",
            dimension="ep", degree=ep, world_size=world_size)


# What DeepSpeed 0.19 does with the split (gem/parallel/comm_model.py cites its source): ZeRO partitions
# over the whole data group (dp_replicate x dp_shard x cp) at every stage; only ZeRO-3 with hpZ
# (dp_replicate > 1 and dp_shard > 1) uses the dp_shard group, for its backward all-gathers.
def _shard_why(zero_stage: int, replicas: int, dp_shard: int, where: str) -> str:
    if replicas == 1:
        return (f"ZeRO-{zero_stage} partitions over every data rank, all in one {where}, so its all-gathers "
                f"and gradient reductions stay on its links")
    if zero_stage == 3 and dp_shard > 1:
        return (f"every data rank of one {where} forms an hpZ (ZeRO++) group, which keeps ZeRO-3's backward "
                f"parameter all-gathers on its links")
    if zero_stage == 3:
        return f"one shard per {where}, so no hpZ group (ZeRO-3 partitions over all data ranks)"
    return (f"every data rank of one {where}, the group the expert and embedding-row groups are carved from "
            f"(ZeRO-{zero_stage} itself partitions over all data ranks)")


def _replicate_why(zero_stage: int, data_world: int, dp_shard: int, where: str) -> str:
    if zero_stage == 3 and dp_shard == 1:  # no hpZ without a shard group
        return (f"one replica per {where}: ZeRO-3 partitions over all {data_world} data ranks, so both parameter "
                f"all-gathers and the gradient reduce-scatter span every replica")
    if zero_stage == 3:
        return (f"one hpZ group per {where}, but ZeRO-3 partitions over all {data_world} data ranks, so the "
                f"forward parameter all-gather and the gradient reduce-scatter span every replica")
    if zero_stage in (1, 2):
        return (f"one group per {where} for the expert and embedding-row groups, but ZeRO-{zero_stage} partitions "
                f"over all {data_world} data ranks, so the gradient all-reduce and the parameter all-gather span "
                f"every replica")
    return f"one group per {where}, and ZeRO-0 all-reduces the gradients over all {data_world} data ranks"


def _level_for(topology: Topology, span: int) -> str:
    level = topology.innermost_level_holding(span)
    return f"{level.name} ({level.size} ranks)"
