"""Placement: what the operator adds to the PyTorchJob so consecutive node ranks share a block,
and where each rank actually landed.

Node ranks (torchrun --node-rank, from the training operator): the Master pod is node rank 0 and
Worker pod i (label training.kubeflow.org/replica-index=i) is node rank i+1; global rank =
node_rank x procs_per_node + local_rank. The plan (plan.py) assumes domain k of a level holds node
ranks [k n, (k+1) n), n = its nodes per domain. Two ways to get that:

kueue (recommended; Kueue >= 0.15 with TopologyAwareScheduling, TASGroupedPodSetSlicing when the
    job spans more than one block): Master and Worker templates form one PodSet group
    (`kueue.x-k8s.io/podset-group-name`), the whole group is required inside the innermost level
    that can hold it (`podset-required-topology`), and it is cut into slices of one block's worth of
    pods, each required inside one block (`podset-slice-required-topology`,
    `podset-slice-size`). Kueue assigns pods to slices in the order of
    `training.kubeflow.org/replica-index` (the group puts the Master first), which is the node rank.
affinity (no Kueue): a required pod affinity on the label of the innermost level that holds the
    whole job, and preferred affinities on the levels below it. This keeps the job inside that
    level but cannot order ranks across smaller domains, so `guaranteed_topology` drops those
    levels and the plan must not rely on them.

`rank_placement` reads back where each rank landed (pod spec.nodeName + the node's labels) and
`placement_violations` says which plan groups left the level they must stay in.
Pure functions over plain dicts; torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

from gem.parallel.plan import ParallelPlan
from gem.parallel.topology import HOSTNAME_LABEL, Level, Topology

KUEUE_REQUIRED = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED = "kueue.x-k8s.io/podset-preferred-topology"
KUEUE_SLICE_REQUIRED = "kueue.x-k8s.io/podset-slice-required-topology"
KUEUE_SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size"
KUEUE_GROUP = "kueue.x-k8s.io/podset-group-name"
REPLICA_INDEX_LABEL = "training.kubeflow.org/replica-index"
REPLICA_TYPE_LABEL = "training.kubeflow.org/replica-type"

#: The pod annotation the trainer's plan is summarised in (the operator may copy it to status).
PLAN_ANNOTATION = "gem.dev/parallel-plan"


class PlacementMode(str, Enum):
    kueue = "kueue"
    affinity = "affinity"
    none = "none"


def _whole_job_level(topology: Topology) -> Level:
    """The innermost labelled level one of whose domains holds the whole job (else the cluster)."""
    for lvl in topology.levels[1:]:
        if lvl.size == topology.world_size:
            return lvl
    return topology.levels[-1]


def _slice_level(topology: Topology) -> Level | None:
    """The block level, when the job spans more than one block (None otherwise)."""
    block = topology.block
    if block.label is None or block.size >= topology.world_size or block is topology.node:
        return None
    return block


def kueue_pod_metadata(topology: Topology, *, group_name: str) -> dict[str, dict[str, str]]:
    """Annotations for both the Master and the Worker pod templates (the same for both)."""
    if topology.num_nodes == 1 or not any(lvl.label for lvl in topology.levels[1:]):
        # one pod, or no level above the node: nothing to ask TAS for (a PodSet group without a
        # topology request is not valid)
        return {"annotations": {}}
    annotations = {KUEUE_GROUP: group_name}
    whole = _whole_job_level(topology)
    if whole.label is not None:
        annotations[KUEUE_REQUIRED] = whole.label
    slice_level = _slice_level(topology)
    if slice_level is not None:
        if whole.label is None:
            # Kueue wants a podset-level request beside slices; "preferred" at the outermost label
            # lets it spread over several of those domains when one is not enough.
            outer = topology.levels[-2]
            annotations[KUEUE_PREFERRED] = outer.label or slice_level.label
        annotations[KUEUE_SLICE_REQUIRED] = slice_level.label
        annotations[KUEUE_SLICE_SIZE] = str(topology.nodes_per_domain(slice_level))
    return {"annotations": annotations}


def affinity_pod_spec(topology: Topology, *, selector: Mapping[str, str]) -> dict[str, Any]:
    """The pod `affinity` that keeps the job's pods (matched by `selector`) together.

    Required at the innermost labelled level holding the whole job; preferred (weight 100 at the
    innermost, halving outward) at the labelled levels below it.
    """
    term = {"labelSelector": {"matchLabels": dict(selector)}}
    whole = _whole_job_level(topology)
    required = [{**term, "topologyKey": whole.label}] if whole.label and topology.num_nodes > 1 else []
    preferred, weight = [], 100
    for lvl in topology.levels[1:]:
        if lvl.label is None or lvl.size >= topology.world_size:
            break
        preferred.append({"weight": weight, "podAffinityTerm": {**term, "topologyKey": lvl.label}})
        weight = max(1, weight // 2)
    affinity: dict[str, Any] = {}
    if required:
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = required
    if preferred:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return {"podAffinity": affinity} if affinity else {}


def apply_placement(job: dict[str, Any], topology: Topology, mode: PlacementMode | str, *,
                    selector: Mapping[str, str]) -> dict[str, Any]:
    """A copy of a rendered PyTorchJob with the placement of `mode` added to every replica template."""
    mode = PlacementMode(mode)
    job = json.loads(json.dumps(job))  # deep copy of plain JSON data
    specs = job["spec"]["pytorchReplicaSpecs"]
    name = job["metadata"]["name"]
    for spec in specs.values():
        template = spec["template"]
        if mode is PlacementMode.kueue:
            meta = template.setdefault("metadata", {})
            meta.setdefault("annotations", {}).update(kueue_pod_metadata(topology, group_name=name)["annotations"])
        elif mode is PlacementMode.affinity:
            affinity = affinity_pod_spec(topology, selector=selector)
            if affinity:
                template["spec"].setdefault("affinity", {}).update(affinity)
    return job


def guaranteed_topology(topology: Topology, mode: PlacementMode | str) -> Topology:
    """The hierarchy the placement actually guarantees rank alignment for.

    kueue: all of it. affinity: the node and the levels that hold the whole job (smaller domains
    are used but not in rank order). none: the node only.
    """
    mode = PlacementMode(mode)
    if mode is PlacementMode.kueue:
        return topology
    keep = [topology.node]
    for lvl in topology.levels[1:]:
        if mode is PlacementMode.affinity and lvl.size == topology.world_size and lvl.label is not None:
            keep.append(lvl)
    cluster = topology.levels[-1]
    if keep[-1].size != cluster.size or keep[-1] is topology.node:
        keep.append(cluster)
    return Topology(procs_per_node=topology.procs_per_node, num_nodes=topology.num_nodes, levels=tuple(keep))


# ---------------------------------------------------------------------------- where ranks landed


def node_rank_of(pod: Mapping[str, Any]) -> int | None:
    """Master -> 0, Worker i -> i + 1 (the training operator's PET_NODE_RANK); None for other pods."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    rtype, index = labels.get(REPLICA_TYPE_LABEL, "").lower(), labels.get(REPLICA_INDEX_LABEL)
    if index is None or rtype not in ("master", "worker"):
        return None
    return int(index) + (1 if rtype == "worker" else 0)


def rank_placement(pods: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]], *,
                   topology: Topology) -> list[dict[str, Any]]:
    """One entry per node rank: pod, node and the domain (label value) of every level.

    Pods not yet bound to a node are listed with node None. Sorted by node rank.
    """
    labels_of = {(n.get("metadata") or {}).get("name"): ((n.get("metadata") or {}).get("labels") or {}) for n in nodes}
    out = []
    for pod in pods:
        nr = node_rank_of(pod)
        if nr is None:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        node_labels = labels_of.get(node, {})
        domains = {lvl.name: (node if lvl.label == HOSTNAME_LABEL else node_labels.get(lvl.label))
                   for lvl in topology.levels if lvl.label is not None}
        ppn = topology.procs_per_node
        out.append({"nodeRank": nr, "pod": (pod.get("metadata") or {}).get("name"), "node": node,
                    "ranks": [nr * ppn, (nr + 1) * ppn - 1], "domains": domains})
    return sorted(out, key=lambda e: e["nodeRank"])


