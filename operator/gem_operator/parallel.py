"""Topology-aware placement and the parallel plan, on the operator's side (docs/parallelism.md §8).

At render time (`plan`): the spec's topology levels are sized by spec.parallelism.topology.
nodesPerDomain and, for levels it does not list, by the labels of the Nodes the job may use (its
nodeSelector); the plan is validated (explicit degrees) or chosen (auto); the PyTorchJob gets the
placement (Kueue TAS annotations or pod affinity) and the trainer the plan through GEM_TOPOLOGY.
A plan or topology that cannot work is an `InvalidPlan`: the resource gets Valid=False, no job.

After the pods are bound (`observe`): where each node rank landed (pod spec.nodeName + node
labels) becomes status.placement, with the plan groups that left their level as violations.
Everything the read-back needs is in the job itself (GEM_TOPOLOGY), so it survives restarts.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kubernetes.client.rest import ApiException

from gem.api import render, status as st
from gem.parallel.job import ENV_TOPOLOGY, JobParallelism, build_topology, plan_job, spec_hints
from gem.parallel.placement import (
    PlacementMode,
    guaranteed_topology,
    placement_violations,
    rank_placement,
    summarize_placement,
    topology_env,
)
from gem.parallel.plan import DEEPSPEED_DIMS, ParallelPlan
from gem.parallel.topology import NodePool, Topology
from gem_operator import kube


class InvalidPlan(Exception):
    """The spec's topology or parallel plan cannot run; the message names the dimension and level."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason, self.message = reason, message


def node_pool(obj: Any, logger: logging.Logger) -> tuple[NodePool, str | None]:
    """Nodes per domain of each level the spec does not size itself, measured from the job's nodes.

    Returns the pool and, when the nodes could not be read, why (for the error message).
    """
    topo = obj.spec.parallelism.topology
    unsized = [lb for lb in topo.levels if lb not in topo.nodes_per_domain]
    if not unsized:
        return NodePool(), None
    try:
        nodes = kube.list_nodes(obj.spec.resources.node_selector)
    except ApiException as e:
        if e.status not in (401, 403):
            raise  # transient trouble: the reconcile is retried
        logger.warning("cannot list nodes (%s): topology levels %s need spec.parallelism.topology.nodesPerDomain",
                       e.status, unsized)
        return NodePool(), f"the operator may not list nodes ({e.status})"
    return NodePool.from_nodes(nodes, unsized), None


def plan(kind: str, obj: Any, defaults: render.PlatformDefaults,
         logger: logging.Logger) -> tuple[render.JobPlacement, JobParallelism | None]:
    """The placement to render and (GEMTraining) the plan. Raises InvalidPlan."""
    par = obj.spec.parallelism
    mode = render.placement_mode(obj, defaults)
    pool, trouble = node_pool(obj, logger)
    try:
        topology = build_topology(par, pool)
    except ValueError as e:
        hint = (f"; {trouble}" if trouble else "") + (
            "; give the size in spec.parallelism.topology.nodesPerDomain or label the nodes" if par.topology.levels else "")
        raise InvalidPlan("InvalidTopology", f"spec.parallelism.topology: {e}{hint}") from None
    if kind != "GEMTraining":  # the distillation trainer does not run a 5D plan; its pods are still placed
        env = topology_env({lv.label: topology.nodes_per_domain(lv) for lv in topology.levels[1:-1] if lv.label}, mode)
        return render.JobPlacement(topology=topology, mode=mode, env=env), None
    try:
        # The DeepSpeed trainer's dims; plan_job adds ep when spec.parallelism.zeroStage and
        # spec.training.precision let it run (plan.deepspeed_auto_dims), as the trainer does.
        job = plan_job(par, obj.spec.training, topology=topology, mode=mode, hints=spec_hints(obj.spec),
                       allowed=DEEPSPEED_DIMS)
    except ValueError as e:  # PlanError names the dimension, its degree, the world size and the level
        level = getattr(e, "level", None)
        dim = getattr(e, "dimension", None)
        where = f" [dimension {dim}" + (f", level {level}" if level else "") + "]" if dim else ""
        prefix = "" if str(e).startswith("spec.") else "spec.parallelism.plan: "  # a message naming its fields
        raise InvalidPlan("InvalidParallelPlan", f"{prefix}{e}{where}") from None
    for note in job.notes:
        logger.warning("parallel: %s", note)
    logger.info("%s", job.log_line())
    logger.info("parallel reason %s", job.reason)
    return render.JobPlacement(topology=topology, mode=mode, env=job.env()), job


