"""Topology-aware placement and the parallel plan, through the operator (docs/parallelism.md §5, §8).

The operator runs as its own process against the API test server with labelled Node objects; as
in tests/test_operator.py the tests play the training operator and the scheduler (pods are created
bound to nodes), except the last test, where the test server's executor binds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

from tests.kubeapi import KubeAPIServer
from tests.kubeapi.testing import pytorchjob, wait_for
from tests.test_operator import api, cluster, condition, create, gemtraining, job_conditions, jobs, operator, status_of, wait_phase  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
BLOCK = "cloud.provider.com/topology-block"
ZONE = "topology.kubernetes.io/zone"
KUEUE = "kueue.x-k8s.io/"


def _schema() -> dict:
    path = ROOT.parent / "shared/reference/kubeflow.org_pytorchjobs.yaml"
    if not path.exists():
        path = ROOT / "tests/kubeapi/crds/kubeflow.org_pytorchjobs.yaml"
    return yaml.safe_load(path.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def add_nodes(cluster, blocks: dict[str, list[str]], zone: str = "z0", pool: str = "gpu") -> None:
    for block, names in blocks.items():
        for name in names:
            labels = {"kubernetes.io/hostname": name, BLOCK: block, ZONE: zone, "pool": pool}
            cluster.create("v1", "Node", {"metadata": {"name": name, "labels": labels}}, namespace=None)


def parallel_training(name: str, *, num_nodes: int = 4, scheduling: dict | None = None, **parallelism) -> dict:
    return gemtraining(name, parallelism={"numNodes": num_nodes, "procsPerNode": 1, "zeroStage": 2,
                                          "topology": {"levels": [BLOCK, ZONE]}, **parallelism},
                       resources={"nodeSelector": {"pool": "gpu"}}, scheduling=scheduling or {})


def templates(job: dict) -> dict[str, dict]:
    return {rt: rs["template"] for rt, rs in job["spec"]["pytorchReplicaSpecs"].items()}


def topology_env(job: dict) -> dict:
    env = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["env"]
    return json.loads(next(e["value"] for e in env if e["name"] == "GEM_TOPOLOGY"))


def bind_pods(cluster, job_name: str, nodes: list[str]) -> None:
    """What the training operator and the scheduler do: one pod per node rank, bound to nodes[rank]."""
    for rank, node in enumerate(nodes):
        rtype, index = ("master", 0) if rank == 0 else ("worker", rank - 1)
        cluster.create("v1", "Pod", {
            "metadata": {"name": f"{job_name}-{rtype}-{index}", "labels": {
                "training.kubeflow.org/job-name": job_name, "training.kubeflow.org/replica-type": rtype,
                "training.kubeflow.org/replica-index": str(index)}},
            "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "trainer"}]},
        })
    cluster.patch_status("kubeflow.org/v1", "PyTorchJob", job_name, {
        "conditions": job_conditions("Created", "Running"), "replicaStatuses": {"Master": {"active": 1}}})


# --------------------------------------------------------------------------- rendering


def test_kueue_placement_measures_the_node_pool_and_annotates_both_templates(cluster, operator, api):
    # blocks of 3 nodes: a 4-node job is cut into 2-node slices (the largest divisor of 4 that fits)
    add_nodes(cluster, {"b0": ["n0", "n1", "n2"], "b1": ["n3", "n4", "n5"]})
    add_nodes(cluster, {"other": ["cpu0"]}, pool="cpu")  # outside the nodeSelector: not measured
    create(api, parallel_training("tas", scheduling={"queueName": "team-a"}))
    status = wait_phase(cluster, "GEMTraining", "tas", "Created")
    job = cluster.get("kubeflow.org/v1", "PyTorchJob", "tas-train")
    jsonschema.validate(job, _schema())
    for rtype, template in templates(job).items():
        ann = template["metadata"]["annotations"]
        assert ann[KUEUE + "podset-group-name"] == "tas-train", rtype
        assert ann[KUEUE + "podset-required-topology"] == ZONE  # the whole job fits one zone
        assert ann[KUEUE + "podset-slice-required-topology"] == BLOCK
        assert ann[KUEUE + "podset-slice-size"] == "2"
        assert "affinity" not in template["spec"]
    env = topology_env(job)
    assert env["placement"] == "kueue" and env["nodesPerDomain"] == {BLOCK: 2, ZONE: 4}
    assert env["levels"] == [BLOCK, ZONE]

    plan = status["parallelPlan"]
    # the tiny preset's 2 Wukong experts, fp32 at ZeRO-2: the automatic plan splits them over each block
    degrees = (plan["dpReplicate"], plan["dpShard"], plan["ep"], plan["cp"], plan["tp"], plan["zeroStage"])
    assert degrees == (2, 2, 2, 1, 1, 2)
    assert plan["chosen"] == "auto" and plan["groupLevels"] == {"dp_replicate": "zone", "ep": "block"}
    assert "ep=2: 2 dense experts, 1 per rank, each expert-parallel group inside one block" in plan["reason"]
    # DeepSpeed's ZeRO-1/2 partition over every data rank: the split only places the expert groups
    assert "dp_shard=2: every data rank of one block" in plan["reason"]
    assert "ZeRO-2 partitions over all 4 data ranks" in plan["reason"]
    assert plan == {k: v for k, v in env["plan"].items() if k != "worldSize"} | {
        "chosen": env["chosen"], "reason": env["reason"], "groupLevels": env["groupLevels"]}
    log = (operator.log).read_text()
    assert "parallel plan dp_replicate=2 dp_shard=2" in log and "parallel reason tp=1" in log


def test_auto_plan_leaves_experts_whole_where_the_trainer_cannot_shard_them(cluster, operator, api):
    add_nodes(cluster, {"b0": ["n0", "n1"], "b1": ["n2", "n3"]})
    create(api, parallel_training("zero3", zeroStage=3))
    create(api, {**parallel_training("bf16"), "spec": {**parallel_training("bf16")["spec"],
                                                       "training": {"precision": "bf16"}}})
    for name, why in (("zero3", "ep=1: ZeRO-3 partitions every parameter, expert shards cannot stay outside"),
                      ("bf16", "ep=1: precision bf16: expert shards would train outside DeepSpeed")):
        plan = wait_phase(cluster, "GEMTraining", name, "Created")["parallelPlan"]
        assert plan["ep"] == 1 and why in plan["reason"], plan["reason"]
        assert "sparse_shard=1: embedding tables are replicated (row sharding runs on the DeepSpeed path only " \
               "when given in spec.parallelism.plan)" in plan["reason"]


def test_affinity_placement_without_a_queue_and_explicit_degrees(cluster, operator, api):
    create(api, parallel_training("aff", topology={"levels": [BLOCK, ZONE], "nodesPerDomain": {BLOCK: 2, ZONE: 8}},
                                  plan={"cp": 2}))
    status = wait_phase(cluster, "GEMTraining", "aff", "Created")
    job = cluster.get("kubeflow.org/v1", "PyTorchJob", "aff-train")
    jsonschema.validate(job, _schema())
    for template in templates(job).values():
        assert not any(k.startswith(KUEUE) for k in (template["metadata"].get("annotations") or {}))
        aff = template["spec"]["affinity"]["podAffinity"]
        selector = {"gem.dev/kind": "gemtraining", "gem.dev/name": "aff"}
        assert aff["requiredDuringSchedulingIgnoredDuringExecution"] == [
            {"labelSelector": {"matchLabels": selector}, "topologyKey": ZONE}]
        assert aff["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == BLOCK
    plan = status["parallelPlan"]
    assert plan["chosen"] == "spec" and plan["cp"] == 2 and "cp=2: given in spec.parallelism.plan" in plan["reason"]
    # affinity does not order ranks inside the zone: the plan relied on the zone only
    assert plan["groupLevels"]["cp"] == "zone"
    assert topology_env(job)["placement"] == "affinity"


def test_an_impossible_plan_is_invalid_with_an_event_naming_dimension_and_level(cluster, operator, api):
    add_nodes(cluster, {"b0": ["n0", "n1"], "b1": ["n2", "n3"]})
    # cp groups of 4 ranks cannot stay in 2-node blocks
    create(api, parallel_training("too-wide", placement="kueue", plan={"cp": 4}))
    # a level no node carries and the spec does not size
    create(api, parallel_training("no-level", topology={"levels": ["example.com/rack"]}))
    create(api, parallel_training("fine", plan={"cp": 2}, placement="kueue"))

    status = wait_phase(cluster, "GEMTraining", "too-wide", "Invalid")
    valid = condition(status, "Valid")
    assert valid["status"] == "False" and valid["reason"] == "InvalidParallelPlan"
    assert "cp=4 does not fit" in valid["message"] and "'block' domain" in valid["message"]
    assert "[dimension cp, level block]" in valid["message"]
    events = [e for e in cluster.events(involved_name="too-wide") if e["reason"] == "InvalidParallelPlan"]
    assert len(events) == 1 and events[0]["type"] == "Warning" and "cp=4" in events[0]["message"]

    status = wait_phase(cluster, "GEMTraining", "no-level", "Invalid")
    assert condition(status, "Valid")["reason"] == "InvalidTopology"
    assert "example.com/rack" in status["message"] and "nodesPerDomain" in status["message"]

    wait_phase(cluster, "GEMTraining", "fine", "Created")
    assert [j["metadata"]["name"] for j in jobs(cluster)] == ["fine-train"]
    assert operator.alive


def test_shards_with_bf16_are_invalid_before_a_job_exists(cluster, operator, api):
    """ep / sparseShard with bf16 or mxfp8: the trainer refuses them at setup (their shards would train
    without fp32 master weights), so the operator must too, instead of creating a job whose pods fail."""
    add_nodes(cluster, {"b0": ["n0", "n1"], "b1": ["n2", "n3"]})

    def training(name: str, precision: str, plan: dict) -> dict:
        body = parallel_training(name, placement="kueue", plan=plan)
        return {**body, "spec": {**body["spec"], "training": {"precision": precision}}}

    create(api, training("ep-bf16", "bf16", {"ep": 2}))
    create(api, training("rows-mxfp8", "mxfp8", {"sparseShard": 2}))
    create(api, training("ep-fp32", "fp32", {"ep": 2}))  # the same plan in fp32 runs

    for name, field, precision, dim in (("ep-bf16", "spec.parallelism.plan.ep", "bf16", "ep"),
                                        ("rows-mxfp8", "spec.parallelism.plan.sparseShard", "mxfp8", "sparse_shard")):
        status = wait_phase(cluster, "GEMTraining", name, "Invalid")
        valid = condition(status, "Valid")
        assert valid["status"] == "False" and valid["reason"] == "InvalidParallelPlan", valid
        msg = valid["message"]
        assert f"{field}=2 with spec.training.precision {precision} is not supported" in msg, msg
        assert f"Set spec.training.precision to fp32, or {field} to 1" in msg and f"[dimension {dim}]" in msg, msg
        events = [e for e in cluster.events(involved_name=name) if e["reason"] == "InvalidParallelPlan"]
        assert len(events) == 1 and events[0]["type"] == "Warning" and field in events[0]["message"]
    assert wait_phase(cluster, "GEMTraining", "ep-fp32", "Created")["parallelPlan"]["ep"] == 2
    assert [j["metadata"]["name"] for j in jobs(cluster)] == ["ep-fp32-train"]
    assert operator.alive


# --------------------------------------------------------------------------- where ranks landed


def test_status_placement_reports_the_domains_and_violations(cluster, operator, api):
    add_nodes(cluster, {"b0": ["n0", "n1"], "b1": ["n2", "n3"]})
    add_nodes(cluster, {"b2": ["m0", "m1"], "b3": ["m2", "m3"]}, zone="z1")
    create(api, parallel_training("good", plan={"cp": 2}, placement="kueue"))
    create(api, parallel_training("bad", plan={"cp": 2}, placement="kueue"))
    wait_phase(cluster, "GEMTraining", "good", "Created")
    wait_phase(cluster, "GEMTraining", "bad", "Created")

    bind_pods(cluster, "good-train", ["n0", "n1", "n2", "n3"])
    expected = {"mode": "kueue", "violations": [], "domains": {"block": {"b0": "0-1", "b1": "2-3"}, "zone": {"z0": "0-3"}}}
    wait_for(lambda: status_of(cluster, "GEMTraining", "good").get("placement") == expected,
             what=f"status.placement of good == {expected}")

    # node ranks 0 and 1 (one cp group) land in different blocks
    bind_pods(cluster, "bad-train", ["m0", "m2", "m1", "m3"])
    placement = wait_for(
        lambda: (p := status_of(cluster, "GEMTraining", "bad").get("placement") or {}).get("domains", {}).get("zone")
        == {"z1": "0-3"} and p, what="status.placement of bad with all four ranks")
    assert placement["domains"]["block"] == {"b2": "0,2", "b3": "1,3"}
    assert len(placement["violations"]) == 1 and "2 of 2 cp groups span more than one block" in placement["violations"][0]
    events = wait_for(lambda: [e for e in cluster.events(involved_name="bad") if e["reason"] == "PlacementViolation"],
                      what="PlacementViolation event")
    assert events[0]["type"] == "Warning" and "cp groups" in events[0]["message"]
    assert not [e for e in cluster.events(involved_name="good") if e["reason"] == "PlacementViolation"]
    assert "placement mode=kueue node rank:node [0:m0, 1:m2, 2:m1, 3:m3]" in operator.log.read_text()


def test_the_test_server_binds_pods_to_nodes_in_rank_order(tmp_path):
    with KubeAPIServer(executor=True, workdir=tmp_path / "kubeapi") as server:
        for i, block in enumerate(["b1", "b0", "b1", "b0"]):
            server.create("v1", "Node", {"metadata": {"name": f"node-{i}", "labels": {BLOCK: block}}}, namespace=None)
        server.create("kubeflow.org/v1", "PyTorchJob", pytorchjob("bound", ["true"], ["true"], workers=3))
        pods = wait_for(lambda: len(p := server.list("v1", "Pod")) == 4 and p, what="4 pods")
        where = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in pods}
        assert where == {"bound-master-0": "node-0", "bound-worker-0": "node-1", "bound-worker-1": "node-2",
                         "bound-worker-2": "node-3"}


def test_the_trainer_report_fills_status_parallel_plan_without_an_operator():
    """The SDK's local backend has no operator: status.parallelPlan comes from the trainer's report."""
    from gem.api.status import apply_report
    from gem.api.types import JobStatus

    report = {"parallelPlan": {"worldSize": 4, "dpReplicate": 1, "dpShard": 2, "ep": 1, "cp": 2, "tp": 1,
                               "sparseShard": 1, "zeroStage": 2, "chosen": "spec", "reason": "cp=2: given",
                               "groupLevels": {"cp": "node"}, "placement": "none", "topology": "4 procs/node x 1 nodes"}}
    status = apply_report({}, report)
    plan = JobStatus.model_validate(status).parallel_plan  # the CRD's status schema accepts it as is
    assert (plan.dp_shard, plan.cp, plan.chosen, plan.reason) == (2, 2, "spec", "cp=2: given")
    assert "parallelPlan" not in apply_report({}, {"parallelPlan": "garbled"})
