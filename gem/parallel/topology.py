"""The network hierarchy a job runs on: GPUs per node and the levels above the node.

    level      domain (ranks)      links inside one domain      example label key
    node       procsPerNode        NVLink / shared memory       kubernetes.io/hostname
    clique     nodes per clique    NVLink switch (NVL72)        nvidia.com/gpu.clique
    block      nodes per block     one InfiniBand leaf/spine    cloud.provider.com/topology-block
    zone       nodes per zone      oversubscribed spine         topology.kubernetes.io/zone
    cluster    the whole job       whatever is left             -

A `Topology` is the job's view of that hierarchy: each level is a domain size in *ranks*, innermost
first, every size a multiple of the one below it and a divisor of the world size. Those sizes are
what the placement guarantees (see gem/parallel/placement.py): consecutive node ranks fill one
domain before the next one starts, so a group of consecutive ranks whose span divides a level's
size never leaves one domain of that level.

The levels above the node come from the spec (`parallelism.topology.levels`, node-label keys from
the innermost up) and their sizes from the node pool (`NodePool`: how many nodes one domain of
each label holds). Torch-free: the operator builds the same Topology to plan and place the job.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: The node-label key of the node level itself (every Kubernetes node has it).
HOSTNAME_LABEL = "kubernetes.io/hostname"

#: Per-GPU bandwidth (GB/s, one direction) assumed for a level when the node pool names none.
#: Index 0 is inside a node (H100/H200 NVLink: 900 GB/s bidirectional), 1 is the first level
#: above the node (one 400 Gb/s NIC per GPU, non-blocking inside a block), then each further level
#: is oversubscribed 4:1 relative to the one below (typical spine / inter-zone links).
DEFAULT_BANDWIDTH_GBPS = (450.0, 50.0, 12.5, 3.125)

#: Short names of well-known label keys, for logs and error messages.
_SHORT_NAMES = {
    HOSTNAME_LABEL: "node",
    "nvidia.com/gpu.clique": "clique",
    "topology.kubernetes.io/zone": "zone",
    "topology.kubernetes.io/region": "region",
    "cloud.google.com/gce-topology-block": "block",
    "cloud.google.com/gce-topology-subblock": "subblock",
    "cloud.provider.com/topology-block": "block",
    "cloud.provider.com/topology-rack": "rack",
    "network.topology.kubernetes.io/block": "block",
    "network.topology.kubernetes.io/spine": "spine",
}


def short_name(label: str) -> str:
    """`cloud.provider.com/topology-block` -> `block`: a readable name for a label key."""
    if label in _SHORT_NAMES:
        return _SHORT_NAMES[label]
    tail = label.rsplit("/", 1)[-1]
    for prefix in ("topology-", "gpu.", "network-"):
        tail = tail.removeprefix(prefix)
    return tail or label


@dataclass(frozen=True, kw_only=True, slots=True)
class Level:
    """One level of the hierarchy: domains of `size` consecutive ranks."""

    name: str
    """Short name used in logs, errors and the benchmark (node, clique, block, zone, cluster)."""
    label: str | None
    """Node-label key whose value names the domain; None for the whole-job level."""
    size: int
    """Ranks in one domain of this level (a multiple of the level below, a divisor of the world)."""
    bandwidth_gbps: float
    """Per-rank bandwidth (GB/s, one direction) of a link that stays inside one domain of this level."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodePool:
    """What the node pool offers at each topology level: nodes per domain (and optionally bandwidth).

    Build it by hand (`NodePool(nodes_per_domain={"cloud.provider.com/topology-block": 32})`), or
    from the pool's Node objects with `NodePool.from_nodes(nodes, labels)`.
    """

    nodes_per_domain: Mapping[str, int] = field(default_factory=dict)
    """Label key -> nodes one domain of that label can hold (the smallest domain, to be safe)."""
    bandwidth_gbps: Mapping[str, float] = field(default_factory=dict)
    """Label key -> per-rank bandwidth inside one domain of that label; defaults by position."""

    @classmethod
    def from_nodes(cls, nodes: Iterable[Mapping], labels: Sequence[str]) -> "NodePool":
        """Domain sizes from Kubernetes Node objects (dicts with metadata.labels), per label key.

        The size of a level is its *smallest* domain: a slice of that many nodes fits in any of them.
        Nodes without the label are left out (they cannot be placed by it).
        """
        sizes: dict[str, int] = {}
        node_labels = [((n.get("metadata") or {}).get("labels") or {}) for n in nodes]
        for label in labels:
            counts = Counter(lbls[label] for lbls in node_labels if label in lbls)
            if counts:
                sizes[label] = min(counts.values())
        return cls(nodes_per_domain=sizes)


