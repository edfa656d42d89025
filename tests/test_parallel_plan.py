"""ParallelPlan, Topology and auto_plan: products, group layout, validation messages, auto rules. Torch-free."""

from __future__ import annotations

import pytest

from gem.api.types import ParallelismSpec, ParallelPlanSpec
from gem.parallel.plan import (
    FLAT_GROUPS,
    MESH_AXES,
    ModelShapeHints,
    ParallelPlan,
    PlanError,
    auto_plan,
)
from gem.parallel.topology import NodePool, Topology, TopologyError

BLOCK = "cloud.provider.com/topology-block"
ZONE = "topology.kubernetes.io/zone"


def sim(gpus=1024, per_node=8, levels=(("block", 32),)) -> Topology:
    return Topology.simulated(num_gpus=gpus, gpus_per_node=per_node, nodes_per_level=list(levels))


# ---------------------------------------------------------------------------- topology


def test_topology_from_spec_and_pool():
    spec = ParallelismSpec(num_nodes=128, procs_per_node=8, topology={"levels": [BLOCK, ZONE]})
    topo = Topology.from_spec(spec, NodePool(nodes_per_domain={BLOCK: 32, ZONE: 64}))
    assert [(lv.name, lv.size) for lv in topo.levels] == [("node", 8), ("block", 256), ("zone", 512), ("cluster", 1024)]
    assert topo.block.name == "block"
    assert topo.common_level(0, 7).name == "node" and topo.common_level(0, 8).name == "block"
    assert topo.common_level(0, 300).name == "zone" and topo.common_level(0, 600).name == "cluster"


def test_topology_slices_divide_the_job():
    # 48 nodes, blocks of 32: the slice must divide 48 -> 24 nodes per block domain
    topo = Topology.build(procs_per_node=8, num_nodes=48, level_labels=[BLOCK], pool=NodePool(nodes_per_domain={BLOCK: 32}))
    assert topo.level("block").size == 24 * 8


def test_topology_pool_from_nodes_uses_smallest_domain():
    nodes = [{"metadata": {"name": f"n{i}", "labels": {BLOCK: "b1" if i < 5 else "b2"}}} for i in range(8)]
    assert NodePool.from_nodes(nodes, [BLOCK]).nodes_per_domain == {BLOCK: 3}


def test_topology_unknown_label_is_an_error():
    with pytest.raises(TopologyError, match="not described by the node pool"):
        Topology.build(procs_per_node=8, num_nodes=4, level_labels=[BLOCK])


# ---------------------------------------------------------------------------- plan products


def test_rest_is_resolved_and_products_checked():
    plan = ParallelPlan(world_size=64, dp_replicate=2, ep=2, cp=2, tp=4)
    assert (plan.dp_replicate, plan.dp_shard, plan.data_world, plan.sparse_shard) == (2, 4, 16, 8)
    assert plan.mesh_shape == (2, 2, 2, 2, 4)
    with pytest.raises(PlanError, match=r"must equal the world size 12") as e:
        ParallelPlan(world_size=12, dp_shard=5)
    assert e.value.dimension == "world"
    with pytest.raises(PlanError, match="ep=3 must divide dp_shard=4") as e:
        ParallelPlan(world_size=8, dp_shard=4, tp=2, ep=3)
    assert (e.value.dimension, e.value.degree, e.value.world_size) == ("ep", 3, 8)
    with pytest.raises(PlanError, match="sparse_shard=3"):
        ParallelPlan(world_size=8, sparse_shard=3)


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 1), (2, 2, 2, 2, 1), (1, 2, 2, 1, 2), (2, 1, 1, 2, 2), (4, 2, 1, 2, 1)])
def test_groups_partition_the_world(shape):
    dpr, dps_mod, ep, cp, tp = shape
    plan = ParallelPlan(world_size=dpr * dps_mod * ep * cp * tp, dp_replicate=dpr, dp_shard=dps_mod * ep, ep=ep, cp=cp, tp=tp)
    w = plan.world_size
    for name in (*MESH_AXES, *FLAT_GROUPS, "sparse", "sparse_replica"):
        groups = plan.group_ranks(name)
        assert sorted(r for g in groups for r in g) == list(range(w)), name
    assert all(g == list(range(g[0], g[0] + tp)) for g in plan.group_ranks("tp"))  # consecutive local ranks
    for rank in range(w):
        c = plan.coords(rank)
        # ranks of one data group share the tp coordinate and nothing else is fixed
        assert all(plan.coords(r)["tp"] == c["tp"] for r in plan.group_of("data", rank))
        assert all(plan.coords(r)["ep"] == c["ep"] for r in plan.group_of("expert_data", rank))
        assert len(plan.group_of("data", rank)) == plan.data_world


