"""The plan of one GEMTraining job: topology from the spec and the node pool, explicit or automatic degrees.

Two callers, one rule:

* the operator (gem_operator/parallel.py) plans when it renders the PyTorchJob:
      job = plan_job(spec.parallelism, spec.training, pool=pool, mode=PlacementMode.kueue, hints=spec_hints(spec))
  and puts the result into the pods' environment (`job.env()`, GEM_TOPOLOGY) and the status (`job.status()`);
* the trainer (gem/parallel/setup.py) reads it back:
      job = plan_for_job(spec.parallelism, spec.training, world_size=8, procs_per_node=4, hints=hints)
  and runs the operator's plan when GEM_TOPOLOGY carries one for this world size, so the status,
  the operator's log and the trainer's log name the same plan. Without it (gemctl submit --local,
  plain torchrun) the trainer plans itself from the same spec, with the model's real shape.

Inputs:
  * explicit degrees: `spec.parallelism.plan` (dpReplicate, dpShard, ep, cp, tp, sparseShard; the
    ones left out are chosen around the given ones). The interim `spec.training.deepspeed.parallelPlan`
    is still read when spec.parallelism.plan is absent, with a deprecation note in the log;
    `deepspeed_overrides` removes it before the rest is merged into DeepSpeed's config;
  * node-pool sizes: `spec.parallelism.topology.nodesPerDomain`, then what the operator measured
    from the Node objects (GEM_TOPOLOGY's nodesPerDomain);
  * the placement mode: what the operator applied (GEM_TOPOLOGY's placement). The plan is checked
    against what that placement guarantees (placement.guaranteed_topology).
Torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gem.parallel.placement import PlacementMode, guaranteed_topology
from gem.parallel.plan import (
    DEEPSPEED_DIMS,
    DIMS,
    GIVEN,
    ModelShapeHints,
    ParallelPlan,
    auto_plan,
    check_deepspeed_plan,
    deepspeed_auto_dims,
)
from gem.parallel.topology import NodePool, Topology

ENV_TOPOLOGY = "GEM_TOPOLOGY"
#: The interim key in spec.training.deepspeed (deprecated; spec.parallelism.plan replaces it).
PLAN_KEY = "parallelPlan"
LEGACY_GIVEN = f"given in spec.training.deepspeed.{PLAN_KEY} (deprecated: use spec.parallelism.plan)"
_SNAKE = {"dpReplicate": "dp_replicate", "dpShard": "dp_shard", "sparseShard": "sparse_shard"}


@dataclass(frozen=True, kw_only=True, slots=True)
class JobParallelism:
    plan: ParallelPlan
    """The degrees the job runs with."""
    reason: str
    """Why: one clause per dimension (auto_plan's reasons, or that the spec gave it)."""
    topology: Topology
    """The hierarchy the plan was checked against (what the placement guarantees)."""
    placement: PlacementMode
    """How the pods are placed."""
    chosen: str = "auto"
    """auto: every degree chosen from the topology; spec: the spec gave at least one of them."""
    pool_sizes: Mapping[str, int] | None = None
    """Nodes per domain of each level label (what the topology was built from)."""
    notes: tuple[str, ...] = ()
    """Anything the log should say (e.g. the world differs from the spec)."""

    def report(self) -> dict[str, Any]:
        """`parallelPlan` of the trainer's final report: degrees, reason, where each axis's groups live."""
        return {**self.plan.to_dict(), "chosen": self.chosen, "reason": self.reason,
                "groupLevels": self.plan.group_levels(self.topology), "placement": self.placement.value,
                "topology": self.topology.describe()}

    def status(self) -> dict[str, Any]:
        """`status.parallelPlan` of the GEMTraining (gem.api.types.ParallelPlanStatus)."""
        degrees = {k: v for k, v in self.plan.to_dict().items() if k != "worldSize"}
        return {**degrees, "chosen": self.chosen, "reason": self.reason,
                "groupLevels": self.plan.group_levels(self.topology)}

    def log_line(self) -> str:
        return (f"parallel plan {self.plan.describe()} chosen={self.chosen} placement={self.placement.value} "
                f"topology=[{self.topology.describe()}] groups={self.plan.group_levels(self.topology)}")

    def env(self) -> dict[str, str]:
        """The GEM_TOPOLOGY env entry of the trainer pods: node pool, placement and this plan."""
        value = {"levels": list(self.pool_sizes or {}), "nodesPerDomain": dict(self.pool_sizes or {}),
                 "placement": self.placement.value,
                 "plan": self.plan.to_dict(), "chosen": self.chosen, "reason": self.reason,
                 "groupLevels": self.plan.group_levels(self.topology)}
        return {"name": ENV_TOPOLOGY, "value": json.dumps(value, sort_keys=True)}


def deepspeed_overrides(deepspeed: Mapping[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the user's DeepSpeed overrides without parallelPlan, the parallelPlan or None)."""
    if not deepspeed:
        return deepspeed, None
    rest = {k: v for k, v in deepspeed.items() if k != PLAN_KEY}
    return rest, deepspeed.get(PLAN_KEY)


def explicit_degrees(parallelism, training) -> tuple[dict[str, int], str, list[str]]:
    """(snake_case degrees the spec fixes, where they come from, notes). Empty when none are given."""
    given = parallelism.plan.given() if parallelism.plan is not None else {}
    if given:
        return {_SNAKE.get(k, k): int(v) for k, v in given.items()}, GIVEN, []
    _, legacy = deepspeed_overrides(getattr(training, "deepspeed", None))
    if legacy:
        degrees = {_SNAKE.get(k, k): int(v) for k, v in legacy.items()}
        unknown = sorted(set(degrees) - DIMS)
        if unknown:
            raise ValueError(f"unknown parallel plan keys {unknown} in spec.training.deepspeed.{PLAN_KEY}")
        return degrees, LEGACY_GIVEN, [f"spec.training.deepspeed.{PLAN_KEY} is deprecated: move it to "
                                       "spec.parallelism.plan"]
    return {}, "", []


def _precision(training) -> Any:
    """spec.training.precision (None without a training spec: check_deepspeed_plan then skips that rule)."""
    return getattr(training, "precision", None)


def choose_plan(parallelism, training, topology: Topology, *, hints: ModelShapeHints,
                allowed: frozenset[str] = DIMS) -> tuple[ParallelPlan, str, str, list[str]]:
    """(plan, reason, chosen, notes) for `topology`: the spec's degrees kept, the rest chosen. Raises PlanError,
    on the DeepSpeed path (allowed != DIMS) also for what check_deepspeed_plan refuses with training.precision."""
    fixed, source, notes = explicit_degrees(parallelism, training)
    why_not: dict[str, str] = {}
    if allowed == DEEPSPEED_DIMS:  # the DeepSpeed path: ep as well when this job's stage and precision run it
        allowed, why_not = deepspeed_auto_dims(parallelism.zero_stage, getattr(training, "precision", "fp32"))
    plan, reason = auto_plan(topology.world_size, topology, hints, zero_stage=parallelism.zero_stage,
                             allowed=allowed, fixed=fixed, given=source or GIVEN, why_not=why_not)
    if allowed != DIMS:  # the DeepSpeed path: its rules, the precision one included (ep / sparse_shard need fp32)
        check_deepspeed_plan(plan, precision=_precision(training))
    return plan, reason, ("spec" if fixed else "auto"), notes


def build_topology(parallelism, pool: NodePool) -> Topology:
    """The full hierarchy of the spec's levels sized by the pool (spec nodesPerDomain wins). Raises TopologyError."""
    sizes = {**dict(pool.nodes_per_domain), **dict(parallelism.topology.nodes_per_domain)}
    return Topology.build(procs_per_node=parallelism.procs_per_node, num_nodes=parallelism.num_nodes,
                          level_labels=list(parallelism.topology.levels),
                          pool=NodePool(nodes_per_domain=sizes, bandwidth_gbps=pool.bandwidth_gbps))


def plan_job(parallelism, training, *, topology: Topology, mode: PlacementMode | str, hints: ModelShapeHints,
             allowed: frozenset[str] = DIMS) -> JobParallelism:
    """The operator's plan on the full `topology` (build_topology), checked against what `mode` guarantees."""
    mode = PlacementMode(mode)
    full, topology = topology, guaranteed_topology(topology, mode)
    plan, reason, chosen, notes = choose_plan(parallelism, training, topology, hints=hints, allowed=allowed)
    sizes = {lvl.label: full.nodes_per_domain(lvl) for lvl in full.levels[1:-1] if lvl.label}
    return JobParallelism(plan=plan, reason=reason, topology=topology, placement=mode, chosen=chosen,
                          pool_sizes=sizes, notes=tuple(notes))


def topology_for_job(parallelism, *, world_size: int, procs_per_node: int,
                     env: Mapping[str, str] = os.environ) -> tuple[Topology, PlacementMode, list[str], dict[str, Any]]:
    """The guaranteed hierarchy of this run, its placement mode, notes for the log, and GEM_TOPOLOGY's content."""
    notes: list[str] = []
    spec_world = parallelism.num_nodes * parallelism.procs_per_node
    raw = env.get(ENV_TOPOLOGY)
    info = json.loads(raw) if raw else {}
    mode = PlacementMode(info.get("placement", "none"))
    # The real node shape too: with the spec's procsPerNode a same-size world on other nodes (torchrun by
    # hand) would let tp groups span nodes.
    if world_size != spec_world or procs_per_node != parallelism.procs_per_node or world_size % procs_per_node:
        if parallelism.topology.levels:
            notes.append(f"running {world_size} processes ({procs_per_node} per node), not the spec's "
                         f"{parallelism.num_nodes} x {parallelism.procs_per_node}: topology levels are ignored")
        nodes = max(1, world_size // max(procs_per_node, 1))
        return Topology.build(procs_per_node=world_size // nodes, num_nodes=nodes), PlacementMode.none, notes, info
    sizes = {**{k: int(v) for k, v in (info.get("nodesPerDomain") or {}).items()},
             **dict(parallelism.topology.nodes_per_domain)}
    labels = list(parallelism.topology.levels)
    missing = [lb for lb in labels if lb not in sizes]
    if missing:
        notes.append(f"no node-pool size for topology levels {missing} (neither spec.parallelism.topology."
                     f"nodesPerDomain nor {ENV_TOPOLOGY} from the operator): ignored")
    topology = Topology.build(procs_per_node=parallelism.procs_per_node, num_nodes=parallelism.num_nodes,
                              level_labels=[lb for lb in labels if lb in sizes],
                              pool=NodePool(nodes_per_domain=sizes))
    return guaranteed_topology(topology, mode), mode, notes, info


def plan_for_job(parallelism, training, *, world_size: int, procs_per_node: int, hints: ModelShapeHints,
                 allowed: frozenset[str] = DIMS, env: Mapping[str, str] = os.environ) -> JobParallelism:
    """The trainer's plan: the operator's (from GEM_TOPOLOGY) when it is for this world, else its own choice."""
    topology, mode, notes, info = topology_for_job(parallelism, world_size=world_size, procs_per_node=procs_per_node,
                                                   env=env)
    sizes = {lvl.label: topology.nodes_per_domain(lvl) for lvl in topology.levels[1:-1] if lvl.label}
    given = info.get("plan")
    if given and int(given.get("worldSize", -1)) == world_size:
        degrees = {k: v for k, v in given.items() if k != "worldSize"}
        plan = ParallelPlan.from_config(degrees, world_size=world_size, zero_stage=parallelism.zero_stage)
        plan.validate(topology)
        if allowed != DIMS:
            check_deepspeed_plan(plan, precision=_precision(training))
        return JobParallelism(plan=plan, reason=f"{info.get('reason', '')} (planned by the operator)",
                              topology=topology, placement=mode, chosen=info.get("chosen", "auto"),
                              pool_sizes=sizes, notes=tuple(notes))
    if given:
        notes.append(f"the operator's plan is for {given.get('worldSize')} ranks, this run has {world_size}: "
                     "planning again")
    plan, reason, chosen, more = choose_plan(parallelism, training, topology, hints=hints, allowed=allowed)
    return JobParallelism(plan=plan, reason=reason, topology=topology, placement=mode, chosen=chosen,
                          pool_sizes=sizes, notes=tuple(notes + more))


def spec_hints(spec) -> ModelShapeHints:
    """What the operator knows of the model's shape from the spec alone (no torch, no model).

    From the preset and the spec's overrides (gem.model.config, torch-free): the history length (an
    explicit spec.model.maxSeqLen is the one input that can need cp), the dense experts (ep), and the
    widest layer tensor parallelism splits with its heads (KunlunModel.tp_plan: block attention,
    per-token FFNs), so the operator's tp and ep choices match what the trainer's model would give.
    The parameter count is unknown, so the ZeRO shard group is one block's data ranks (auto_plan's
    default) whatever the model's size.
    """
    from gem.model.config import config_from_spec, kunlun_config

    model = getattr(spec, "model", None)
    max_seq_len = int(getattr(model, "max_seq_len", None) or 0)
    if model is None:
        return ModelShapeHints(max_seq_len=max_seq_len)
    try:
        cfg = kunlun_config(config_from_spec(model))
    except ValueError:  # an impossible model is reported where it is built, not as a plan error
        return ModelShapeHints(max_seq_len=max_seq_len)
    runs = [cfg.layer_runs(i) for i in range(cfg.num_layers)]
    widths: list[tuple[int, int]] = []  # (width, heads or 0) of each layer kind tp splits
    if any(local for _, local in runs):
        widths += [(t.dim, t.num_heads) for t in cfg.tiers]
    if cfg.seq_ffn == "token_ffn" and any(glob for glob, _ in runs):
        widths += [(cfg.token_ffn_mult * t.dim, 0) for t in cfg.tiers]
    hidden, units = max(widths, default=(0, 0))
    return ModelShapeHints(max_seq_len=max_seq_len, num_experts=cfg.num_experts, hidden_dim=hidden, hidden_units=units)
