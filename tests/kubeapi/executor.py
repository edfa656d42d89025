"""A fake training-operator (v1.9) plus a fake kubelet inside the test API server.

It reconciles `kubeflow.org/v1` PyTorchJobs: creates one Pod and one headless Service per
replica (`<job>-master-0`, `<job>-worker-<i>`) with the operator's labels and a controller
ownerReference, runs each pod's `pytorch` container as a local process group through
`gem.launcher.local.LocalPod`, and writes Pod status (Pending -> Running ->
Succeeded/Failed, containerStatuses with exit code, reason and termination message) and
PyTorchJob status (conditions, replicaStatuses, startTime, completionTime,
lastReconcileTime) the way training-operator does.

Pod specs stored in the API carry the *cluster* environment (`MASTER_ADDR=<job>-master-0`,
`MASTER_PORT=23456`); the local processes get the same variables with the master's
Service mapped to 127.0.0.1 and a free port picked per job.

Condition reasons/messages follow kubeflow/trainer `pkg/controller.v1/pytorch/
pytorchjob_controller.go` (UpdateJobStatus) and `pkg/controller.v1/common/job.go`
(suspend, backoff limit, active deadline) of the v1.9 line; `setCondition`/
`filterOutCondition` semantics are copied (Running and Restarting replace each other, a
terminal condition sets Running to False, nothing changes after Failed).

runPolicy.backoffLimit means what it means to `gem.launcher.local.LocalPyTorchJob` (the rule is
its `backoff_exhausted`): v1.9's PastBackoffLimit fails the job once the summed restartCount of
its OnFailure/Always pods that have not succeeded reaches the limit (is > 0 for 0); the restart
that would reach it is not made, so a limit of n allows n - 1 restarts (none for 0 or 1). ExitCode
recreations (exit codes >= 128) are counted apart, up to backoffLimit of them. No limit when unset.

Deviations (documented in docs/kubeapi.md): a failure is decided when it is seen, a scheduled
restart (CrashLoopBackOff) already counting (training-operator reads the restartCount of running
pods after the kubelet restarted them, which is racy); once the job is terminal no container is
restarted; `Always` behaves like `OnFailure`; init containers and sidecars are not run.
"""

from __future__ import annotations

import asyncio
import copy
import secrets as _secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gem.launcher.env import decode_secret, replica_name, training_operator_env, container_port
from gem.launcher.local import IN_PLACE_POLICIES, LocalPod, backoff_exhausted, decode_configmap, free_port, now_iso

from .errors import ApiError
from .store import ResourceType, Store

JOB_KEY = ("kubeflow.org", "pytorchjobs")
KIND = "PyTorchJob"
OPERATOR_NAME = "pytorchjob-controller"
L_JOB = "training.kubeflow.org/job-name"
L_OP = "training.kubeflow.org/operator-name"
L_TYPE = "training.kubeflow.org/replica-type"
L_INDEX = "training.kubeflow.org/replica-index"
L_ROLE = "training.kubeflow.org/job-role"


@dataclass
class PodRun:
    pod: LocalPod
    ns: str
    name: str
    uid: str
    job_uid: str
    rtype: str
    index: int
    restart_policy: str
    restart_at: float | None = None
    reported: tuple | None = None
    exhausted: bool = False
    #: lastState.terminated once the container was restarted: the exited container's, as the
    #: kubelet keeps it (its log is then `<log>.previous`).
    last_terminated: dict | None = None


@dataclass
class JobState:
    master_port: int
    exit_code_restarts: int = 0  # ExitCode recreations (a recreated pod starts at restartCount 0)
    cleaned: bool = False
    started: float | None = None  # monotonic time of startTime (startTime has 1 s resolution)
    runs: dict[str, PodRun] = field(default_factory=dict)  # pod name -> run


def _cond(ctype: str, status: str, reason: str, message: str) -> dict:
    t = now_iso()
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastUpdateTime": t, "lastTransitionTime": t}


