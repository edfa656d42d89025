"""Placement annotations/affinity on the rendered PyTorchJob, reading back where ranks landed, and the
communication model behind benchmarks/parallel.py. Torch-free."""

from __future__ import annotations

import json

import pytest

from gem.api.render import render_pytorchjob
from gem.api.types import GEMTraining
from gem.parallel.comm_model import Workload, cross_block_bytes, level_totals, shuffled_nodes, step_bytes
from gem.parallel.placement import (
    KUEUE_GROUP,
    KUEUE_PREFERRED,
    KUEUE_REQUIRED,
    KUEUE_SLICE_REQUIRED,
    KUEUE_SLICE_SIZE,
    PlacementMode,
    apply_placement,
    guaranteed_topology,
    node_rank_of,
    placement_violations,
    rank_placement,
    summarize_placement,
)
from gem.parallel.plan import ParallelPlan
from gem.parallel.topology import NodePool, Topology

BLOCK = "cloud.provider.com/topology-block"
ZONE = "topology.kubernetes.io/zone"


def training(num_nodes: int, procs: int = 8) -> GEMTraining:
    return GEMTraining.model_validate({
        "apiVersion": "gem.dev/v1alpha1", "kind": "GEMTraining",
        "metadata": {"name": "big", "namespace": "ads", "uid": "u1"},
        "spec": {"parallelism": {"numNodes": num_nodes, "procsPerNode": procs, "topology": {"levels": [BLOCK, ZONE]}}},
    })


def topo_for(obj: GEMTraining, block=32, zone=64) -> Topology:
    return Topology.from_spec(obj.spec.parallelism, NodePool(nodes_per_domain={BLOCK: block, ZONE: zone}))


def test_kueue_slices_blocks_inside_a_zone():
    obj = training(64)
    job = apply_placement(render_pytorchjob(obj), topo_for(obj), "kueue", selector={"gem.dev/name": "big"})
    for rtype in ("Master", "Worker"):
        ann = job["spec"]["pytorchReplicaSpecs"][rtype]["template"]["metadata"]["annotations"]
        assert ann == {KUEUE_GROUP: job["metadata"]["name"], KUEUE_REQUIRED: ZONE,
                       KUEUE_SLICE_REQUIRED: BLOCK, KUEUE_SLICE_SIZE: "32"}
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 63


def test_kueue_job_inside_one_block_needs_no_slices():
    obj = training(16)
    ann = apply_placement(render_pytorchjob(obj), topo_for(obj), PlacementMode.kueue, selector={})[
        "spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"]
    assert ann == {KUEUE_GROUP: "big-train", KUEUE_REQUIRED: BLOCK}


def test_kueue_job_larger_than_every_level_prefers_the_outermost():
    obj = training(256)
    ann = apply_placement(render_pytorchjob(obj), topo_for(obj), "kueue", selector={})[
        "spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"]
    assert ann[KUEUE_PREFERRED] == ZONE and ann[KUEUE_SLICE_REQUIRED] == BLOCK and KUEUE_REQUIRED not in ann


def test_affinity_requires_the_whole_job_level_and_prefers_inner_levels():
    obj = training(64)
    job = apply_placement(render_pytorchjob(obj), topo_for(obj), "affinity", selector={"gem.dev/name": "big"})
    aff = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["affinity"]["podAffinity"]
    assert aff["requiredDuringSchedulingIgnoredDuringExecution"] == [
        {"labelSelector": {"matchLabels": {"gem.dev/name": "big"}}, "topologyKey": ZONE}]
    assert [t["podAffinityTerm"]["topologyKey"] for t in aff["preferredDuringSchedulingIgnoredDuringExecution"]] == [BLOCK]
    # nothing else in the pod spec changed
    plain = render_pytorchjob(obj)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert {k: v for k, v in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"].items()
            if k != "affinity"} == plain


def test_guaranteed_topology_drops_what_the_placement_cannot_order():
    obj = training(64)
    topo = topo_for(obj)
    assert guaranteed_topology(topo, "kueue") == topo
    aff = guaranteed_topology(topo, "affinity")
    assert [lv.name for lv in aff.levels] == ["node", "zone"]
    assert [lv.name for lv in guaranteed_topology(topo, "none").levels] == ["node", "cluster"]