def test_group_spans_follow_the_axis_order():
    plan = ParallelPlan(world_size=64, dp_replicate=2, dp_shard=4, ep=2, cp=2, tp=4)
    assert plan.span("tp") == 4 and plan.span("cp") == 8 and plan.span("ep") == 16 and plan.span("dp_replicate") == 64
    ep_group = plan.group_ranks("ep")[0]
    assert ep_group == [0, 8] and max(ep_group) - min(ep_group) < plan.span("ep")


# ---------------------------------------------------------------------------- validation against a topology


def test_impossible_plans_name_dimension_degree_world_and_level():
    topo = sim()
    with pytest.raises(PlanError) as e:
        ParallelPlan(world_size=1024, tp=16).validate(topo)
    msg = str(e.value)
    assert "tp=16" in msg and "'node'" in msg and "world size 1024" in msg and "kubernetes.io/hostname" in msg
    assert (e.value.dimension, e.value.degree, e.value.level) == ("tp", 16, "node")

    with pytest.raises(PlanError) as e:  # 2 x 4 x 64 = 512 ranks > a 256-rank block
        ParallelPlan(world_size=1024, dp_shard=-1, ep=64, cp=2, tp=4).validate(topo)
    assert e.value.dimension == "ep" and e.value.level == "block" and "ep x cp x tp = 512" in str(e.value)

    with pytest.raises(PlanError) as e:
        ParallelPlan(world_size=1024, cp=64, tp=8).validate(topo)
    assert e.value.dimension == "cp" and "block" in str(e.value)

    with pytest.raises(PlanError, match="plan is for 512 ranks"):
        ParallelPlan(world_size=512).validate(topo)


def test_level_overrides_and_non_dividing_spans():
    topo = Topology.simulated(num_gpus=48, gpus_per_node=4, nodes_per_level=[("block", 3)])  # blocks of 12 ranks
    ParallelPlan(world_size=48, cp=3, tp=4).validate(topo)  # 12 ranks: one block
    with pytest.raises(PlanError, match=r"cp=2 .* must divide one 'block'"):
        ParallelPlan(world_size=48, cp=2, tp=4, dp_shard=6).validate(topo)  # 8 ranks straddle 12-rank blocks
    with pytest.raises(PlanError, match="'node'"):
        ParallelPlan(world_size=48, cp=3, tp=4).validate(topo, levels={"cp": "node"})


def test_group_levels_report():
    plan = ParallelPlan(world_size=1024, dp_replicate=4, dp_shard=32, ep=8, cp=2, tp=4)
    assert plan.group_levels(sim()) == {"dp_replicate": "cluster", "dp_shard_mod_ep": "block", "ep": "block",
                                         "cp": "node", "tp": "node"}


def test_from_config_camel_case():
    plan = ParallelPlan.from_config({"dpReplicate": 2, "dpShard": -1, "tp": 2, "sparseShard": 2}, world_size=8, zero_stage=3)
    assert plan.to_dict() == {"worldSize": 8, "dpReplicate": 2, "dpShard": 2, "ep": 1, "cp": 1, "tp": 2,
                              "sparseShard": 2, "zeroStage": 3}
    with pytest.raises(ValueError, match="unknown parallel plan key 'pp'"):
        ParallelPlan.from_config({"pp": 2}, world_size=8)


# ---------------------------------------------------------------------------- auto plan


