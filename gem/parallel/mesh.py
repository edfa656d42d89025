"""Process groups for a ParallelPlan: the only place they are created.

    mesh = build_mesh(plan)               # collective: every rank calls it, after init_process_group
    mesh.get_group("tp")                  # this rank's tensor-parallel group (raises if unknown)
    mesh.get_optional_group("ep")         # None when the axis has size 1
    mesh.ranks("data"), mesh.size("cp"), mesh.local_rank("sparse")
    mesh.device_mesh                      # torch DeviceMesh over MESH_AXES (None if it could not be built)

Rank order is the plan's (global rank = node_rank x procs_per_node + local_rank, mesh axes
row-major, tp innermost), so a torch DeviceMesh over `plan.mesh_shape` holds exactly the groups
the plan describes; the derived groups (dp_shard, dp, data, expert_data) are its flattened
sub-meshes. The sparse groups need not align with mesh axes and are plain `new_group`s.
Every group's membership equals `plan.group_ranks(name)` (tests/test_parallel_mesh.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gem.parallel.plan import FLAT_GROUPS, MESH_AXES, ParallelPlan

log = logging.getLogger("gem.parallel")

GROUP_NAMES = MESH_AXES + tuple(FLAT_GROUPS) + ("sparse", "sparse_replica")
"""Every group a ParallelMesh answers for."""


@dataclass
class ParallelMesh:
    """This rank's process group for every axis and derived group of a plan."""

    plan: ParallelPlan
    rank: int
    groups: dict[str, dist.ProcessGroup]
    members: dict[str, list[int]]
    device_mesh: object | None = None
    notes: list[str] = field(default_factory=list)

    def get_group(self, name: str) -> dist.ProcessGroup:
        if name not in self.groups:
            raise KeyError(f"no process group {name!r}; known: {', '.join(GROUP_NAMES)}")
        return self.groups[name]

    def get_optional_group(self, name: str) -> dist.ProcessGroup | None:
        return self.get_group(name) if self.size(name) > 1 else None

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group `name`, in group order."""
        return self.members[name]

    def size(self, name: str) -> int:
        return len(self.members[name])

    def local_rank(self, name: str) -> int:
        """This rank's index inside its group `name`."""
        return self.members[name].index(self.rank)


def build_mesh(plan: ParallelPlan, *, device_type: str | None = None, use_device_mesh: bool = True) -> ParallelMesh:
    """Create every process group of `plan`. Collective: all ranks call it in the same order."""
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialised (gem.train.dist.init_distributed)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != plan.world_size:
        raise ValueError(f"the plan is for {plan.world_size} ranks but the process group has {world}: {plan.describe()}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    groups: dict[str, dist.ProcessGroup] = {}
    members = {name: plan.group_of(name, rank) for name in GROUP_NAMES}
    notes: list[str] = []

    device_mesh = None
    if use_device_mesh:
        try:
            device_mesh = _device_mesh_groups(plan, device_type, groups)
        except Exception as e:  # an older/newer torch without the private _flatten: plain groups
            notes.append(f"DeviceMesh not used ({type(e).__name__}: {e}); plain process groups instead")
            groups.clear()
            device_mesh = None

    cache: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for name in GROUP_NAMES:
        if name in groups:
            continue
        for ranks in plan.group_ranks(name):  # every rank creates every group, same order
            key = tuple(ranks)
            if key not in cache:
                cache[key] = dist.new_group(ranks) if len(ranks) < world else dist.group.WORLD
            if rank in ranks:
                groups[name] = cache[key]
    for name in GROUP_NAMES:  # the DeviceMesh groups must say what the plan says
        got = dist.get_process_group_ranks(groups[name])
        if got != members[name]:
            raise AssertionError(f"group {name} of rank {rank} is {got}, the plan says {members[name]}")
    return ParallelMesh(plan=plan, rank=rank, groups=groups, members=members, device_mesh=device_mesh, notes=notes)


def _device_mesh_groups(plan: ParallelPlan, device_type: str, groups: dict[str, dist.ProcessGroup]):
    """A DeviceMesh over the mesh axes; fills `groups` with its axis and flattened groups."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh(device_type, torch.arange(plan.world_size).reshape(plan.mesh_shape), mesh_dim_names=MESH_AXES)
    for axis in MESH_AXES:
        groups[axis] = mesh.get_group(axis)
    for name, axes in FLAT_GROUPS.items():
        groups[name] = mesh[axes]._flatten(name).get_group()  # private in torch 2.x: checked below
    return mesh