def _pods_and_nodes(order: list[int], topo: Topology):
    """Node rank k runs on physical node order[k]; nodes are labelled by block/zone of their slot."""
    nodes, pods = [], []
    for slot in range(topo.num_nodes):
        nodes.append({"metadata": {"name": f"n{slot}", "labels": {
            BLOCK: f"b{slot // topo.nodes_per_domain(topo.level('block'))}",
            ZONE: f"z{slot // topo.nodes_per_domain(topo.level('zone'))}"}}})
    for k, slot in enumerate(order):
        rtype, idx = ("master", 0) if k == 0 else ("worker", k - 1)
        pods.append({"metadata": {"name": f"big-train-{rtype}-{idx}", "labels": {
            "training.kubeflow.org/replica-type": rtype, "training.kubeflow.org/replica-index": str(idx)}},
            "spec": {"nodeName": f"n{slot}"}})
    return pods, nodes


def test_rank_placement_and_violations():
    obj = training(8, procs=4)
    topo = topo_for(obj, block=2, zone=4)
    plan = ParallelPlan(world_size=32, dp_shard=-1, ep=2, cp=1, tp=4)  # ep group = 2 nodes = one block
    pods, nodes = _pods_and_nodes(list(range(8)), topo)
    placed = rank_placement(pods, nodes, topology=topo)
    assert [e["nodeRank"] for e in placed] == list(range(8))
    assert placed[3] == {"nodeRank": 3, "pod": "big-train-worker-2", "node": "n3", "ranks": [12, 15],
                         "domains": {"node": "n3", "block": "b1", "zone": "z0"}}
    assert placement_violations(plan, topo, placed) == []
    assert summarize_placement(placed, topo)["block"] == {"b0": "0-1", "b1": "2-3", "b2": "4-5", "b3": "6-7"}

    pods, nodes = _pods_and_nodes([0, 2, 1, 3, 4, 5, 6, 7], topo)  # node ranks 1 and 2 swapped blocks
    bad = placement_violations(plan, topo, rank_placement(pods, nodes, topology=topo))
    assert bad == ["8 of 16 ep groups span more than one block domain (e.g. ranks 0..4 on b0, b1); "
                   "ep groups must stay in one"]
    assert json.dumps(summarize_placement(rank_placement(pods, nodes, topology=topo), topo))  # status-ready


def test_node_rank_of_ignores_other_pods():
    assert node_rank_of({"metadata": {"labels": {}}}) is None
    assert node_rank_of({"metadata": {"labels": {"training.kubeflow.org/replica-type": "Worker",
                                                 "training.kubeflow.org/replica-index": "4"}}}) == 5


# ---------------------------------------------------------------------------- communication model


def test_ring_bytes_per_level_small_case():
    # 2 nodes x 2 ranks, one data group over all 4 ranks: ring 0->1->2->3->0
    topo = Topology.build(procs_per_node=2, num_nodes=2)
    plan = ParallelPlan(world_size=4, zero_stage=1)
    work = Workload(dense_params=1000, tp_fraction=0.0, examples_per_rank=0, sparse_lookups_per_example=0)
    s = 1000 * 2  # bf16 bytes of the model
    # each ring pass moves (n-1)/n * S per rank-link: links 0-1, 2-3 on NVLink, 1-2, 3-0 across nodes
    ring = {"node": 2 * 0.75 * s, "cluster": 2 * 0.75 * s}
    # DeepSpeed ZeRO-1: gradient all-reduce (two passes) + all-gather of the updated partitions
    per = step_bytes(plan, topo, work)
    assert set(per) == {"data/all_reduce_grads", "data/all_gather_params"}
    assert per["data/all_reduce_grads"] == pytest.approx({k: 2 * v for k, v in ring.items()})
    assert per["data/all_gather_params"] == pytest.approx(ring)
    assert level_totals(per) == pytest.approx({"node": 4.5 * s, "cluster": 4.5 * s})
    # the ideal HSDP: reduce-scatter + all-gather
    per = step_bytes(plan, topo, work, zero_model="hsdp")
    assert per["dp_shard/reduce_scatter_grads"] == pytest.approx(ring)
    assert level_totals(per) == pytest.approx({"node": 3 * s, "cluster": 3 * s})