def placement_violations(plan: ParallelPlan, topology: Topology, placement: Sequence[Mapping[str, Any]], *,
                         levels: Mapping[str, str] | None = None) -> list[str]:
    """Groups of tp / cp / ep whose ranks landed in more than one domain of their required level."""
    by_node_rank = {e["nodeRank"]: e for e in placement}
    ppn = topology.procs_per_node
    problems = []
    for dim, level in plan.required_levels(topology, levels).items():
        if getattr(plan, dim) == 1 or level.label is None:
            continue
        groups = plan.group_ranks(dim)
        bad = []
        for group in groups:
            seen = {by_node_rank.get(r // ppn, {}).get("domains", {}).get(level.name) for r in group}
            if None not in seen and len(seen) > 1:  # None: not scheduled yet
                bad.append((group, seen))
        if bad:
            group, seen = bad[0]
            problems.append(f"{len(bad)} of {len(groups)} {dim} groups span more than one {level.name} domain "
                            f"(e.g. ranks {group[0]}..{group[-1]} on {', '.join(sorted(map(str, seen)))}); "
                            f"{dim} groups must stay in one")
    return problems


def summarize_placement(placement: Sequence[Mapping[str, Any]], topology: Topology) -> dict[str, dict[str, str]]:
    """Per level above the node: domain -> node-rank ranges, e.g. {"block": {"b7": "0-31", "b2": "32-63"}}.

    Compact enough for a status field even for thousands of nodes.
    """
    out: dict[str, dict[str, str]] = {}
    for lvl in topology.levels[1:]:
        if lvl.label is None:
            continue
        ranges: dict[str, list[list[int]]] = {}
        for e in placement:
            dom = e["domains"].get(lvl.name)
            if dom is None:
                continue
            rs = ranges.setdefault(str(dom), [])
            if rs and rs[-1][1] == e["nodeRank"] - 1:
                rs[-1][1] = e["nodeRank"]
            else:
                rs.append([e["nodeRank"], e["nodeRank"]])
        out[lvl.name] = {dom: ",".join(f"{a}-{b}" if a != b else str(a) for a, b in rs) for dom, rs in ranges.items()}
    return out


def topology_env(pool_sizes: Mapping[str, int], mode: PlacementMode | str) -> dict[str, str]:
    """The container env entry that tells the trainer the node pool and the placement (gem/parallel/job.py).

    pool_sizes: label key -> nodes per domain, innermost level first, e.g.
    `NodePool.from_nodes(nodes, levels).nodes_per_domain`. (JobParallelism.env adds the plan.)
    """
    value = json.dumps({"levels": list(pool_sizes), "nodesPerDomain": dict(pool_sizes),
                        "placement": PlacementMode(mode).value}, sort_keys=True)
    return {"name": "GEM_TOPOLOGY", "value": value}