def test_auto_plan_puts_talkative_dims_on_fast_links():
    hints = ModelShapeHints(dense_params=1_500_000_000, hidden_dim=8192, num_experts=8, expert_params=10**8,
                            max_seq_len=32768)
    plan, reason = auto_plan(1024, sim(), hints, zero_stage=3)
    topo = sim()
    plan.validate(topo)
    assert plan.tp == 4 and plan.cp == 2 and plan.ep == 8
    assert plan.dp_shard * plan.cp * plan.tp == topo.block.size  # one HSDP shard group = one block
    assert plan.dp_replicate == 4  # one replica per block
    assert plan.group_levels(topo)["tp"] == "node" and plan.group_levels(topo)["dp_replicate"] == "cluster"
    for dim in ("tp=4", "cp=2", "ep=8", "dp_shard=32", "dp_replicate=4", "sparse_shard"):
        assert dim in reason


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_reason_says_deepspeed_partitions_zero_over_every_data_rank(zero_stage):
    """DeepSpeed partitions ZeRO over the whole data group (comm_model.py cites its source): the replicas do
    not just all-reduce a gradient shard; only ZeRO-3's hpZ keeps its backward all-gathers in the block."""
    from gem.parallel.plan import deepspeed_auto_dims

    hints = ModelShapeHints(dense_params=1_500_000_000, hidden_dim=8192, max_seq_len=32768)
    allowed, why_not = deepspeed_auto_dims(zero_stage)
    plan, reason = auto_plan(1024, sim(), hints, zero_stage=zero_stage, allowed=allowed, why_not=why_not)
    clauses = dict(c.split(": ", 1) for c in reason.split("; "))  # one clause per decision
    replicate = clauses[f"dp_replicate={plan.dp_replicate}"]
    assert plan.dp_replicate > 1 and "gradient shard" not in reason
    assert f"all {plan.data_world} data ranks" in replicate
    if zero_stage == 3:
        assert "hpZ" in clauses[f"dp_shard={plan.dp_shard}"] and "backward parameter all-gathers" in reason
        assert "forward parameter all-gather and the gradient reduce-scatter span every replica" in replicate
    elif zero_stage:
        assert f"ZeRO-{zero_stage} itself partitions over all data ranks" in clauses[f"dp_shard={plan.dp_shard}"]
        assert "gradient all-reduce and the parameter all-gather span every replica" in replicate
    # inside one block there is one replica, and ZeRO's group is the block's data ranks
    plan, reason = auto_plan(256, sim(256), hints, zero_stage=3, allowed=allowed, why_not=why_not)
    if zero_stage:
        assert plan.dp_replicate == 1 and "ZeRO-3 partitions over every data rank, all in one block" in reason


def test_auto_plan_small_model_is_plain_hsdp():
    plan, reason = auto_plan(1024, sim(), ModelShapeHints(dense_params=10**8, hidden_dim=1024))
    assert (plan.tp, plan.cp, plan.ep, plan.dp_shard, plan.dp_replicate) == (1, 1, 1, 256, 4)
    assert "no projection is wide enough" in reason and "no dense expert ensemble" in reason


def test_auto_plan_keeps_attention_heads_whole():
    # 8192 columns would split 4 ways, but 2 heads only split 2 ways: tp must divide the heads
    plan, reason = auto_plan(1024, sim(), ModelShapeHints(hidden_dim=8192, hidden_units=2))
    assert plan.tp == 2 and "the widest projection tp can split (8192, 2 heads) splits into 2 shards" in reason
    plan, _ = auto_plan(1024, sim(), ModelShapeHints(hidden_dim=8192, hidden_units=8))
    assert plan.tp == 4


def test_deepspeed_auto_plan_chooses_ep_only_where_the_job_runs_it():
    """The DeepSpeed path (trainer and operator, job.choose_plan) picks ep at ZeRO-1/2 in fp32; otherwise
    ep stays 1 and the reason says why; sparse_shard stays explicit-only."""
    from gem.api.types import TrainingSpec
    from gem.parallel.job import build_topology, plan_job
    from gem.parallel.plan import DEEPSPEED_DIMS

    hints = ModelShapeHints(dense_params=10**8, num_experts=8, expert_params=10**7)

    def job(zero_stage, precision="fp32"):
        par = ParallelismSpec(num_nodes=8, procs_per_node=4, zero_stage=zero_stage,
                              topology={"levels": [BLOCK], "nodesPerDomain": {BLOCK: 4}})
        return plan_job(par, TrainingSpec(precision=precision), topology=build_topology(par, NodePool()),
                        mode="kueue", hints=hints, allowed=DEEPSPEED_DIMS)

    ok = job(2)
    # 8 experts, 4 GPUs per node: ep=4 inside the node (the rule prefers the node over the block)
    assert (ok.plan.ep, ok.plan.dp_shard, ok.plan.dp_replicate, ok.plan.sparse_shard) == (4, 16, 2, 1)
    assert "ep=4: 8 dense experts, 2 per rank, each expert-parallel group inside one node" in ok.reason
    assert ok.plan.group_levels(ok.topology)["ep"] == "node"
    assert "row sharding runs on the DeepSpeed path only when given in spec.parallelism.plan" in ok.reason
    assert job(1).plan.ep == 4
    for bad, why in ((job(3), "ep=1: ZeRO-3 partitions every parameter, expert shards cannot stay outside"),
                     (job(0), "ep=1: ZeRO-0 all-reduces every module gradient"),
                     (job(2, "bf16"), "ep=1: precision bf16: expert shards would train outside DeepSpeed without "
                                      "fp32 master weights")):
        assert bad.plan.ep == 1 and why in bad.reason, bad.reason
    # the experts must split evenly: 3 experts never give ep=2 or 4
    odd = plan_job(ParallelismSpec(num_nodes=8, procs_per_node=4, zero_stage=2), TrainingSpec(),
                   topology=Topology.build(procs_per_node=4, num_nodes=8), mode="none",
                   hints=ModelShapeHints(num_experts=3), allowed=DEEPSPEED_DIMS)
    assert odd.plan.ep == 1 and "ep=1: the experts cannot be split inside a block" in odd.reason