# ---------------------------------------------------------------------------- read-back


def job_topology_info(job: dict[str, Any]) -> dict[str, Any] | None:
    """The GEM_TOPOLOGY the operator rendered into a PyTorchJob (None for jobs without one)."""
    for rspec in ((job.get("spec") or {}).get("pytorchReplicaSpecs") or {}).values():
        for c in ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []:
            for e in c.get("env") or []:
                if e.get("name") == ENV_TOPOLOGY and e.get("value"):
                    try:
                        return json.loads(e["value"])
                    except ValueError:
                        return None
    return None


def plan_status(info: dict[str, Any]) -> dict[str, Any] | None:
    """status.parallelPlan from a job's GEM_TOPOLOGY (what the trainer runs)."""
    degrees = info.get("plan")
    if not degrees:
        return None
    return st.plan_status({**degrees, "chosen": info.get("chosen", "auto"), "reason": info.get("reason", ""),
                           "groupLevels": info.get("groupLevels", {})})


def observe(job: dict[str, Any], info: dict[str, Any], logger: logging.Logger,
            previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.placement from where the job's pods are bound, or None while none is bound.

    Reads only the job (its replicas, nprocPerNode, nodeSelector and GEM_TOPOLOGY), not the
    resource's spec, which may have been edited since (a rejected change).
    """
    meta, spec = job["metadata"], job.get("spec") or {}
    pods = [p for p in kube.list_job_pods(meta["namespace"], meta["name"]) if (p.get("spec") or {}).get("nodeName")]
    if not pods:
        return None
    replicas = spec.get("pytorchReplicaSpecs") or {}
    num_nodes = sum(int(r.get("replicas", 1)) for r in replicas.values())
    procs = int(spec.get("nprocPerNode") or 1)
    mode = PlacementMode(info.get("placement", "none"))
    sizes = {k: int(v) for k, v in (info.get("nodesPerDomain") or {}).items()}
    full = Topology.build(procs_per_node=procs, num_nodes=num_nodes,
                          level_labels=[lb for lb in info.get("levels") or sizes if lb in sizes],
                          pool=NodePool(nodes_per_domain=sizes))
    selector = (((replicas.get("Master") or {}).get("template") or {}).get("spec") or {}).get("nodeSelector")
    placed = rank_placement(pods, _nodes(selector, full, pods, logger), topology=full)
    out: dict[str, Any] = {"mode": mode.value, "domains": summarize_placement(placed, full), "violations": []}
    if info.get("plan"):
        degrees = {k: v for k, v in info["plan"].items() if k != "worldSize"}
        plan_ = ParallelPlan.from_config(degrees, world_size=full.world_size)
        # Checked against what the plan relied on: the levels the placement guarantees.
        out["violations"] = placement_violations(plan_, guaranteed_topology(full, mode), placed)
    if out != previous:
        where = ", ".join(f"{e['nodeRank']}:{e['node']}" for e in placed)
        logger.info("placement mode=%s node rank:node [%s] domains=%s", mode.value, where, out["domains"])
        for v in out["violations"]:
            logger.warning("placement violation: %s", v)
    return out


def _nodes(selector: dict[str, str] | None, topology: Topology, pods: list[dict[str, Any]],
           logger: logging.Logger) -> list[dict[str, Any]]:
    """The Node objects the pods are bound to (labels only matter for levels above the node)."""
    if len(topology.levels) <= 2:
        return []  # node and whole job only: the pod's nodeName says it all
    try:
        nodes = kube.list_nodes(selector)
    except ApiException as e:
        if e.status not in (401, 403):
            raise
        logger.warning("cannot list nodes (%s): placement shows node names only", e.status)
        return []
    bound = {p["spec"]["nodeName"] for p in pods}
    return [n for n in nodes if n["metadata"]["name"] in bound]
