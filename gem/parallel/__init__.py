"""Topology-aware 5D parallelism: plan, placement, process groups, parallel layers (docs/parallelism.md).

Torch-free (the operator imports these):
    Topology, NodePool            the network hierarchy                      gem.parallel.topology
    ParallelPlan, auto_plan       degrees, layout, validation, choice        gem.parallel.plan
    placement functions           Kueue TAS / pod affinity, where ranks landed  gem.parallel.placement
    comm_model                    bytes per collective per network level     gem.parallel.comm_model
Needs torch (imported on first use):
    build_mesh, ParallelMesh      process groups / DeviceMesh                gem.parallel.mesh
    parallelize, sync_gradients   apply a plan to a single-device model      gem.parallel.parallelize
    deepspeed_config_fragment, prepare_deepspeed                            gem.parallel.deepspeed_config
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from gem.parallel.placement import (
    PlacementMode,
    apply_placement,
    guaranteed_topology,
    placement_violations,
    rank_placement,
    summarize_placement,
)
from gem.parallel.plan import MESH_AXES, ModelShapeHints, ParallelPlan, PlanError, auto_plan
from gem.parallel.topology import Level, NodePool, Topology, TopologyError

_LAZY = {
    "ParallelMesh": "gem.parallel.mesh",
    "build_mesh": "gem.parallel.mesh",
    "parallelize": "gem.parallel.parallelize",
    "sync_gradients": "gem.parallel.parallelize",
    "sync_parameter_gradients": "gem.parallel.parallelize",
    "full_state_dict": "gem.parallel.parallelize",
    "deepspeed_config_fragment": "gem.parallel.deepspeed_config",
    "prepare_deepspeed": "gem.parallel.deepspeed_config",
    "split_for_deepspeed": "gem.parallel.deepspeed_config",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gem.parallel' has no attribute {name!r}")


__all__ = [
    "MESH_AXES", "Level", "ModelShapeHints", "NodePool", "ParallelPlan", "PlacementMode", "PlanError", "Topology",
    "TopologyError", "apply_placement", "auto_plan", "guaranteed_topology", "placement_violations",
    "rank_placement", "summarize_placement", *_LAZY,
]
