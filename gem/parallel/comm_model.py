"""Bytes each collective of a training step moves on each network level, for a plan on a cluster.

Model (deliberately simple, stated so it can be checked):
  * ring all-gather / reduce-scatter of S bytes over n ranks: every rank sends (n-1)/n x S to its
    successor in group order (the ring closes from the last member to the first); all-reduce is
    reduce-scatter + all-gather. All-to-all: every rank sends S/n to every other member.
  * a message between two ranks travels on the innermost level whose domain holds both
    (node = NVLink, block = inside one block, above = across blocks); bytes are counted once, at
    that level, summed over every rank of the job.
  * ranks sit where the placement puts them: `node_order[k]` is the physical slot of node rank k
    (identity under Kueue TAS; a shuffle for a topology-blind scheduler).
What is moved per step comes from `Workload` (bf16 everywhere):
  dp_shard     ZeRO-3: all-gather params in forward and again in backward, reduce-scatter grads
               (ZeRO-1/2: one reduce-scatter of grads + one all-gather of updated params), over
               dp_shard x cp: cp ranks see different sequences, so they are data ranks too
  dp_replicate all-reduce of the 1/(dp_shard x cp) gradient shard (HSDP)
  tp           one all-reduce of activations per MLP in forward and one in backward (Megatron)
  ep           all-gather of expert inputs + reduce-scatter of outputs, forward and backward
  cp           all-gather of keys/values per sequence layer forward, reduce-scatter of their grads
  sparse       all-to-all of looked-up rows forward and of their gradients backward
Torch-free.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from gem.parallel.plan import MESH_AXES, ParallelPlan
from gem.parallel.topology import Topology

BYTES = 2  # bf16


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """Per-step traffic drivers of a GEM-like model on one rank."""

    dense_params: int
    """Parameters of the dense model outside the experts (ZeRO-sharded)."""
    tp_fraction: float = 0.5
    """Share of the dense parameters in tensor-parallel MLPs / projections (split over tp)."""
    num_experts: int = 1
    expert_params: int = 0
    """Parameters of one dense expert."""
    examples_per_rank: int = 1024
    """Local batch of one data rank (GEM-26: 1K+ per GPU)."""
    tokens_per_example: int = 1024
    """Mean event-history length."""
    interaction_tokens: int = 64
    """Tokens per example entering the MLPs and experts (non-sequence + summary tokens)."""
    d_model: int = 512
    tp_layers: int = 8
    """MLPs split by tensor parallelism (each: one all-reduce forward, one backward)."""
    expert_layers: int = 4
    seq_layers: int = 4
    """Sequence layers whose keys/values context parallelism exchanges."""
    sparse_lookups_per_example: int = 512
    sparse_dim: int = 128


def _ring(group: Sequence[int], per_rank_bytes: float):
    n = len(group)
    for i in range(n):
        yield group[i], group[(i + 1) % n], per_rank_bytes


def _pairs(group: Sequence[int], per_pair_bytes: float):
    for a, b in itertools.permutations(group, 2):
        yield a, b, per_pair_bytes


class _Counter:
    def __init__(self, topology: Topology, node_order: Sequence[int] | None):
        self.topo = topology
        ppn = topology.procs_per_node
        order = list(node_order) if node_order is not None else list(range(topology.num_nodes))
        self.phys = [order[r // ppn] * ppn + r % ppn for r in range(topology.world_size)]
        self.bytes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def add(self, collective: str, links) -> None:
        for a, b, nbytes in links:
            if a == b or nbytes == 0:
                continue
            level = self.topo.common_level(self.phys[a], self.phys[b]).name
            self.bytes[collective][level] += nbytes

    def ring(self, collective: str, groups, total_bytes: float, *, times: float = 1.0) -> None:
        """Ring all-gather/reduce-scatter of total_bytes (the full tensor) in each group, `times` times."""
        for g in groups:
            n = len(g)
            if n > 1:
                self.add(collective, _ring(g, (n - 1) / n * total_bytes * times))

    def all_to_all(self, collective: str, groups, per_rank_bytes: float, *, times: float = 1.0) -> None:
        for g in groups:
            n = len(g)
            if n > 1:
                self.add(collective, _pairs(g, per_rank_bytes / n * times))


def layout_groups(plan: ParallelPlan, axis_order: Sequence[str] = MESH_AXES) -> dict[str, list[list[int]]]:
    """Every group of the plan with the mesh axes laid out in `axis_order` (outermost first).

    MESH_AXES is the topology-aware order; any other order is how a topology-blind launcher might
    number the same degrees.
    """
    sizes = dict(zip(MESH_AXES, plan.mesh_shape))
    shape = [sizes[a] for a in axis_order]
    strides = {a: math.prod(shape[i + 1:]) for i, a in enumerate(axis_order)}

    def groups_over(axes: Sequence[str]) -> list[list[int]]:
        outer = [a for a in axis_order if a not in axes]
        out = []
        for fixed in itertools.product(*(range(sizes[a]) for a in outer)):
            base = sum(c * strides[a] for c, a in zip(fixed, outer))
            out.append([base + sum(c * strides[a] for c, a in zip(var, axes))
                        for var in itertools.product(*(range(sizes[a]) for a in axes))])
        return out

    # ZeRO's group: dp_shard and the cp ranks (different sequences, so their gradients are reduced too)
    zero = groups_over(["dp_shard_mod_ep", "ep", "cp"])
    if list(axis_order) == list(MESH_AXES):
        return {**{name: plan.group_ranks(name) for name in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "sparse")},
                "dp_shard_cp": zero}
    data_axes = ("dp_replicate", "dp_shard_mod_ep", "ep", "cp")
    sparse = []
    for data_group in groups_over(data_axes):  # one per tp index, in canonical data order
        s = plan.sparse_shard
        sparse += [data_group[i:i + s] for i in range(0, len(data_group), s)]
    return {"tp": groups_over(["tp"]), "cp": groups_over(["cp"]), "ep": groups_over(["ep"]),
            "dp_shard": groups_over(["dp_shard_mod_ep", "ep"]), "dp_replicate": groups_over(["dp_replicate"]),
            "sparse": sparse, "dp_shard_cp": zero}


def step_bytes(plan: ParallelPlan, topology: Topology, work: Workload, *,
               axis_order: Sequence[str] = MESH_AXES, node_order: Sequence[int] | None = None) -> dict[str, dict[str, float]]:
    """{collective: {level name: bytes}} for one training step of the whole job."""
    groups = layout_groups(plan, axis_order)
    c = _Counter(topology, node_order)
    dense_local = work.dense_params * (1 - work.tp_fraction + work.tp_fraction / plan.tp) * BYTES
    experts_local = work.num_experts * work.expert_params / plan.ep * BYTES
    shardable = dense_local + experts_local
    zero = groups["dp_shard_cp"]  # cp ranks are data ranks: ZeRO shards over dp_shard x cp (torchtitan's dp_shard_cp)
    if plan.zero_stage == 3:
        c.ring("dp_shard/all_gather_params", zero, shardable, times=2)  # forward + backward
        c.ring("dp_shard/reduce_scatter_grads", zero, shardable)
    elif plan.zero_stage in (1, 2):
        c.ring("dp_shard/reduce_scatter_grads", zero, shardable)
        c.ring("dp_shard/all_gather_params", zero, shardable)
    else:
        c.ring("dp_shard/all_reduce_grads", zero, shardable, times=2)
    c.ring("dp_replicate/all_reduce_grads", groups["dp_replicate"], shardable / (plan.dp_shard * plan.cp), times=2)
    # activations of the examples one rank computes on (cp ranks share examples)
    examples = work.examples_per_rank
    act = examples * work.interaction_tokens * work.d_model * BYTES
    c.ring("tp/all_reduce_activations", groups["tp"], act, times=2 * 2 * work.tp_layers)  # (RS+AG) x (fwd+bwd)
    c.ring("ep/all_gather_inputs", groups["ep"], act * plan.ep, times=2 * work.expert_layers)  # fwd AG + bwd AG
    c.ring("ep/reduce_scatter_outputs", groups["ep"], act * plan.ep, times=2 * work.expert_layers)
    kv = examples * work.tokens_per_example * 2 * work.d_model * BYTES  # keys + values of the whole histories
    c.ring("cp/all_gather_kv", groups["cp"], kv, times=work.seq_layers)
    c.ring("cp/reduce_scatter_kv_grads", groups["cp"], kv, times=work.seq_layers)
    rows = examples * work.sparse_lookups_per_example * work.sparse_dim * BYTES
    c.all_to_all("sparse/all_to_all_rows", groups["sparse"], rows, times=2)  # forward rows + backward grads
    return {k: dict(v) for k, v in sorted(c.bytes.items())}


def level_totals(per_collective: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for levels in per_collective.values():
        for level, b in levels.items():
            out[level] += b
    return dict(out)


def cross_block_bytes(per_collective: dict[str, dict[str, float]], topology: Topology) -> float:
    """Bytes on links that leave a block (levels larger than the topology's block)."""
    outside = {lvl.name for lvl in topology.levels if lvl.size > topology.block.size}
    return sum(b for level, b in level_totals(per_collective).items() if level in outside)


def comm_seconds(per_collective: dict[str, dict[str, float]], topology: Topology) -> float:
    """A rough per-step time: each level's bytes per rank over that level's per-rank bandwidth, added."""
    bw = {lvl.name: lvl.bandwidth_gbps * 1e9 for lvl in topology.levels}
    return sum(b / topology.world_size / bw[level] for level, b in level_totals(per_collective).items())


def shuffled_nodes(num_nodes: int, seed: int = 0) -> list[int]:
    """A topology-blind scheduler's node order: every node rank in an arbitrary slot."""
    order = list(range(num_nodes))
    random.Random(seed).shuffle(order)
    return order