def test_spec_hints_read_the_model_shape_from_the_preset():
    from gem.api.types import GEMTrainingSpec
    from gem.parallel.job import spec_hints

    spec = GEMTrainingSpec.model_validate({"model": {"preset": "large", "maxSeqLen": 20000}})
    hints = spec_hints(spec)
    # large: 8 Wukong experts; the click tier (2d = 1024 wide, 8 heads) is the widest block attention
    assert (hints.num_experts, hints.hidden_dim, hints.hidden_units, hints.max_seq_len) == (8, 1024, 8, 20000)


def test_auto_plan_without_hierarchy_and_single_node():
    flat = Topology.build(procs_per_node=8, num_nodes=4)  # no labels: the job is one domain
    plan, _ = auto_plan(32, flat, ModelShapeHints(num_experts=2))
    assert plan.ep == 2 and plan.dp_replicate == 1 and plan.dp_shard == 32
    one, _ = auto_plan(2, Topology.build(procs_per_node=2, num_nodes=1), ModelShapeHints())
    assert one.dp_shard == 2 and one.dp_replicate == 1


def test_auto_plan_memory_pushes_shards_across_blocks():
    hints = ModelShapeHints(dense_params=2_000_000_000_000, gpu_memory_bytes=80 * 2**30)  # 32 TB of state
    plan, reason = auto_plan(1024, sim(), hints, zero_stage=3)
    assert plan.dp_shard == 1024 and plan.dp_replicate == 1
    assert "ZeRO shards cross cluster" in reason


def test_auto_plan_zero_stage_0_replicates():
    plan, reason = auto_plan(16, sim(16, 8, [("block", 2)]), ModelShapeHints(), zero_stage=0)
    assert plan.dp_shard == 1 and plan.dp_replicate == 16 and "zeroStage 0" in reason


# ---------------------------------------------------------------------------- the job's plan (trainer side)


