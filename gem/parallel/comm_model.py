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
What is moved per step comes from `Workload` (bf16 everywhere). ZeRO, two models:
  "deepspeed" (default: what the trainer runs, DeepSpeed 0.19 configured by deepspeed_config.py).
  DeepSpeed's data-parallel group is the plan's `data` group (dp_replicate x dp_shard x cp, one per tp
  index: the mpu's get_data_parallel_group), and every ZeRO stage partitions over all of it:
    ZeRO-0    all-reduce of the gradients over data (engine.py buffered_allreduce_fallback ->
              _reduce_non_expert_gradients)
    ZeRO-1/2  all-reduce of the gradients over data: stage_1_and_2.py average_tensor puts every
              slice in one ("allreduce", group) bucket while use_multi_rank_bucket_allreduce (default
              True) -> allreduce_and_scatter -> allreduce_bucket (dist.all_reduce); then step()
              all-gathers the updated bit16 partitions over data (all_gather_dp_groups)
    ZeRO-3    all-gather of the parameters in forward and again in backward, reduce-scatter of the
              gradients (stage3.py __avg_scatter_grads -> reduce_scatter_coalesced), all over data
    ZeRO-3 + hpZ (dp_replicate > 1 and dp_shard > 1: zero_hpz_partition_size = dp_shard, secondary
              group = the plan's dp_shard group): the forward all-gather still runs over data
              (stage3.py _post_step -> invalidate_secondary_tensor drops the secondary copy every
              step, so partition_parameters.py all_gather_coalesced finds none and uses the param's
              ds_process_group); releasing a gathered param fills the secondary copy locally
              (_partition_param_sec, no collective); the backward all-gather runs over dp_shard
              (zero_param_process_group); the gradient reduce-scatter still runs over data.
    Expert / embedding-row shards (ep, sparse_shard > 1, ZeRO-1/2 only: check_deepspeed_plan) stay
    outside DeepSpeed; sync_parameter_gradients all-reduces their gradients over expert_data /
    sparse_replica. Ignored: scalar norm / overflow all-reduces, the post-step all-gather of
    persistent (small) ZeRO-3 params.
  "hsdp": the ideal HSDP (FSDP2 / torchtitan), kept for comparison: ZeRO-3 collectives (or ZeRO-1/2's
  reduce-scatter + all-gather) over dp_shard x cp only, and across dp_replicate an all-reduce of the
  1/(dp_shard x cp) gradient shard; experts are counted as sharded like dense parameters.
Other groups, both models:
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

from gem.parallel.plan import MESH_AXES, ParallelPlan, check_deepspeed_plan
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
    sparse_params: int = 0
    """Elements of the row-sharded tables: with sparse_shard > 1 each rank all-reduces its rows'
    gradients over sparse_replica (sync_parameter_gradients, dense); 0: not counted."""

#: ZeRO models step_bytes knows: what the trainer runs (DeepSpeed) and the ideal HSDP, for comparison.
ZERO_MODELS = ("deepspeed", "hsdp")


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
        self.outside = {lvl.name for lvl in topology.levels if lvl.size > topology.block.size}
        self.sent_outside: dict[int, float] = defaultdict(float)  # rank -> bytes it sends out of its block

    def add(self, collective: str, links) -> None:
        for a, b, nbytes in links:
            if a == b or nbytes == 0:
                continue
            level = self.topo.common_level(self.phys[a], self.phys[b]).name
            self.bytes[collective][level] += nbytes
            if level in self.outside:
                self.sent_outside[a] += nbytes

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
        return {**{name: plan.group_ranks(name) for name in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "sparse",
                                                             "data", "expert_data", "sparse_replica")},
                "dp_shard_cp": zero}
    data_axes = ("dp_replicate", "dp_shard_mod_ep", "ep", "cp")
    data = groups_over(data_axes)  # one per tp index, in canonical data order
    sparse, sparse_replica = [], []
    for data_group in data:
        s = plan.sparse_shard
        chunks = [data_group[i:i + s] for i in range(0, len(data_group), s)]
        sparse += chunks
        sparse_replica += [list(col) for col in zip(*chunks)]
    return {"tp": groups_over(["tp"]), "cp": groups_over(["cp"]), "ep": groups_over(["ep"]),
            "dp_shard": groups_over(["dp_shard_mod_ep", "ep"]), "dp_replicate": groups_over(["dp_replicate"]),
            "sparse": sparse, "sparse_replica": sparse_replica, "data": data,
            "expert_data": groups_over(["dp_replicate", "dp_shard_mod_ep", "cp"]), "dp_shard_cp": zero}


def step_counts(plan: ParallelPlan, topology: Topology, work: Workload, *,
                axis_order: Sequence[str] = MESH_AXES, node_order: Sequence[int] | None = None,
                zero_model: str = "deepspeed") -> tuple[dict[str, dict[str, float]], float]:
    """(step_bytes, busiest_rank_cross_block_bytes) of one count, for callers that want both."""
    c = _count(plan, topology, work, axis_order, node_order, zero_model)
    return {k: dict(v) for k, v in sorted(c.bytes.items())}, max(c.sent_outside.values(), default=0.0)


def step_bytes(plan: ParallelPlan, topology: Topology, work: Workload, *,
               axis_order: Sequence[str] = MESH_AXES, node_order: Sequence[int] | None = None,
               zero_model: str = "deepspeed") -> dict[str, dict[str, float]]:
    """{collective: {level name: bytes}} for one training step of the whole job.

    `zero_model`: "deepspeed" (what the trainer runs; PlanError for a plan DeepSpeed cannot run) or
    "hsdp" (the ideal HSDP, for comparison). See the module docstring.
    """
    return step_counts(plan, topology, work, axis_order=axis_order, node_order=node_order, zero_model=zero_model)[0]


def busiest_rank_cross_block_bytes(plan: ParallelPlan, topology: Topology, work: Workload, *,
                                   axis_order: Sequence[str] = MESH_AXES, node_order: Sequence[int] | None = None,
                                   zero_model: str = "deepspeed") -> float:
    """Bytes the busiest rank sends out of its block in one step (its NIC's load; arguments as step_bytes).

    A ring runs at the pace of its slowest link: one big ring crossing a few block boundaries moves
    few cross-block bytes in total, but each crossing carries the whole tensor at block-link speed.
    """
    return step_counts(plan, topology, work, axis_order=axis_order, node_order=node_order, zero_model=zero_model)[1]


def _count(plan: ParallelPlan, topology: Topology, work: Workload, axis_order: Sequence[str],
           node_order: Sequence[int] | None, zero_model: str) -> _Counter:
    if zero_model not in ZERO_MODELS:
        raise ValueError(f"zero_model {zero_model!r}; known: {', '.join(ZERO_MODELS)}")
    groups = layout_groups(plan, axis_order)
    c = _Counter(topology, node_order)
    dense_local = work.dense_params * (1 - work.tp_fraction + work.tp_fraction / plan.tp) * BYTES
    experts_local = work.num_experts * work.expert_params / plan.ep * BYTES
    if zero_model == "deepspeed":
        _deepspeed_zero(c, plan, groups, work, dense_local, experts_local)
    else:
        _hsdp_zero(c, plan, groups, dense_local + experts_local)
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
    return c


def _deepspeed_zero(c: _Counter, plan: ParallelPlan, groups, work: Workload, dense_local: float,
                    experts_local: float) -> None:
    """DeepSpeed 0.19's ZeRO collectives (module docstring): every stage over the whole data group."""
    check_deepspeed_plan(plan)  # ep / sparse_shard > 1 only at ZeRO-1/2, with their shards outside DeepSpeed
    data = groups["data"]
    # experts split by ep are stepped outside DeepSpeed (split_for_deepspeed); unsplit ones are its params
    params = dense_local + (experts_local if plan.ep == 1 else 0.0)
    if plan.zero_stage == 3:
        if plan.hsdp_enabled:  # hpZ: only the backward all-gather uses the secondary (dp_shard) partition
            c.ring("data/all_gather_params_forward", data, params)
            c.ring("dp_shard/all_gather_params_backward", groups["dp_shard"], params)
        else:
            c.ring("data/all_gather_params", data, params, times=2)  # forward + backward
        c.ring("data/reduce_scatter_grads", data, params)
    elif plan.zero_stage in (1, 2):
        c.ring("data/all_reduce_grads", data, params, times=2)
        c.ring("data/all_gather_params", data, params)  # the updated partitions, after step()
    else:
        c.ring("data/all_reduce_grads", data, params, times=2)
    # the shards kept outside: sync_parameter_gradients all-reduces them over their replicas
    if plan.ep > 1:
        c.ring("expert_data/all_reduce_grads", groups["expert_data"], experts_local, times=2)
    if plan.sparse_shard > 1 and work.sparse_params:
        c.ring("sparse_replica/all_reduce_grads", groups["sparse_replica"],
               work.sparse_params / plan.sparse_shard * BYTES, times=2)


def _hsdp_zero(c: _Counter, plan: ParallelPlan, groups, shardable: float) -> None:
    """The ideal HSDP: ZeRO inside dp_shard x cp, the 1/(dp_shard x cp) gradient shard across replicas."""
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