@pytest.mark.parametrize("zero_model", ["deepspeed", "hsdp"])
@pytest.mark.parametrize("zero_stage", [0, 1, 3])
def test_context_parallel_ranks_reduce_their_gradients(zero_stage, zero_model):
    """cp ranks see different sequences, so their gradients are reduced like any data rank's (DeepSpeed's
    data group, torchtitan's dp_shard_cp): 8 cp ranks move the gradient bytes of 8 dp_shard ranks."""
    topo = Topology.build(procs_per_node=8, num_nodes=1)
    work = Workload(dense_params=1000, tp_fraction=0.0, examples_per_rank=0, sparse_lookups_per_example=0)
    by_cp = step_bytes(ParallelPlan(world_size=8, dp_shard=1, cp=8, sparse_shard=1, zero_stage=zero_stage), topo,
                       work, zero_model=zero_model)
    by_shard = step_bytes(ParallelPlan(world_size=8, dp_shard=8, sparse_shard=1, zero_stage=zero_stage), topo, work,
                          zero_model=zero_model)
    assert by_cp == by_shard and level_totals(by_cp)["node"] > 0


def test_hsdp_model_all_reduces_the_shard_across_replicas():
    # the ideal HSDP with cp: the replicas all-reduce the 1/(dp_shard x cp) shard
    topo = Topology.build(procs_per_node=4, num_nodes=2)
    work = Workload(dense_params=1000, tp_fraction=0.0, examples_per_rank=0, sparse_lookups_per_example=0)
    per = step_bytes(ParallelPlan(world_size=8, dp_replicate=2, dp_shard=2, cp=2, zero_stage=3), topo, work,
                     zero_model="hsdp")
    # 4 groups x 2 ranks x (n-1)/n x 2 (all-reduce) x the shard: 2000 bf16 bytes / 4
    assert per["dp_replicate/all_reduce_grads"] == pytest.approx({"cluster": 4 * 2 * 0.5 * 2 * (2 * 1000 / 4)})


# DeepSpeed's groups per stage (comm_model.py cites its source). 4 nodes x 2 ranks, blocks of 2 nodes;
# 2 replicas x dp_shard 2 x cp 2: the data group is all 8 ranks, its ring 0..7 leaves a block twice
# (3->4, 7->0); the dp_shard groups are [0,2] [1,3] [4,6] [5,7], inside a block.
TOPO8 = Topology.simulated(num_gpus=8, gpus_per_node=2, nodes_per_level=[("block", 2)])
WORK = Workload(dense_params=1000, tp_fraction=0.0, examples_per_rank=0, sparse_lookups_per_example=0)
S = 1000 * 2
DATA_RING_CROSSING = 2 * 7 / 8 * S  # one pass of a ring over the data group, on the links that leave a block


def hsdp_plan(zero_stage: int, **kw) -> ParallelPlan:
    return ParallelPlan(world_size=8, dp_replicate=2, dp_shard=2, cp=2, sparse_shard=1, zero_stage=zero_stage, **kw)


def test_deepspeed_zero3_hpz_gathers_backward_in_the_shard_group_and_the_rest_over_data():
    """hpZ: the forward all-gather (primary partition) and the gradient reduce-scatter run over the whole
    data group, across blocks; only the backward all-gather (secondary partition) stays in dp_shard.
    There is no all-reduce across replicas."""
    per = step_bytes(hsdp_plan(3), TOPO8, WORK)
    assert set(per) == {"data/all_gather_params_forward", "dp_shard/all_gather_params_backward",
                        "data/reduce_scatter_grads"}
    assert per["data/reduce_scatter_grads"]["cluster"] == pytest.approx(DATA_RING_CROSSING)
    assert per["data/all_gather_params_forward"]["cluster"] == pytest.approx(DATA_RING_CROSSING)
    # 4 dp_shard groups x 2 ranks x 1/2 x S, all on block links
    assert per["dp_shard/all_gather_params_backward"] == pytest.approx({"block": 4 * 2 * 0.5 * S})
    assert cross_block_bytes(per, TOPO8) == pytest.approx(2 * DATA_RING_CROSSING)