def test_plan_for_job_reads_the_operator_topology_and_explicit_degrees():
    import json

    from gem.api.types import TrainingSpec
    from gem.parallel.job import ENV_TOPOLOGY, deepspeed_overrides, plan_for_job

    par = ParallelismSpec(num_nodes=64, procs_per_node=8, zero_stage=3, topology={"levels": [BLOCK]})
    env = {ENV_TOPOLOGY: json.dumps({"nodesPerDomain": {BLOCK: 32}, "placement": "kueue"})}
    hints = ModelShapeHints(dense_params=10**9, num_experts=4)
    job = plan_for_job(par, TrainingSpec(), world_size=512, procs_per_node=8, hints=hints,
                       allowed=frozenset({"dp_replicate", "dp_shard", "cp", "tp"}), env=env)
    assert (job.plan.dp_replicate, job.plan.dp_shard, job.plan.ep, job.plan.sparse_shard) == (2, 256, 1, 1)
    assert "ep=1: ZeRO-3 partitions every parameter, expert shards cannot stay outside" in job.reason
    rep = job.report()
    assert rep["dpShard"] == 256 and rep["placement"] == "kueue" and rep["groupLevels"]["dp_shard_mod_ep"] == "block"

    # pod affinity cannot order ranks inside the zone: block alignment is not relied on
    env_aff = {ENV_TOPOLOGY: json.dumps({"nodesPerDomain": {BLOCK: 32}, "placement": "affinity"})}
    job = plan_for_job(par, TrainingSpec(), world_size=512, procs_per_node=8, hints=hints, env=env_aff)
    assert [lv.name for lv in job.topology.levels] == ["node", "cluster"]

    # explicit degrees in spec.parallelism.plan; the ones left out are chosen around them
    given = par.model_copy(update={"plan": ParallelPlanSpec(dp_replicate=4, tp=2)})
    job = plan_for_job(given, TrainingSpec(), world_size=512, procs_per_node=8, hints=hints, env=env)
    assert (job.plan.dp_replicate, job.plan.dp_shard, job.plan.tp, job.plan.sparse_shard) == (4, 64, 2, 64)
    assert job.chosen == "spec" and "tp=2: given in spec.parallelism.plan" in job.reason
    assert "dp_shard=64: the data ranks left after dp_replicate=4" in job.reason

    # the interim spec.training.deepspeed.parallelPlan still works, with a deprecation note
    explicit = TrainingSpec(deepspeed={"parallelPlan": {"dpReplicate": 4, "dpShard": -1, "tp": 2}, "wall_clock_breakdown": True})
    job = plan_for_job(par, explicit, world_size=512, procs_per_node=8, hints=hints, env=env)
    assert (job.plan.dp_replicate, job.plan.dp_shard, job.plan.tp) == (4, 64, 2) and "deprecated" in job.reason
    assert any("deprecated" in n for n in job.notes)
    assert deepspeed_overrides(explicit.deepspeed) == ({"wall_clock_breakdown": True}, {"dpReplicate": 4, "dpShard": -1, "tp": 2})

    bad = par.model_copy(update={"plan": ParallelPlanSpec(tp=16)})
    with pytest.raises(PlanError, match="tp=16 does not fit") as e:
        plan_for_job(bad, TrainingSpec(), world_size=512, procs_per_node=8, hints=hints, env=env)
    assert (e.value.dimension, e.value.level) == ("tp", "node")
    # ep at ZeRO-3 (par's stage) cannot run on the DeepSpeed path: rejected by name, not silently dropped
    with pytest.raises(PlanError, match="ep=2 is not supported with DeepSpeed"):
        plan_for_job(par.model_copy(update={"plan": ParallelPlanSpec(ep=2)}), TrainingSpec(), world_size=512,
                     procs_per_node=8, hints=hints, allowed=frozenset({"dp_replicate", "dp_shard", "cp", "tp"}), env=env)


def test_the_trainer_runs_the_operator_plan_from_its_environment():
    from gem.api.types import TrainingSpec
    from gem.parallel.job import ENV_TOPOLOGY, build_topology, plan_for_job, plan_job
    from gem.parallel.plan import DEEPSPEED_DIMS

    par = ParallelismSpec(num_nodes=8, procs_per_node=4, zero_stage=3,
                          topology={"levels": [BLOCK], "nodesPerDomain": {BLOCK: 4}}, plan={"cp": 2})
    topo = build_topology(par, NodePool())
    op = plan_job(par, TrainingSpec(), topology=topo, mode="kueue", hints=ModelShapeHints(), allowed=DEEPSPEED_DIMS)
    assert (op.plan.dp_replicate, op.plan.dp_shard, op.plan.cp) == (2, 8, 2) and op.chosen == "spec"
    env = op.env()
    # the trainer's model would pick otherwise (hidden 8192 -> tp); it runs what the operator put in the status
    hints = ModelShapeHints(hidden_dim=8192)
    job = plan_for_job(par.model_copy(update={"plan": None}), TrainingSpec(), world_size=32, procs_per_node=4,
                       hints=hints, allowed=DEEPSPEED_DIMS, env={env["name"]: env["value"]})
    assert job.plan == op.plan and job.reason.startswith(op.reason) and "planned by the operator" in job.reason
    assert [lv.name for lv in job.topology.levels] == ["node", "block", "cluster"] and job.placement.value == "kueue"
    # an operator plan for another world (torchrun by hand) is not forced on it
    job = plan_for_job(par, TrainingSpec(), world_size=4, procs_per_node=4, hints=ModelShapeHints(),
                       allowed=DEEPSPEED_DIMS, env={ENV_TOPOLOGY: env["value"]})
    assert (job.plan.world_size, job.plan.cp) == (4, 2) and any("planning again" in n for n in job.notes)