class TopologyError(ValueError):
    """The hierarchy cannot be built from the spec and node pool given."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The job's hierarchy: `levels[0]` is the node, `levels[-1]` the whole job."""

    procs_per_node: int
    """Trainer processes (GPUs) per node."""
    num_nodes: int
    """Nodes (pods) in the job."""
    levels: tuple[Level, ...]
    """Innermost first; levels[0] is the node level, levels[-1] the whole job ("cluster")."""

    def __post_init__(self) -> None:
        world = self.world_size
        if not self.levels or self.levels[0].size != self.procs_per_node:
            raise TopologyError(f"levels[0] must be the node level of {self.procs_per_node} ranks")
        if self.levels[-1].size != world:
            raise TopologyError(f"the last level must hold the whole job ({world} ranks), not {self.levels[-1].size}")
        for inner, outer in zip(self.levels, self.levels[1:]):
            if outer.size % inner.size:
                raise TopologyError(
                    f"level {outer.name!r} ({outer.size} ranks) is not a whole number of "
                    f"{inner.name!r} domains ({inner.size} ranks)"
                )

    # ------------------------------------------------------------------ construction

    @classmethod
    def build(
        cls,
        *,
        procs_per_node: int,
        num_nodes: int,
        level_labels: Sequence[str] = (),
        pool: NodePool | None = None,
    ) -> "Topology":
        """The hierarchy for a job of num_nodes x procs_per_node ranks.

        Each label's domain size is the largest divisor of num_nodes that fits in the pool's
        domain and is a multiple of the level below: the slice the placement asks the scheduler
        for (gem/parallel/placement.py). A label the pool does not describe is an error.
        """
        if procs_per_node < 1 or num_nodes < 1:
            raise TopologyError(f"procsPerNode ({procs_per_node}) and numNodes ({num_nodes}) must be >= 1")
        pool = pool or NodePool()
        bw = DEFAULT_BANDWIDTH_GBPS
        levels = [Level(name="node", label=HOSTNAME_LABEL, size=procs_per_node, bandwidth_gbps=bw[0])]
        below_nodes = 1
        for i, label in enumerate(level_labels, start=1):
            if label not in pool.nodes_per_domain:
                raise TopologyError(
                    f"topology level {label!r} is not described by the node pool: no node carries the "
                    f"label, or its domain size was not given (known: {sorted(pool.nodes_per_domain) or 'none'})"
                )
            capacity = pool.nodes_per_domain[label]
            nodes = _largest_divisor(num_nodes, at_most=capacity, multiple_of=below_nodes)
            default_bw = bw[min(i, len(bw) - 1)]
            levels.append(Level(name=short_name(label), label=label, size=nodes * procs_per_node,
                                bandwidth_gbps=pool.bandwidth_gbps.get(label, default_bw)))
            below_nodes = nodes
        levels.append(Level(name="cluster", label=None, size=num_nodes * procs_per_node,
                            bandwidth_gbps=bw[min(len(level_labels) + 1, len(bw) - 1)]))
        return cls(procs_per_node=procs_per_node, num_nodes=num_nodes, levels=tuple(levels))

    @classmethod
    def from_spec(cls, parallelism, pool: NodePool | None = None) -> "Topology":
        """From a ParallelismSpec (numNodes, procsPerNode, topology.levels) and its node pool."""
        return cls.build(procs_per_node=parallelism.procs_per_node, num_nodes=parallelism.num_nodes,
                         level_labels=list(parallelism.topology.levels), pool=pool)

    @classmethod
    def simulated(cls, *, num_gpus: int, gpus_per_node: int, nodes_per_level: Sequence[tuple[str, int]]) -> "Topology":
        """A made-up cluster for benchmarks: e.g. 1024 GPUs, 8 per node, [("block", 32)]."""
        if num_gpus % gpus_per_node:
            raise TopologyError(f"{num_gpus} GPUs are not a whole number of {gpus_per_node}-GPU nodes")
        labels = [f"sim/{name}" for name, _ in nodes_per_level]
        pool = NodePool(nodes_per_domain={f"sim/{name}": n for name, n in nodes_per_level})
        return cls.build(procs_per_node=gpus_per_node, num_nodes=num_gpus // gpus_per_node,
                         level_labels=labels, pool=pool)

    # ------------------------------------------------------------------ queries

    @property
    def world_size(self) -> int:
        return self.procs_per_node * self.num_nodes

    @property
    def node(self) -> Level:
        return self.levels[0]

    @property
    def block(self) -> Level:
        """The level expert- and context-parallel groups must stay in by default.

        The level named "block" when the spec has one, else the first level above the node (the
        whole job when the spec names no levels). It is the domain of the fastest links beyond one
        node; auto_plan also keeps the ZeRO shard group inside it when it can.
        """
        for lvl in self.levels[1:]:
            if lvl.name == "block":
                return lvl
        return self.levels[1] if len(self.levels) > 1 else self.levels[0]

    def level(self, name: str) -> Level:
        """The level called name (short name or label key)."""
        for lvl in self.levels:
            if name in (lvl.name, lvl.label):
                return lvl
        raise KeyError(f"no topology level {name!r} (levels: {', '.join(lv.name for lv in self.levels)})")

    def innermost_level_holding(self, span: int) -> Level:
        """The innermost level of which one domain holds every aligned group of `span` ranks."""
        for lvl in self.levels:
            if span <= lvl.size and lvl.size % span == 0:
                return lvl
        return self.levels[-1]

    def nodes_per_domain(self, level: Level) -> int:
        return max(1, level.size // self.procs_per_node)

    def common_level(self, rank_a: int, rank_b: int) -> Level:
        """The innermost level whose domain holds both ranks (the link between them)."""
        for lvl in self.levels:
            if rank_a // lvl.size == rank_b // lvl.size:
                return lvl
        return self.levels[-1]

    def describe(self) -> str:
        """`8 procs/node x 128 nodes; node=8, block=256 (32 nodes), cluster=1024`"""
        parts = [f"{lvl.name}={lvl.size}" + (f" ({self.nodes_per_domain(lvl)} nodes)" if 0 < i < len(self.levels) - 1 else "")
                 for i, lvl in enumerate(self.levels)]
        return f"{self.procs_per_node} procs/node x {self.num_nodes} nodes; " + ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "procsPerNode": self.procs_per_node,
            "numNodes": self.num_nodes,
            "levels": [{"name": lv.name, "label": lv.label, "ranks": lv.size,
                        "nodes": self.nodes_per_domain(lv), "bandwidthGBps": lv.bandwidth_gbps}
                       for lv in self.levels],
        }


def _largest_divisor(n: int, *, at_most: int, multiple_of: int) -> int:
    """The largest d with d | n, d <= at_most and multiple_of | d (at least multiple_of)."""
    best = multiple_of
    for d in range(multiple_of, min(n, max(at_most, multiple_of)) + 1, multiple_of):
        if n % d == 0:
            best = d
    return best