def set_condition(status: dict, cond: dict) -> None:
    """training-operator's commonutil.UpdateJobConditions / setCondition."""
    conds = status.setdefault("conditions", [])
    if any(c["type"] == "Failed" and c["status"] == "True" for c in conds):
        return
    cur = next((c for c in conds if c["type"] == cond["type"]), None)
    if cur is not None and cur["status"] == cond["status"] and cur.get("reason") == cond["reason"]:
        return
    if cur is not None and cur["status"] == cond["status"]:
        cond["lastTransitionTime"] = cur.get("lastTransitionTime", cond["lastTransitionTime"])
    new = []
    for c in conds:
        if cond["type"] == "Restarting" and c["type"] == "Running":
            continue
        if cond["type"] == "Running" and c["type"] == "Restarting":
            continue
        if c["type"] == cond["type"]:
            continue
        if cond["type"] in ("Failed", "Succeeded") and c["type"] == "Running" and c["status"] != "False":
            c = dict(c, status="False")
        new.append(c)
    new.append(cond)
    status["conditions"] = new


def _is_true(status: dict, ctype: str) -> bool:
    return any(c["type"] == ctype and c["status"] == "True" for c in status.get("conditions") or [])


class PyTorchJobExecutor:
    def __init__(self, store: Store, workdir: str | Path, restart_backoff: float = 0.5, tick: float = 0.1,
                 grace: float = 2.0) -> None:
        self.store = store
        self.workdir = Path(workdir)
        self.restart_backoff = restart_backoff
        self.tick = tick
        self.grace = grace
        self.jobs: dict[str, JobState] = {}
        self.by_pod: dict[tuple[str, str], PodRun] = {}
        self.dying: list[tuple[LocalPod, float]] = []
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        store.listeners.append(self._on_event)

    # ------------------------------------------------------------------ plumbing

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that lands as the event is
            # set (shutdown kills pods, whose events poke it), and the loop ran on: a 30 s hang at stop
            try:
                async with asyncio.timeout(self.tick):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                self.reconcile_all()
            except Exception:  # never let the loop die; show the bug
                import traceback

                traceback.print_exc()

    def _poke(self) -> None:
        if self._loop is None or self._wake is None or self._loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._wake.set()
        else:
            self._loop.call_soon_threadsafe(self._wake.set)

    def _on_event(self, etype: str, t: ResourceType, obj: dict, old: dict | None) -> None:
        if t.key == JOB_KEY:
            self._poke()
        elif t.key == ("", "pods") and etype == "DELETED":
            md = obj["metadata"]
            run = self.by_pod.get((md.get("namespace", ""), md["name"]))
            if run is not None and run.uid == md["uid"]:
                self.by_pod.pop((run.ns, run.name), None)
                js = self.jobs.get(run.job_uid)
                if js is not None and js.runs.get(run.name) is run:
                    del js.runs[run.name]
                run.pod.terminate()
                self.dying.append((run.pod, time.monotonic() + self.grace))
                self._poke()

    def shutdown(self) -> None:
        """Kill every process group (server shutdown): never leave orphans."""
        if self._task is not None:
            self._task.cancel()
        pods = [r.pod for r in self.by_pod.values()] + [p for p, _ in self.dying]
        for p in pods:
            p.terminate()
        end = time.monotonic() + self.grace
        for p in pods:
            p.stop(max(0.0, end - time.monotonic()))
        self.by_pod.clear()
        self.dying.clear()

    def log_provider(self, ns: str, name: str, container: str | None, previous: bool = False):
        """(log path, is running) of the pod's container, None before it has one. With `previous`,
        the last terminated container's, as the kubelet serves `?previous=true`: in CrashLoopBackOff
        the one that just exited (not restarted yet), after a restart the one before it."""
        run = self.by_pod.get((ns, name))
        if run is None:
            return None
        if not previous:
            return str(run.pod.log_path), lambda: run.pod.running
        if run.restart_at is not None:
            return str(run.pod.log_path), lambda: False
        if run.last_terminated is not None:
            return f"{run.pod.log_path}.previous", lambda: False
        return None  # no previous container: the app answers the kubelet's 400

    # ------------------------------------------------------------------ reconcile

    @property
    def _t_jobs(self) -> ResourceType | None:
        return self.store.types.get(JOB_KEY)

    def reconcile_all(self) -> None:
        now = time.monotonic()
        still = []
        for pod, deadline in self.dying:
            if pod.running and now < deadline:
                still.append((pod, deadline))
            elif pod.running:
                pod.kill()
                still.append((pod, now + 5))
            else:
                pod.poll()
        self.dying = still
        t = self._t_jobs
        if t is None:
            return
        with self.store.lock:
            jobs, _ = self.store.list(t)
            live = set()
            for job in jobs:
                live.add(job["metadata"]["uid"])
                try:
                    self.reconcile(t, job)
                except ApiError as e:
                    if e.code not in (404, 409):
                        raise
            for uid in list(self.jobs):
                if uid not in live:
                    self.jobs.pop(uid)

    def _job_pods(self, job: dict) -> dict[str, dict]:
        md = job["metadata"]
        pods, _ = self.store.list(self.store.types[("", "pods")], md["namespace"], f"{L_JOB}={md['name']}")
        out = {}
        for p in pods:
            for ref in p["metadata"].get("ownerReferences") or ():
                if ref.get("uid") == md["uid"] and ref.get("controller"):
                    out[p["metadata"]["name"]] = p
        return out

    def reconcile(self, t: ResourceType, job: dict) -> None:
        md = job["metadata"]
        name, uid = md["name"], md["uid"]
        js = self.jobs.get(uid)
        if js is None:
            js = self.jobs[uid] = JobState(master_port=free_port())
        old_status = job.get("status") or {}
        status = copy.deepcopy(old_status)
        events: list[tuple[str, str, str]] = []
        if not any(c["type"] == "Created" for c in status.get("conditions") or []):
            set_condition(status, _cond("Created", "True", f"{KIND}Created", f"{KIND} {name} is created."))
        if md.get("deletionTimestamp"):
            self._write_status(t, job, old_status, status)
            return
        spec = job.get("spec") or {}
        specs: dict = spec.get("pytorchReplicaSpecs") or {}
        run_policy = spec.get("runPolicy") or {}
        pods = self._job_pods(job)
        terminal = _is_true(status, "Succeeded") or _is_true(status, "Failed")

        if terminal:
            self._sync_runs(js, pods, job, allow_restart=False)
            if not js.cleaned:
                js.cleaned = True
                self._clean(job, pods, run_policy.get("cleanPodPolicy") or "None")
            pods = self._job_pods(job)
            status["replicaStatuses"] = self._replica_statuses(job, specs, pods)
            self._write_status(t, job, old_status, status)
            return

        if run_policy.get("suspend"):
            if pods:
                self._clean(job, pods, "All")
            msg = f"{KIND} {name} is suspended."
            set_condition(status, _cond("Suspended", "True", f"{KIND}Suspended", msg))
            if _is_true(status, "Running"):
                set_condition(status, _cond("Running", "False", f"{KIND}Suspended", msg))
            status.pop("startTime", None)
            js.started = None
            status["replicaStatuses"] = {rt: {"active": 0, "succeeded": 0, "failed": 0, "selector": self._selector(name, rt)} for rt in specs}
            self._write_status(t, job, old_status, status)
            return
        if _is_true(status, "Suspended"):
            set_condition(status, _cond("Suspended", "False", f"{KIND}Resumed", f"{KIND} {name} is resumed."))
            events.append(("Normal", f"{KIND}Resumed", f"{KIND} {name} is resumed."))

        if not status.get("startTime"):
            status["startTime"] = now_iso()
            js.cleaned = False
            js.started = time.monotonic()
        ads = run_policy.get("activeDeadlineSeconds")
        age = time.monotonic() - js.started if js.started is not None else _age(status["startTime"])
        if ads is not None and age > float(ads):
            msg = f"Job {name} has failed because it was active longer than specified deadline"
            self._fail(status, msg, events)
            self._finish(t, job, js, old_status, status, events, specs)
            return

        # create missing services and pods
        for rtype, rspec in specs.items():
            n = 1 if rspec.get("replicas") is None else int(rspec["replicas"])
            for i in range(n):
                pname = replica_name(name, rtype, i)
                if pname not in pods:
                    pods[pname] = self._create_pod(job, js, rtype, i, rspec)
                    events.append(("Normal", "SuccessfulCreatePod", f"Created pod: {pname}"))
                self._ensure_service(job, rtype, i)

        restarted: list[str] = []
        failure = self._sync_runs(js, pods, job, allow_restart=True, backoff=run_policy.get("backoffLimit"),
                                  events=events, restarted=restarted)
        pods = self._job_pods(job)
        rs = self._replica_statuses(job, specs, pods)
        status["replicaStatuses"] = rs
        if failure == "backoff":
            self._fail(status, f"Job {name} has failed because it has reached the specified backoff limit", events)
        for rtype in sorted(set(restarted)):
            msg = f"{KIND} {name} is restarting because {restarted.count(rtype)} {rtype} replica(s) failed."
            events.append(("Warning", f"{KIND}Restarting", msg))
            set_condition(status, _cond("Restarting", "True", f"{KIND}Restarting", msg))
        self._update_conditions(job, specs, rs, status, events, js)
        self._finish(t, job, js, old_status, status, events, specs)

    def _finish(self, t, job, js, old_status, status, events, specs) -> None:
        if (_is_true(status, "Succeeded") or _is_true(status, "Failed")) and not status.get("completionTime"):
            status["completionTime"] = now_iso()
        self._write_status(t, job, old_status, status)
        for etype, reason, msg in events:
            self._event(job, etype, reason, msg)
        if _is_true(status, "Succeeded") or _is_true(status, "Failed"):
            self._poke()  # run the terminal branch (cleanPodPolicy) promptly

    def _fail(self, status: dict, msg: str, events: list) -> None:
        set_condition(status, _cond("Failed", "True", f"{KIND}Failed", msg))
        events.append(("Normal", f"{KIND}Failed", msg))

    def _update_conditions(self, job, specs, rs, status, events, js) -> None:
        md = job["metadata"]
        name, ns = md["name"], md["namespace"]
        has_master = "Master" in specs
        for rtype, rspec in specs.items():
            st = rs.get(rtype) or {}
            replicas = 1 if rspec.get("replicas") is None else int(rspec["replicas"])
            succeeded, running, failed = st.get("succeeded", 0), st.get("active", 0), st.get("failed", 0)
            expected = replicas - succeeded
            if has_master:
                if rtype == "Master":
                    if running > 0:
                        set_condition(status, _cond("Running", "True", f"{KIND}Running", f"{KIND} {name} is running."))
                    if expected == 0:
                        msg = f"{KIND} {name} is successfully completed."
                        if not _is_true(status, "Succeeded"):
                            events.append(("Normal", f"{KIND}Succeeded", msg))
                        set_condition(status, _cond("Succeeded", "True", f"{KIND}Succeeded", msg))
                        return
            elif rtype == "Worker":
                if expected == 0 or ((job["spec"].get("elasticPolicy") is not None) and succeeded > 0):
                    msg = f"{KIND} {ns}/{name} successfully completed."
                    if not _is_true(status, "Succeeded"):
                        events.append(("Normal", f"{KIND}Succeeded", msg))
                    set_condition(status, _cond("Succeeded", "True", f"{KIND}Succeeded", msg))
                elif running > 0:
                    set_condition(status, _cond("Running", "True", f"{KIND}Running", f"{KIND} {ns}/{name} is running."))
            if failed > 0 and replicas > succeeded + running and not _is_true(status, "Failed"):
                # only replicas that will not be retried stay Failed (see _sync_runs)
                self._fail(status, f"{KIND} {name} is failed because {failed} {rtype} replica(s) failed.", events)

    # ------------------------------------------------------------------ pods

    def _selector(self, name: str, rtype: str) -> str:
        return f"{L_JOB}={name},{L_OP}={OPERATOR_NAME},{L_TYPE}={rtype.lower()}"

    def _labels(self, name: str, rtype: str, index: int) -> dict[str, str]:
        lb = {L_JOB: name, L_OP: OPERATOR_NAME, L_TYPE: rtype.lower(), L_INDEX: str(index)}
        if rtype == "Master":
            lb[L_ROLE] = "master"
        return lb

    def _owner(self, job: dict) -> dict:
        return {"apiVersion": "kubeflow.org/v1", "kind": KIND, "name": job["metadata"]["name"],
                "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}

    def _ensure_service(self, job: dict, rtype: str, index: int) -> None:
        md = job["metadata"]
        svcs = self.store.types[("", "services")]
        sname = replica_name(md["name"], rtype, index)
        if self.store.try_get(svcs, md["namespace"], sname) is not None:
            return
        port = container_port(job, rtype) or 23456
        labels = self._labels(md["name"], rtype, index)
        labels.pop(L_ROLE, None)
        self.store.create(svcs, md["namespace"], {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": sname, "namespace": md["namespace"], "labels": dict(labels), "ownerReferences": [self._owner(job)]},
            "spec": {"clusterIP": "None", "selector": labels,
                     "ports": [{"name": "pytorchjob-port", "port": port, "targetPort": port, "protocol": "TCP"}]},
        })

    def _create_pod(self, job: dict, js: JobState, rtype: str, index: int, rspec: dict) -> dict:
        md = job["metadata"]
        ns, name = md["namespace"], md["name"]
        pname = replica_name(name, rtype, index)
        template = copy.deepcopy(rspec.get("template") or {})
        tmd = template.get("metadata") or {}
        pspec = template.get("spec") or {}
        cluster_env = training_operator_env(job, rtype, index)
        for c in pspec.get("containers") or []:
            c["env"] = list(c.get("env") or []) + [{"name": k, "value": v} for k, v in cluster_env]
            if c.get("name") == "pytorch" and not any(p.get("name") == "pytorchjob-port" for p in c.get("ports") or []):
                c.setdefault("ports", []).append({"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"})
            c.setdefault("terminationMessagePath", "/dev/termination-log")
            c.setdefault("terminationMessagePolicy", "File")
        policy = rspec.get("restartPolicy") or "OnFailure"
        pspec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
        pspec.setdefault("nodeName", self._schedule(rtype, index, pspec))
        pspec.setdefault("schedulerName", "default-scheduler")
        labels = dict(tmd.get("labels") or {})
        labels.update(self._labels(name, rtype, index))
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pname, "namespace": ns, "labels": labels,
                         "annotations": dict(tmd.get("annotations") or {}), "ownerReferences": [self._owner(job)]},
            "spec": pspec,
        }
        pods_t = self.store.types[("", "pods")]
        obj = self.store.create(pods_t, ns, pod)
        obj = self.store.mutate(pods_t, ns, pname, lambda o: o.__setitem__("status", {
            "phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}],
            "qosClass": "BestEffort"}), subresource="status")
        # the process: the template's container env + the operator's env with local addresses
        local_env = training_operator_env(job, rtype, index, "127.0.0.1", js.master_port,
                                          rdzv_endpoint=f"127.0.0.1:{js.master_port}")
        run_spec = copy.deepcopy(rspec.get("template", {}).get("spec") or {})
        for c in run_spec.get("containers") or []:
            c["env"] = [self._field_ref(e, obj) for e in c.get("env") or []]
        cms, _ = self.store.list(self.store.types[("", "configmaps")], ns)
        configmaps = {c["metadata"]["name"]: decode_configmap(c) for c in cms}
        secrets_t = self.store.types[("", "secrets")]

        def secret(sname: str, ns=ns) -> dict | None:
            s = self.store.try_get(secrets_t, ns, sname)
            return decode_secret(s) if s is not None else None

        uid8 = obj["metadata"]["uid"][:8]
        lp = LocalPod(pname, run_spec, self.workdir / "pods" / ns / f"{pname}-{uid8}", extra_env=local_env,
                      configmaps=configmaps, secrets=secret, claims_dir=self.workdir / "claims" / ns,
                      log_path=self.workdir / "logs" / ns / f"{pname}-{uid8}.log")
        run = PodRun(lp, ns, pname, obj["metadata"]["uid"], md["uid"], rtype, index, policy)
        js.runs[pname] = run
        self.by_pod[(ns, pname)] = run
        lp.start()
        self._report(run)
        return self.store.get(pods_t, ns, pname)

    def _schedule(self, rtype: str, index: int, pspec: dict) -> str:
        """The node a pod is bound to: without Node objects the one local machine; with them, a
        deterministic stand-in for topology-aware scheduling: the nodes matching the pod's
        nodeSelector sorted by name, node rank r (Master 0, Worker i -> i+1) on the r-th of them."""
        nodes, _ = self.store.list(self.store.types[("", "nodes")], None)
        selector = pspec.get("nodeSelector") or {}
        names = sorted(n["metadata"]["name"] for n in nodes
                       if all((n["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items()))
        if not names:
            return "kubeapi-local"
        rank = index + (1 if rtype.lower() == "worker" else 0)
        return names[rank % len(names)]

    @staticmethod
    def _field_ref(e: dict, pod: dict) -> dict:
        fr = (e.get("valueFrom") or {}).get("fieldRef")
        if not fr:
            return e
        path = fr.get("fieldPath", "")
        md = pod["metadata"]
        m = {"metadata.name": md["name"], "metadata.namespace": md["namespace"], "metadata.uid": md["uid"],
             "status.podIP": "127.0.0.1", "status.hostIP": "127.0.0.1", "spec.nodeName": pod["spec"].get("nodeName", "kubeapi-local"),
             "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default")}
        if path in m:
            val = m[path]
        elif path.startswith("metadata.labels['"):
            val = (md.get("labels") or {}).get(path[len("metadata.labels['"):-2], "")
        elif path.startswith("metadata.annotations['"):
            val = (md.get("annotations") or {}).get(path[len("metadata.annotations['"):-2], "")
        else:
            val = ""
        return {"name": e["name"], "value": val}

    def _sync_runs(self, js: JobState, pods: dict, job: dict, allow_restart: bool, backoff: Any = None,
                   events: list | None = None, restarted: list | None = None) -> str | None:
        """Poll processes, restart within budget, report pod status. Returns "backoff" when
        a failure exceeded the job's backoff limit."""
        result = None
        now = time.monotonic()
        for pname, run in list(js.runs.items()):
            if pname not in pods or pods[pname]["metadata"]["uid"] != run.uid:
                continue
            st = run.pod.poll()
            if run.restart_at is not None:
                if not allow_restart:
                    run.restart_at = None
                    run.exhausted = True
                elif now >= run.restart_at:
                    run.restart_at = None
                    run.last_terminated = self._terminated(run)  # before restart() forgets it
                    run.pod.restart()
            elif st.phase == "Failed" and not run.exhausted and allow_restart and run.reported != ("recreate",):
                retryable = run.restart_policy in ("OnFailure", "Always") or (
                    run.restart_policy == "ExitCode" and (st.exit_code or 0) >= 128)
                if retryable:
                    made = js.exit_code_restarts if run.restart_policy == "ExitCode" else self._in_place_restarts(js)
                    if backoff_exhausted(backoff, run.restart_policy, made):
                        run.exhausted = True
                        result = "backoff"
                    else:
                        if run.restart_policy == "ExitCode":
                            js.exit_code_restarts += 1
                            # the operator deletes the pod; the next reconcile recreates it
                            self._report(run)
                            run.reported = ("recreate",)
                            if restarted is not None:
                                restarted.append(run.rtype)
                            if events is not None:
                                events.append(("Normal", "ExitedWithCode",
                                               f"Pod: {run.ns}.{pname} exited with code {st.exit_code}"))
                            continue
                        delay = min(self.restart_backoff * (2 ** st.restart_count), self.restart_backoff * 10)
                        run.restart_at = now + delay
                else:
                    run.exhausted = True
            self._report(run)
        # ExitCode restarts: delete failed pods after reporting them once as Failed
        for pname, run in list(js.runs.items()):
            if run.reported == ("recreate",):
                try:
                    self.store.delete(self.store.types[("", "pods")], run.ns, pname)
                except ApiError:
                    pass
        return result

    @staticmethod
    def _in_place_restarts(js: JobState) -> int:
        """The summed restartCount of the job's OnFailure/Always pods that have not succeeded,
        a restart already scheduled (CrashLoopBackOff) counting as made."""
        return sum(r.pod.state.restart_count + (r.restart_at is not None) for r in js.runs.values()
                   if r.restart_policy in IN_PLACE_POLICIES and r.pod.state.phase != "Succeeded")

    def _report(self, run: PodRun) -> None:
        st = run.pod.state
        key = (st.phase, st.exit_code, st.restart_count, run.restart_at is not None, st.started_at, run.exhausted)
        if run.reported == key or run.reported == ("recreate",):
            return
        run.reported = key
        waiting = run.restart_at is not None
        if st.phase == "Running":
            cstate = {"running": {"startedAt": st.started_at}}
        elif st.phase in ("Succeeded", "Failed") and not waiting:
            cstate = {"terminated": self._terminated(run)}
        elif waiting:
            cstate = {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": f"back-off restarting failed container={run.pod.container.get('name')} pod={run.name}"}}
        else:
            cstate = {"waiting": {"reason": "ContainerCreating"}}
        phase = st.phase
        if waiting:
            phase = "Running"
        cs = {"name": run.pod.container.get("name"), "image": run.pod.container.get("image", ""),
              "imageID": "", "containerID": f"local://{st.pid or 0}", "ready": st.phase == "Running",
              "started": st.phase == "Running", "restartCount": st.restart_count, "state": cstate}
        # The last terminated container: while waiting to restart, the one that just exited.
        last = self._terminated(run) if waiting else run.last_terminated
        if last is not None:
            cs["lastState"] = {"terminated": last}
        ready = "True" if st.phase == "Running" else "False"
        t = now_iso()
        status = {
            "phase": phase, "hostIP": "127.0.0.1", "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": st.started_at or t, "qosClass": "BestEffort",
            "conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": t},
                {"type": "Initialized", "status": "True", "lastTransitionTime": t},
                {"type": "ContainersReady", "status": ready, "lastTransitionTime": t},
                {"type": "Ready", "status": ready, "lastTransitionTime": t},
            ],
            "containerStatuses": [cs],
        }
        pods_t = self.store.types[("", "pods")]
        try:
            self.store.mutate(pods_t, run.ns, run.name, lambda o: o.__setitem__("status", status), subresource="status")
        except ApiError:
            pass

    def _terminated(self, run: PodRun) -> dict:
        st = run.pod.state
        d = {"exitCode": st.exit_code if st.exit_code is not None else 0, "reason": st.reason or "Error",
             "startedAt": st.started_at, "finishedAt": st.finished_at, "containerID": f"local://{st.pid or 0}"}
        if st.message:
            d["message"] = st.message
        return d

    def _replica_statuses(self, job: dict, specs: dict, pods: dict) -> dict:
        name = job["metadata"]["name"]
        out = {}
        for rtype in specs:
            active = succeeded = failed = 0
            for p in pods.values():
                if p["metadata"].get("labels", {}).get(L_TYPE) != rtype.lower():
                    continue
                phase = (p.get("status") or {}).get("phase")
                if phase == "Running":
                    active += 1
                elif phase == "Succeeded":
                    succeeded += 1
                elif phase == "Failed":
                    failed += 1
            out[rtype] = {"active": active, "succeeded": succeeded, "failed": failed,
                          "selector": self._selector(name, rtype)}
        return out

    def _clean(self, job: dict, pods: dict, policy: str) -> None:
        if policy == "None":
            return
        pods_t = self.store.types[("", "pods")]
        for pname, p in pods.items():
            phase = (p.get("status") or {}).get("phase")
            if policy == "All" or phase in ("Running", "Pending", None):
                try:
                    self.store.delete(pods_t, job["metadata"]["namespace"], pname)
                except ApiError:
                    pass
        # Services go with the pods whatever the policy (the operator's DeletePodsAndServices).
        svcs = self.store.types[("", "services")]
        for s in self.store.list(svcs, job["metadata"]["namespace"], f"{L_JOB}={job['metadata']['name']}")[0]:
            if any(r.get("uid") == job["metadata"]["uid"] for r in s["metadata"].get("ownerReferences") or ()):
                try:
                    self.store.delete(svcs, job["metadata"]["namespace"], s["metadata"]["name"])
                except ApiError:
                    pass

    # ------------------------------------------------------------------ writes

    def _write_status(self, t: ResourceType, job: dict, old: dict, new: dict) -> None:
        if new == old:
            return
        new["lastReconcileTime"] = now_iso()
        md = job["metadata"]

        def setter(o: dict) -> None:
            o["status"] = new

        self.store.mutate(t, md["namespace"], md["name"], setter, subresource="status" if t.status_subresource else None)

    def _event(self, job: dict, etype: str, reason: str, message: str) -> None:
        md = job["metadata"]
        t = now_iso()
        try:
            self.store.create(self.store.types[("", "events")], md["namespace"], {
                "metadata": {"name": f"{md['name']}.{_secrets.token_hex(8)}", "namespace": md["namespace"]},
                "involvedObject": {"apiVersion": "kubeflow.org/v1", "kind": KIND, "name": md["name"],
                                   "namespace": md["namespace"], "uid": md["uid"]},
                "reason": reason, "message": message, "type": etype, "count": 1,
                "firstTimestamp": t, "lastTimestamp": t, "source": {"component": OPERATOR_NAME},
                "reportingComponent": OPERATOR_NAME,
            })
        except ApiError:
            pass


def _age(iso: str) -> float:
    import datetime as dt

    t = dt.datetime.strptime(iso, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    return (dt.datetime.now(dt.timezone.utc) - t).total_seconds()