def test_auto_plan_keeps_fixed_degrees_and_rejects_impossible_ones():
    topo = sim(64, 8, [("block", 4)])
    plan, why = auto_plan(64, topo, ModelShapeHints(max_seq_len=40000), fixed={"dp_shard": 8})
    assert (plan.dp_shard, plan.cp, plan.dp_replicate) == (8, 4, 2) and "dp_shard=8: given" in why
    plan, why = auto_plan(64, topo, ModelShapeHints(), fixed={"dp_replicate": -1, "dp_shard": 16})
    assert (plan.dp_replicate, plan.dp_shard) == (4, 16)
    with pytest.raises(PlanError, match=r"cp\(3\)"):
        auto_plan(64, topo, ModelShapeHints(), fixed={"cp": 3})
    with pytest.raises(PlanError, match="cp=64 does not fit") as e:
        auto_plan(64, topo, ModelShapeHints(), fixed={"cp": 64})
    assert (e.value.dimension, e.value.level) == ("cp", "block")


def test_plan_for_job_outside_the_cluster_uses_the_real_world():
    from gem.api.types import TrainingSpec
    from gem.parallel.job import plan_for_job

    par = ParallelismSpec(num_nodes=2, procs_per_node=1, topology={"levels": [BLOCK]})
    job = plan_for_job(par, TrainingSpec(), world_size=1, procs_per_node=1, hints=ModelShapeHints(), env={})
    assert job.plan.world_size == 1 and job.notes and "not the spec's" in job.notes[0]
    job = plan_for_job(ParallelismSpec(num_nodes=2, procs_per_node=2, topology={"levels": [BLOCK]}), TrainingSpec(),
                       world_size=4, procs_per_node=2, hints=ModelShapeHints(), env={})
    assert "no node-pool size for topology levels" in job.notes[0] and job.plan.dp_shard == 4
    # the spec's own nodesPerDomain sizes the level without the operator
    par = ParallelismSpec(num_nodes=2, procs_per_node=2, topology={"levels": [BLOCK], "nodesPerDomain": {BLOCK: 1}})
    job = plan_for_job(par, TrainingSpec(), world_size=4, procs_per_node=2, hints=ModelShapeHints(), env={})
    assert not job.notes and [lv.name for lv in job.topology.levels] == ["node", "cluster"]  # placement none
    assert job.plan.dp_shard == 4


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_shards_outside_deepspeed_need_fp32_and_the_message_names_the_fields_and_the_fix(precision):
    """DeepSpeed's bf16 mode keeps fp32 masters only for its own optimizer's parameters: expert and
    embedding-row shards (stepped outside it) would train in bf16. The trainer refused this at setup
    (exit 1, after the operator had accepted the spec); now one rule, in the check both call."""
    from gem.api.types import Precision
    from gem.parallel.plan import check_deepspeed_plan

    ep = ParallelPlan(world_size=4, dp_shard=4, ep=2, sparse_shard=1, zero_stage=2)
    sparse = ParallelPlan(world_size=4, dp_shard=4, sparse_shard=2, zero_stage=1)
    for plan, field in ((ep, "spec.parallelism.plan.ep"), (sparse, "spec.parallelism.plan.sparseShard")):
        check_deepspeed_plan(plan)  # no precision given: only the ZeRO-stage rule
        check_deepspeed_plan(plan, precision="fp32")
        for value in (precision, Precision(precision)):  # the spec's enum as well as its string
            with pytest.raises(PlanError) as e:
                check_deepspeed_plan(plan, precision=value)
            msg = str(e.value)
            assert f"{field}=2 with spec.training.precision {precision} is not supported" in msg
            assert "without fp32 master weights" in msg
            assert f"Set spec.training.precision to fp32, or {field} to 1" in msg
            assert e.value.dimension == ("ep" if plan is ep else "sparse_shard") and e.value.degree == 2
    check_deepspeed_plan(ParallelPlan(world_size=4, dp_shard=4, sparse_shard=1, zero_stage=2), precision=precision)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_job_planning_applies_the_precision_rule_itself(precision):
    """plan_job / plan_for_job get spec.training: their own check_deepspeed_plan call applies its precision
    rule (ep / sparseShard > 1 need fp32), on every path -- the spec's degrees, the automatic choice and the
    operator's plan from GEM_TOPOLOGY -- so the callers need no second check."""
    from gem.api.types import TrainingSpec
    from gem.parallel.job import ENV_TOPOLOGY, build_topology, plan_for_job, plan_job
    from gem.parallel.plan import DEEPSPEED_DIMS

    hints = ModelShapeHints(num_experts=4)
    for given, field in (({"ep": 2}, "spec.parallelism.plan.ep=2"),
                         ({"sparseShard": 2, "ep": 1}, "spec.parallelism.plan.sparseShard=2")):
        par = ParallelismSpec(num_nodes=1, procs_per_node=4, zero_stage=2, plan=given)
        fp32, low = TrainingSpec(precision="fp32"), TrainingSpec(precision=precision)
        op = plan_job(par, fp32, topology=build_topology(par, NodePool()), mode="none", hints=hints,
                      allowed=DEEPSPEED_DIMS)
        assert plan_for_job(par, fp32, world_size=4, procs_per_node=4, hints=hints, allowed=DEEPSPEED_DIMS,
                            env={}).plan == op.plan
        env = {ENV_TOPOLOGY: op.env()["value"]}  # the operator's plan, read back by the trainer
        for plan in (lambda: plan_job(par, low, topology=build_topology(par, NodePool()), mode="none", hints=hints,
                                      allowed=DEEPSPEED_DIMS),
                     lambda: plan_for_job(par, low, world_size=4, procs_per_node=4, hints=hints,
                                          allowed=DEEPSPEED_DIMS, env={}),
                     lambda: plan_for_job(par.model_copy(update={"plan": None}), low, world_size=4, procs_per_node=4,
                                          hints=hints, allowed=DEEPSPEED_DIMS, env=env)):
            with pytest.raises(PlanError, match=f"{field} with spec.training.precision {precision} is not supported"):
                plan()
    # auto-chosen: ep stays 1 under bf16 (deepspeed_auto_dims), which the check accepts
    auto = plan_for_job(ParallelismSpec(num_nodes=1, procs_per_node=4, zero_stage=2), TrainingSpec(precision=precision),
                        world_size=4, procs_per_node=4, hints=hints, allowed=DEEPSPEED_DIMS, env={})
    assert (auto.plan.ep, auto.plan.sparse_shard) == (1, 1)
    # outside the DeepSpeed path (allowed=DIMS) the rule is not this module's to apply
    plan_for_job(ParallelismSpec(num_nodes=1, procs_per_node=4, zero_stage=2, plan={"ep": 2}),
                 TrainingSpec(precision=precision), world_size=4, procs_per_node=4, hints=hints, env={})