def test_deepspeed_zero3_without_replicas_gathers_twice_over_data():
    # dp_shard alone (no replicas): no hpZ, both all-gathers and the reduce-scatter over data (= dp_shard x cp)
    plan = ParallelPlan(world_size=8, dp_shard=4, cp=2, sparse_shard=1, zero_stage=3)
    per = step_bytes(plan, TOPO8, WORK)
    assert set(per) == {"data/all_gather_params", "data/reduce_scatter_grads"}
    assert per["data/all_gather_params"]["cluster"] == pytest.approx(2 * DATA_RING_CROSSING)


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_deepspeed_zero12_reduce_and_gather_over_the_whole_data_group(zero_stage):
    """ZeRO-1/2 partition over all data ranks: the gradients are all-reduced (use_multi_rank_bucket_allreduce)
    and the updated partitions all-gathered over data; nothing runs over dp_shard or dp_replicate alone."""
    per = step_bytes(hsdp_plan(zero_stage), TOPO8, WORK)
    assert set(per) == {"data/all_reduce_grads", "data/all_gather_params"}
    assert per["data/all_reduce_grads"]["cluster"] == pytest.approx(2 * DATA_RING_CROSSING)
    assert per["data/all_gather_params"]["cluster"] == pytest.approx(DATA_RING_CROSSING)
    # the replica split changes nothing for ZeRO: one shard group over all 8 data ranks moves the same bytes
    flat = ParallelPlan(world_size=8, dp_shard=4, cp=2, sparse_shard=1, zero_stage=zero_stage)
    assert step_bytes(flat, TOPO8, WORK) == per


def test_deepspeed_zero0_all_reduces_over_data():
    per = step_bytes(hsdp_plan(0), TOPO8, WORK)
    assert set(per) == {"data/all_reduce_grads"}
    assert per["data/all_reduce_grads"]["cluster"] == pytest.approx(2 * DATA_RING_CROSSING)


def test_deepspeed_shards_outside_are_all_reduced_over_their_replicas():
    """ep / sparse_shard at ZeRO-2: experts and rows stay out of DeepSpeed (not in the data-group traffic);
    sync_parameter_gradients all-reduces them over expert_data / sparse_replica."""
    plan = ParallelPlan(world_size=8, dp_replicate=2, dp_shard=4, ep=2, sparse_shard=4, zero_stage=2)
    work = Workload(dense_params=1000, tp_fraction=0.0, num_experts=2, expert_params=100, examples_per_rank=0,
                    sparse_lookups_per_example=0, sparse_params=400)
    per = step_bytes(plan, TOPO8, work)
    assert per["data/all_gather_params"]["cluster"] == pytest.approx(DATA_RING_CROSSING)  # dense only
    # expert_data [0,2,4,6], [1,3,5,7]: one expert (200 bytes) each, all-reduced; 2 of 4 links leave a block
    assert sum(per["expert_data/all_reduce_grads"].values()) == pytest.approx(2 * 4 * 0.75 * 200 * 2)
    # sparse_replica [0,4] ... [3,7]: 100 rows' gradient bytes (200) each, all across blocks
    assert per["sparse_replica/all_reduce_grads"] == pytest.approx({"cluster": 4 * 2 * 0.5 * 200 * 2})


def test_deepspeed_model_refuses_what_deepspeed_cannot_run():
    from gem.parallel.plan import PlanError

    with pytest.raises(PlanError, match="ep=2"):
        step_bytes(ParallelPlan(world_size=8, dp_shard=8, ep=2, sparse_shard=1, zero_stage=3), TOPO8, WORK)
    step_bytes(ParallelPlan(world_size=8, dp_shard=8, ep=2, sparse_shard=1, zero_stage=3), TOPO8, WORK,
               zero_model="hsdp")


def test_busiest_rank_sees_the_whole_tensor_at_a_data_ring_crossing():
    """Total cross-block bytes flatter one big ring (few crossings); the rank at a crossing sends the whole
    tensor per pass. hpZ saves one pass of three; the ideal HSDP sends a 1/(dp_shard x cp) shard."""
    from gem.parallel.comm_model import busiest_rank_cross_block_bytes

    hpz = busiest_rank_cross_block_bytes(hsdp_plan(3), TOPO8, WORK)
    flat = busiest_rank_cross_block_bytes(ParallelPlan(world_size=8, dp_shard=4, cp=2, sparse_shard=1, zero_stage=3),
                                          TOPO8, WORK)
    assert hpz == pytest.approx(2 * 7 / 8 * S) and flat == pytest.approx(3 * 7 / 8 * S)
    ideal = busiest_rank_cross_block_bytes(hsdp_plan(3), TOPO8, WORK, zero_model="hsdp")
    assert ideal == pytest.approx(2 * 0.5 * S / 4)  # all-reduce of the 1/4 shard between 2 replicas


