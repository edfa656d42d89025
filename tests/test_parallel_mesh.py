"""Every process group build_mesh creates has exactly the members the plan says (8 gloo processes)."""

from __future__ import annotations

import torch.distributed as dist

from gem.parallel.mesh import GROUP_NAMES, build_mesh
from gem.parallel.plan import MESH_AXES, ParallelPlan
from gem.parallel.testing import run_distributed

PLANS = [
    dict(dp_replicate=2, dp_shard=2, ep=2, cp=1, tp=2),  # HSDP + EP + TP
    dict(dp_replicate=1, dp_shard=2, ep=2, cp=2, tp=2, sparse_shard=2),  # all inner axes
    dict(dp_replicate=2, dp_shard=1, cp=4, tp=1),
    dict(dp_replicate=1, dp_shard=8),
]


def _groups(rank: int, world: int, plans: list[dict]) -> list[dict]:
    out = []
    for kwargs in plans:
        plan = ParallelPlan(world_size=world, **kwargs)
        mesh = build_mesh(plan)
        seen = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in GROUP_NAMES}
        dm = mesh.device_mesh
        dm_axes = {axis: dist.get_process_group_ranks(dm.get_group(axis)) for axis in MESH_AXES} if dm is not None else None
        # a collective on each group really runs over its members
        import torch

        sums = {}
        for name in ("tp", "data", "sparse"):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=mesh.get_group(name))
            sums[name] = t.item()
        out.append({"groups": seen, "device_mesh": dm_axes, "sums": sums, "notes": mesh.notes})
    return out


def test_group_membership_equals_the_plan():
    results = run_distributed(_groups, 8, PLANS)
    for i, kwargs in enumerate(PLANS):
        plan = ParallelPlan(world_size=8, **kwargs)
        for rank, res in enumerate(results):
            got = res[i]
            assert got["notes"] == [], got["notes"]
            for name in GROUP_NAMES:
                assert got["groups"][name] == plan.group_of(name, rank), (kwargs, rank, name)
            for axis in MESH_AXES:
                assert got["device_mesh"][axis] == plan.group_of(axis, rank)
            for name, total in got["sums"].items():
                assert total == sum(plan.group_of(name, rank))