@pytest.mark.parametrize("fixed, hints, expect", [
    # ep must divide the dp_shard the given dp_replicate leaves (16 / 4 = 4), not just the data ranks
    ({"dp_replicate": 4}, ModelShapeHints(num_experts=8), dict(dp_replicate=4, dp_shard=4, ep=4)),
    # tp and cp must fit in the ranks the given data degrees leave (16 / 16 = 1, 16 / 8 = 2)
    ({"dp_shard": 16}, ModelShapeHints(hidden_dim=16384), dict(dp_shard=16, tp=1)),
    ({"dp_shard": 16}, ModelShapeHints(max_seq_len=40000), dict(dp_shard=16, cp=1)),
    ({"dp_replicate": 8}, ModelShapeHints(max_seq_len=40000), dict(dp_replicate=8, cp=2)),
    ({"cp": 8}, ModelShapeHints(hidden_dim=16384), dict(cp=8, tp=2)),
])
def test_auto_plan_chooses_the_free_degrees_around_the_given_ones(fixed, hints, expect):
    """docs §3: the degrees given are kept and the others chosen around them: a feasible spec must not
    fail because an automatic choice ignored a given degree."""
    plan, why = auto_plan(16, sim(16, 8, [("block", 2)]), hints, fixed=fixed)
    assert {k: getattr(plan, k) for k in expect} == expect, why


@pytest.mark.parametrize("tp", [3, 16])
def test_auto_plan_names_a_given_tp_that_cannot_divide_the_world(tp):
    """A given tp that leaves no room for cp raised a bare `max() arg is an empty sequence`."""
    with pytest.raises(PlanError, match=rf"tp\({tp}\)") as e:
        auto_plan(8, sim(8, 8, []), ModelShapeHints(max_seq_len=40000), fixed={"tp": tp})
    assert e.value.world_size == 8


def test_trainer_plans_on_the_nodes_it_runs_on_not_the_spec_s_procs_per_node():
    """Same world, other node shape (the spec says 1 x 8, torchrun runs 2 x 4): tp must stay in the
    real 4-rank node. The spec's procsPerNode sized the node, so tp=8 crossed the two nodes."""
    from gem.api.types import TrainingSpec
    from gem.parallel.job import plan_for_job

    hints = ModelShapeHints(hidden_dim=16384)
    job = plan_for_job(ParallelismSpec(num_nodes=1, procs_per_node=8), TrainingSpec(), world_size=8,
                       procs_per_node=4, hints=hints, env={})
    assert (job.topology.node.size, job.plan.tp) == (4, 4)
    with pytest.raises(PlanError, match="tp=8 does not fit") as e:
        plan_for_job(ParallelismSpec(num_nodes=1, procs_per_node=8, plan={"tp": 8}), TrainingSpec(), world_size=8,
                     procs_per_node=4, hints=hints, env={})
    assert e.value.level == "node"