def test_topology_aware_plan_moves_fewer_cross_block_bytes():
    topo = Topology.simulated(num_gpus=256, gpus_per_node=8, nodes_per_level=[("block", 8)])
    work = Workload(dense_params=10**8, num_experts=4, expert_params=10**7, examples_per_rank=64, tokens_per_example=128)
    # the ideal HSDP (ep and sparse shards at ZeRO-3, which DeepSpeed refuses)
    aware = ParallelPlan(world_size=256, dp_replicate=4, dp_shard=32, ep=2, tp=2, zero_stage=3)
    flat = ParallelPlan(world_size=256, dp_replicate=1, dp_shard=128, ep=2, tp=2, sparse_shard=128, zero_stage=3)
    chosen = cross_block_bytes(step_bytes(aware, topo, work, zero_model="hsdp"), topo)
    blind = cross_block_bytes(step_bytes(flat, topo, work, node_order=shuffled_nodes(topo.num_nodes),
                                         zero_model="hsdp"), topo)
    assert 0 < chosen < blind / 10
    # the per-collective split: tp stays on NVLink, only dp_replicate leaves the block
    per = step_bytes(aware, topo, work, zero_model="hsdp")
    assert set(per["tp/all_reduce_activations"]) == {"node"}
    assert set(per["dp_replicate/all_reduce_grads"]) == {"cluster"}
    # DeepSpeed (ZeRO-3 + hpZ, ep = sparse_shard = 1): fewer bytes still, but the data group's ring leaves
    # the block too
    aware = ParallelPlan(world_size=256, dp_replicate=4, dp_shard=32, tp=2, sparse_shard=1, zero_stage=3)
    flat = ParallelPlan(world_size=256, dp_shard=128, tp=2, sparse_shard=1, zero_stage=3)
    per = step_bytes(aware, topo, work)
    chosen = cross_block_bytes(per, topo)
    blind = cross_block_bytes(step_bytes(flat, topo, work, node_order=shuffled_nodes(topo.num_nodes)), topo)
    assert 0 < chosen < blind
    assert "cluster" not in per["dp_shard/all_gather_params_backward"]
    assert "cluster" in per["data/reduce_scatter_grads"] and "cluster" in per["data/all_gather_params_forward"]


def test_benchmark_writes_the_ratio(tmp_path):
    from benchmarks.parallel import main

    out = tmp_path / "parallel.json"
    assert main(["--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["cross_block_bytes_ratio"] > 1
    cluster = doc["clusters"][0]
    assert cluster["topology"]["levels"][1]["nodes"] == 32 and cluster["topology"]["numNodes"] == 128
    # DeepSpeed ZeRO-3 + hpZ: backward all-gathers in the shard group, the rest over the data group
    assert set(cluster["chosen"]["bytes"]) >= {"data/all_gather_params_forward", "dp_shard/all_gather_params_backward",
                                                "data/reduce_scatter_grads"}
    assert "dp_replicate/all_reduce_grads" not in cluster["chosen"]["bytes"]
    assert (tmp_path / "parallel.png").stat().st_size > 0


def test_topology_env_round_trips_into_the_trainer_plan():
    from gem.api.types import TrainingSpec
    from gem.parallel.job import plan_for_job
    from gem.parallel.placement import topology_env
    from gem.parallel.plan import ModelShapeHints

    obj = training(64)
    nodes = [{"metadata": {"name": f"n{i}", "labels": {BLOCK: f"b{i // 40}", ZONE: "z0"}}} for i in range(80)]
    entry = topology_env(NodePool.from_nodes(nodes, [BLOCK, ZONE]).nodes_per_domain, "kueue")
    job = plan_for_job(obj.spec.parallelism, TrainingSpec(), world_size=512, procs_per_node=8,
                       hints=ModelShapeHints(), env={entry["name"]: entry["value"]})
    assert [(lv.name, lv.size) for lv in job.topology.levels] == [("node", 8), ("block", 256), ("zone", 512),
                                                                   ("cluster", 512)]
    assert job.plan.dp_shard == 256 and job.plan.dp_replicate == 2
