"""The plan of one GEMTraining job: topology from the spec and the operator, explicit or automatic degrees.

    job = plan_for_job(spec.parallelism, spec.training, world_size=8, procs_per_node=4, hints=hints)
    job.plan, job.reason, job.report()      # the report goes into the trainer's final JSON as parallelPlan

Inputs until the API has fields for them (docs/parallelism.md section 8):
  * explicit degrees: `spec.training.deepspeed.parallelPlan` ({"dpShard": -1, "tp": 2, ...});
    `deepspeed_overrides` removes the key before the rest is merged into DeepSpeed's config;
  * the node pool and the placement mode: the environment variable GEM_TOPOLOGY, set by the operator,
    {"nodesPerDomain": {"<label>": 32, ...}, "placement": "kueue" | "affinity" | "none"}.
    Without it only the node level is known (placement "none").
The topology the plan is checked against is what the placement guarantees (placement.guaranteed_topology).
Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gem.parallel.placement import PlacementMode, guaranteed_topology
from gem.parallel.plan import DIMS, ModelShapeHints, ParallelPlan, auto_plan
from gem.parallel.topology import NodePool, Topology

ENV_TOPOLOGY = "GEM_TOPOLOGY"
PLAN_KEY = "parallelPlan"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobParallelism:
    plan: ParallelPlan
    """The degrees the job runs with."""
    reason: str
    """Why: auto_plan's reasons, or that the spec gave the degrees."""
    topology: Topology
    """The hierarchy the plan was checked against (what the placement guarantees)."""
    placement: PlacementMode
    """How the pods were placed (from the operator)."""
    notes: tuple[str, ...] = ()
    """Anything the log should say (e.g. the world differs from the spec)."""

    def report(self) -> dict[str, Any]:
        """`parallelPlan` of the trainer's final report: degrees, reason, where each axis's groups live."""
        return {**self.plan.to_dict(), "reason": self.reason, "groupLevels": self.plan.group_levels(self.topology),
                "placement": self.placement.value, "topology": self.topology.describe()}


def deepspeed_overrides(deepspeed: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the user's DeepSpeed overrides without parallelPlan, the parallelPlan or None)."""
    if not deepspeed:
        return deepspeed, None
    rest = {k: v for k, v in deepspeed.items() if k != PLAN_KEY}
    return rest, deepspeed.get(PLAN_KEY)


def topology_for_job(parallelism, *, world_size: int, procs_per_node: int,
                     env: Mapping[str, str] = os.environ) -> tuple[Topology, PlacementMode, list[str]]:
    """The guaranteed hierarchy of this run, its placement mode, and notes for the log."""
    notes: list[str] = []
    spec_world = parallelism.num_nodes * parallelism.procs_per_node
    raw = env.get(ENV_TOPOLOGY)
    info = json.loads(raw) if raw else {}
    mode = PlacementMode(info.get("placement", "none"))
    if world_size != spec_world or world_size % procs_per_node:
        if parallelism.topology.levels:
            notes.append(f"running {world_size} processes ({procs_per_node} per node), not the spec's "
                         f"{parallelism.num_nodes} x {parallelism.procs_per_node}: topology levels are ignored")
        nodes = max(1, world_size // max(procs_per_node, 1))
        return Topology.build(procs_per_node=world_size // nodes, num_nodes=nodes), PlacementMode.none, notes
    labels = list(parallelism.topology.levels)
    if labels and not info.get("nodesPerDomain"):
        notes.append(f"{ENV_TOPOLOGY} does not describe the node pool: topology levels {labels} are ignored")
        labels = []
    pool = NodePool(nodes_per_domain={k: int(v) for k, v in (info.get("nodesPerDomain") or {}).items()})
    topology = Topology.build(procs_per_node=parallelism.procs_per_node, num_nodes=parallelism.num_nodes,
                              level_labels=[lb for lb in labels if lb in pool.nodes_per_domain], pool=pool)
    missing = [lb for lb in labels if lb not in pool.nodes_per_domain]
    if missing:
        notes.append(f"no node-pool size for topology levels {missing}: ignored")
    return guaranteed_topology(topology, mode), mode, notes


def plan_for_job(parallelism, training, *, world_size: int, procs_per_node: int, hints: ModelShapeHints,
                 allowed: frozenset[str] = DIMS, env: Mapping[str, str] = os.environ) -> JobParallelism:
    """The plan of this run: the spec's explicit degrees, else auto_plan over `allowed` dimensions."""
    topology, mode, notes = topology_for_job(parallelism, world_size=world_size, procs_per_node=procs_per_node, env=env)
    _, explicit = deepspeed_overrides(training.deepspeed)
    if explicit:
        if "sparse_shard" not in allowed and not {"sparseShard", "sparse_shard"} & set(explicit):
            explicit = {**explicit, "sparseShard": 1}  # unsharded tables where the path cannot shard them
        plan = ParallelPlan.from_config(explicit, world_size=world_size, zero_stage=parallelism.zero_stage)
        plan.validate(topology)
        reason = f"given in spec.training.deepspeed.{PLAN_KEY}"
    else:
        plan, reason = auto_plan(world_size, topology, hints, zero_stage=parallelism.zero_stage, allowed=allowed)
    return JobParallelism(plan=plan, reason=reason, topology=topology, placement=mode, notes=tuple(notes))