def test_auto_plan_ep_in_a_node_means_its_groups_divide_the_node():
    """6 ranks per node, 4 experts: an ep=4 group (ranks 4-7) straddles two nodes; "fits in a node"
    (docs §3) needs the group to divide the node, so ep=2 keeps every expert group on NVLink."""
    plan, why = auto_plan(24, sim(24, 6, [("block", 2)]), ModelShapeHints(num_experts=4))
    assert plan.ep == 2 and "inside one node" in why
    assert all(g[0] // 6 == g[-1] // 6 for g in plan.group_ranks("ep"))


def test_a_given_ep_that_does_not_divide_the_experts_names_the_field_and_the_fix():
    """A spec ep that splits 6 experts over 4 ranks was accepted (the operator rendered the job) and the
    trainer then died in parallelize with a bare ValueError; the plan check now refuses it by name."""
    topo = Topology.build(procs_per_node=4, num_nodes=1)
    with pytest.raises(PlanError, match=r"ep=4 \(given in spec\.parallelism\.plan\) .*6 dense experts.*1, 2, 3 or 6") as e:
        auto_plan(4, topo, ModelShapeHints(num_experts=6), zero_stage=2, fixed={"ep": 4})
    assert (e.value.dimension, e.value.degree, e.value.world_size) == ("ep", 4, 4)
    plan, _ = auto_plan(4, topo, ModelShapeHints(num_experts=6), zero_stage=2, fixed={"ep": 2})
    assert plan.ep == 2
    plan, _ = auto_plan(4, topo, ModelShapeHints(), zero_stage=2, fixed={"ep": 4})  # no experts known: warned later
    assert plan.ep == 4


def test_sparse_reason_counts_the_context_parallel_ranks_among_the_data_ranks():
    """Row shards range over dp x cp data ranks: the reason said "replicated 0x" for one shard group over a
    node with cp=2 (it divided the ranks without cp by a shard count with it)."""
    plan, why = auto_plan(4, Topology.build(procs_per_node=4, num_nodes=1), ModelShapeHints(max_seq_len=20000))
    assert (plan.cp, plan.sparse_shard) == (2, 4) and "sharded over 4 data ranks" in why and "replicated 1x" in why
    plan, why = auto_plan(16, sim(16, 4, [("block", 2)]), ModelShapeHints(max_seq_len=20000))
    assert (plan.cp, plan.dp_replicate, plan.sparse_shard) == (2, 2, 8) and "replicated 2x" in why
    # tables that need more shards than dp ranks alone hold get them from the cp ranks too
    need_all = ModelShapeHints(max_seq_len=20000, sparse_params=16 * 2**30, gpu_memory_bytes=16 * 2**30)
    plan, why = auto_plan(16, sim(16, 4, [("block", 2)]), need_all)
    assert plan.sparse_shard == 16 and "replicated 1x" in why


def test_a_degree_the_spec_left_out_is_not_reported_as_given():
    """On the DeepSpeed path sparse_shard stays 1 unless given; with another degree given, status.parallelPlan's
    reason said "sparse_shard=1: given in spec.parallelism.plan" for a spec that never named it."""
    from gem.api.types import TrainingSpec
    from gem.parallel.job import plan_for_job
    from gem.parallel.plan import DEEPSPEED_DIMS

    par = ParallelismSpec(num_nodes=1, procs_per_node=4, zero_stage=2, plan=ParallelPlanSpec(cp=2))
    job = plan_for_job(par, TrainingSpec(), world_size=4, procs_per_node=4, hints=ModelShapeHints(),
                       allowed=DEEPSPEED_DIMS, env={})
    assert (job.plan.cp, job.plan.sparse_shard, job.chosen) == (2, 1, "spec")
    assert "cp=2: given in spec.parallelism.plan" in job.reason
    assert "sparse_shard=1: given" not in job.reason
    assert "sparse_shard=1: embedding tables are replicated (row sharding runs on the DeepSpeed path only" in job.reason
