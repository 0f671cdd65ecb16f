"""A topology change through the resource (issue 20 item 3): `kubectl patch` of spec.topology (DP 2 -> 1) on a running
mixture reshards it. The operator sends RESHARD with an id (no cursor: the planner takes the first step it has not
planned), records the step in status.topology, then renders the new world: the constructor StatefulSet resized and
its pods replaced (they read the new spec), the new world's trainer key in the Secret. The planner is never
restarted. The new world's trainer resumes from the old world's state_dict and gets, batch for batch, what an
embedded run that resharded at that step (EmbeddedRuntime.reshard) delivers; the old world's batches equal that
run's too. The longest trainer stall (the old world's last batch to the new world's first) is measured and printed.

No kubelet: a thread here plays it for the loader Deployments, the constructor StatefulSet (its replicas and its pod
template: a pod whose template changed is replaced, a container that exits is restarted after a second, reading
the spec as it is then) and the projected key volumes of running pods (refreshed every sync, as a kubelet does).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time

import pytest

from mixplane.client import MixtureLoader
from mixplane.runtime import EmbeddedRuntime
from mixplane.spec import parse_spec
from mixplane.wire import CurveSetup
from tests.k8s.helpers import LocalPods, applied, apply, get, operator, status_of, trainer_keys, wait_for
from tests.k8s.test_scaling import digest
from tests.unit.operator_testdata import write_text_and_images

pytestmark = pytest.mark.timeout(900)
MIB = 1 << 20
STEPS, K = 40, 14  # the old world (DP 2) trains steps 0..K-1; the new world (DP 1) resumes at K
SPEC_HASH = "mixplane.io/spec-hash"
RANDOM_KILLS = int(os.environ.get("MIXPLANE_TOPOLOGY_KILLS", "12"))  # operator-killed-random: operators SIGKILLed


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_text_and_images(tmp_path_factory.mktemp("topology-data"), text_rows=1500, images=4, side=64)


def topology_mixture(ns, data, dp):
    prof = {"version": 1, "sources": {"web": {"cpu_s_per_token": 1.5e-6, "memory_per_partition": 40 * MIB},
                                      "code": {"cpu_s_per_token": 6e-6, "memory_per_partition": 40 * MIB}}}
    return {
        "apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
        "metadata": {"name": "demo", "namespace": ns,
                     "annotations": {"mixplane.io/tokens-per-second": "30000", "mixplane.io/profile": json.dumps(prof),
                                     "mixplane.io/scale-on": "declared"}},
        "spec": {
            "sources": [{"name": "web", "uri": data["text"], "tokenizer": data["tokenizer"]},
                        {"name": "code", "uri": data["text"], "tokenizer": data["tokenizer"]}],
            "mixture": {"weights": {"web": 0.6, "code": 0.4}, "seed": 13},
            "batch": {"sequences": 4, "seq_len": 128},
            "topology": {"modules": {"backbone": {"dp": dp}}},
            "strategy": {"name": "vanilla"},
            "runtime": {"window": 16, "max_lead_steps": 4},
            "kubernetes": {"journal_mb": 0},
        },
    }


class Kubelet(threading.Thread):
    """Runs the mixture's loader Deployments and constructor StatefulSet as local processes (see the module doc)."""

    def __init__(self, cluster, ns, pods: LocalPods, planner_host: str):
        super().__init__(daemon=True)
        self.cluster, self.ns, self.pods, self.planner_host = cluster, ns, pods, planner_host
        self.running: dict[str, tuple[str, dict]] = {}  # pod -> (its template's spec hash, template)
        self.exited_at: dict[str, float] = {}
        self.events: list[str] = []
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def proc(self, pod: str):
        return next((p for n, p in reversed(self.pods.procs) if n == pod), None)

    def run_pod(self, pod: str, tmpl: dict) -> None:
        self.pods.start(pod, tmpl, self.planner_host)
        self.running[pod] = (tmpl["metadata"]["annotations"].get(SPEC_HASH, ""), tmpl)

    def sync(self) -> None:
        want: dict[str, dict] = {}
        for d in get(self.cluster, "deployments", "-n", self.ns, "-l", "mixplane.io/instance=demo,mixplane.io/role=loader")["items"]:
            if d["spec"].get("replicas", 1):
                want[f"{d['metadata']['name']}-0"] = d["spec"]["template"]
        sts = get(self.cluster, "statefulset", "demo-constructor", "-n", self.ns)
        for i in range(sts["spec"]["replicas"]):
            want[f"demo-constructor-{i}"] = sts["spec"]["template"]
        for pod in sorted(set(self.running) - set(want)):  # scaled down or deleted
            self.pods.stop_pod(pod)
            del self.running[pod]
            self.events.append(f"deleted {pod}")
        now = time.monotonic()
        for pod, tmpl in want.items():
            h = tmpl["metadata"]["annotations"].get(SPEC_HASH, "")
            if pod not in self.running:
                self.run_pod(pod, tmpl)
                self.events.append(f"created {pod}")
            elif self.running[pod][0] != h:  # a new pod template: the controller replaces the pod
                self.pods.stop_pod(pod)
                self.run_pod(pod, tmpl)
                self.events.append(f"replaced {pod}")
            elif (p := self.proc(pod)) is not None and p.poll() is not None:  # the container exited: restarted
                since = self.exited_at.setdefault(pod, now)
                if now - since >= 1.0:
                    self.exited_at.pop(pod)
                    self.run_pod(pod, tmpl)
                    self.events.append(f"restarted {pod} (exit {p.returncode})")
        # projected key volumes follow their Secrets (the new world's trainer keys reach running components)
        for pod, (_, tmpl) in [*self.running.items(), ("demo-planner-0", (None, self.planner_template))]:
            for v in tmpl["spec"]["volumes"]:
                if "projected" in v and (self.pods.workdir / pod / v["name"]).is_dir():
                    self.pods.write_projected(self.pods.workdir / pod / v["name"], v["projected"])

    planner_template: dict = {}

    def run(self) -> None:
        try:
            while not self.stop_flag.wait(0.3):
                self.sync()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def train(planner: str, keys, world: int, stop: int, *, state: dict | None = None, pause_s: float = 0.15,
          timeout: float = 300.0) -> tuple[dict[int, dict[int, str]], dict[int, dict], dict[int, list[float]]]:
    """`world` ranks (threads) from `state` (a state_dict) to step `stop`: their batches' digests by step, their
    state_dicts at the end, and the time each batch arrived."""
    got: dict[int, dict[int, str]] = {r: {} for r in range(world)}
    states: dict[int, dict] = {}
    times: dict[int, list[float]] = {r: [] for r in range(world)}
    errors: list[BaseException] = []

    def work(r: int) -> None:
        try:
            loader = MixtureLoader(planner, rank=r, world_size=world, max_steps=stop, timeout_s=timeout / 2,
                                   curve=CurveSetup.from_dir(*keys[r]))
            if state is not None:
                loader.load_state_dict(state)
            for b in loader:
                times[r].append(time.monotonic())
                got[r][int(b["step"])] = digest(b)
                time.sleep(pause_s)  # a trainer's step
            states[r] = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint holds it
            loader.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        raise AssertionError(f"trainer failed: {errors[0]!r}")
    assert not any(t.is_alive() for t in threads), "a trainer did not finish"
    return got, states, times


@pytest.mark.parametrize("cuts", [(), ("reshard", "after-reshard"), ("random",)],
                         ids=["calm", "operator-killed", "operator-killed-random"])
def test_kubectl_patch_of_the_topology_reshards_the_running_mixture(crd, k8s_namespace, data, tmp_path, cuts):
    """`cuts`: the operator is SIGKILLed at these points of the change before one is left alone -- before the RESHARD
    is sent, and after the planner acknowledged it but before the status says so: the change is applied once.
    `random`: RANDOM_KILLS operators one after the other, each SIGKILLed before a random mutating API call (1..3 or
    1..14: a pass that applies every child makes ~14) or, one in five, from outside at a random time."""
    cluster, ns = crd, k8s_namespace
    pods = LocalPods(cluster, ns, tmp_path / "pods")
    (tmp_path / "pods").mkdir()
    planner_host = f"demo-planner.{ns}.svc:7000"
    endpoint = f"tcp://127.0.0.1:{pods.planner_port}"
    env = {"MIXPLANE_OPERATOR_PLANNER": endpoint, "MIXPLANE_SCALE_INTERVAL_S": "1", "MIXPLANE_RECONCILE_INTERVAL_S": "0.5"}
    kubelet = None
    kills: list[str] = []
    stack = contextlib.ExitStack()
    with stack:
        op = stack.enter_context(operator(cluster, ns, **env))
        try:
            apply(cluster, topology_mixture(ns, data, 2))
            kids = applied(cluster, ns)
            assert kids[("StatefulSet", "demo-constructor")]["spec"]["replicas"] == 2  # one per DP group
            planner_tmpl = kids[("Deployment", "demo-planner")]["spec"]["template"]
            spec_json = get(cluster, "configmap", "demo-spec", "-n", ns)["data"]["spec.json"]
            (planner,) = pods.start("demo-planner-0", planner_tmpl, planner_host)
            kubelet = Kubelet(cluster, ns, pods, planner_host)
            kubelet.planner_template = planner_tmpl
            kubelet.sync()
            kubelet.start()

            # the old world: DP 2 in one trainer pod (key client-r0-1), steps 0..K-1, a checkpoint after each
            old, states, old_times = train(endpoint, trainer_keys(cluster, ns, tmp_path / "keys-old"), 2, K)
            # the job stops at its checkpoint and is re-scaled: the patch of the resource
            t_stop = max(t[-1] for t in old_times.values())
            cluster.kubectl("patch", "datamixture", "demo", "-n", ns, "--type", "merge",
                            "-p", json.dumps({"spec": {"topology": {"modules": {"backbone": {"dp": 1}}}}}))
            t_patch = time.monotonic()
            if cuts == ("random",):
                stack.close()  # the calm operator goes; operators killed at random points follow
                rng = random.Random(20261127)
                while len(kills) < RANDOM_KILLS:
                    outside = rng.random() < 0.2
                    # half of them within a pass's first 3 calls: with the served world's children applied already,
                    # the RESHARD goes out at about the second mutating call (status intent, RESHARD, status)
                    n = rng.randint(1, 3) if rng.random() < 0.5 else rng.randint(1, 14)
                    extra = {} if outside else {"MIXPLANE_OPERATOR_KILL_AFTER_CALLS": str(n)}
                    with operator(cluster, ns, **env, **extra) as cut:
                        deadline = time.monotonic() + (rng.uniform(0.5, 4.0) if outside else 40.0)
                        while cut.poll() is None and time.monotonic() < deadline:
                            time.sleep(0.05)
                        if cut.poll() is None:
                            cut.send_signal(signal.SIGKILL)
                            cut.wait(10)
                            kills.append("outside")
                        else:
                            assert cut.returncode == -signal.SIGKILL, cut.log_text()[-3000:]
                            line = [x for x in cut.log_text().splitlines() if "fault point" in x]
                            kills.append(line[-1].split("(", 1)[-1].rstrip(")").split(" ")[0] if line else "?")
                        kills[-1] += "/acknowledged" if (status_of(cluster, ns).get("topology") or {}).get("worldSize") == 1 \
                            and status_of(cluster, ns)["topology"].get("state") == "Acknowledged" else "/pending"
                op = stack.enter_context(operator(cluster, ns, **env))
            elif cuts:
                stack.close()  # the calm operator goes; each of these is killed at its cut
                for at in cuts:
                    with operator(cluster, ns, **env, MIXPLANE_OPERATOR_KILL_AT=at) as cut:
                        wait_for(f"the cut at {at}", lambda cut=cut: cut.poll() is not None, 60)
                        assert cut.returncode == -signal.SIGKILL, cut.log_text()[-3000:]
                        assert "fault point: SIGKILL before mutating call" in cut.log_text() and f"({at}" in cut.log_text()
                        kills.append(at)
                op = stack.enter_context(operator(cluster, ns, **env))
            st = wait_for("the reshard's acknowledgment", lambda: (lambda s: s if (s.get("topology") or {}).get("state")
                                                                  == "Acknowledged" and s["topology"].get("worldSize") == 1
                                                                  else None)(status_of(cluster, ns)), 60, every=0.05)
            t_ack = time.monotonic()
            # the new world's trainer pod key is in the Secret (the pod webhook mounts it; issued while pending)
            secret = wait_for("the new world's key", lambda: (lambda d: d if "client-r0-0.key_secret" in d else None)(
                get(cluster, "secret", "demo-keys", "-n", ns)["data"]), 30)
            assert "client-r0-0.key_secret" in secret and "client-r0-0.key" in get(
                cluster, "secret", "demo-trainer-keys", "-n", ns)["data"]
            # and the old world's key goes from both Secrets once the change is acknowledged
            wait_for("the old world's key to go", lambda: not [
                n for sec in ("demo-keys", "demo-trainer-keys")
                for n in get(cluster, "secret", sec, "-n", ns)["data"] if n.startswith("client-r0-1.")], 30)
            new, _, new_times = train(endpoint, trainer_keys(cluster, ns, tmp_path / "keys-new"), 1, STEPS, state=states[0])
            assert kubelet.error is None, kubelet.error
            final = status_of(cluster, ns)
            sts = get(cluster, "statefulset", "demo-constructor", "-n", ns)
            deployed_planner = get(cluster, "deployment", "demo-planner", "-n", ns)["spec"]["template"]
            planner_log = (tmp_path / "pods" / "demo-planner-0.planner.log").read_text()
            oplog = op.log_text()
        except AssertionError as e:
            raise AssertionError(f"{e}\nkubelet: {kubelet.events if kubelet else None}\n{pods.logs(1500)}\n"
                                 f"operator: {op.log_text()[-3000:]}") from None
        finally:
            if kubelet is not None:
                kubelet.stop_flag.set()
                kubelet.join(10)
            planner_alive = pods.procs[0][1].poll() is None
            pods.stop()

    stall = min(new_times[0]) - t_stop
    print(f"{'operator killed at ' + ', '.join(kills) + ': ' if cuts else ''}topology change dp 2 -> 1: longest trainer stall {stall:.2f} s (old world's last batch -> new world's "
          f"first batch; patch -> status.topology Acknowledged {t_ack - t_patch:.2f} s, acknowledged -> first batch "
          f"{min(new_times[0]) - t_ack:.2f} s); reshard step {st['topology']['effectiveStep']}, the new world resumed at "
          f"step {K}; kubelet: {kubelet.events}")
    # the status says from which step the new world is served, once
    topo = final["topology"]
    assert topo["state"] == "Acknowledged" and topo["worldSize"] == 1 and topo["effectiveStep"] >= K, topo
    assert [c["effectiveStep"] for c in final["topologyChanges"]] == [topo["effectiveStep"]]
    assert {c["type"]: c["status"] for c in final["conditions"]}["TopologyApplied"] == "True"
    assert "was" not in topo and "initial" not in topo
    if not cuts:
        assert f"world of 1 ranks from step {topo['effectiveStep']}" in oplog
    elif cuts == ("random",):
        assert len(kills) == RANDOM_KILLS, kills
    else:  # sent once before the kill after the acknowledgment; the operator left alone observed it in STATUS
        assert kills == list(cuts) and "world of 1 ranks from step" not in oplog  # observed in STATUS: not sent again
    assert planner_log.count("resharded at step") == 1  # the planner applied it once
    # the constructors were resized and replaced; the planner never restarted (same process, same pod template)
    assert sts["spec"]["replicas"] == 1
    assert "deleted demo-constructor-1" in kubelet.events and "replaced demo-constructor-0" in kubelet.events
    assert planner_alive and planner.pid == pods.procs[0][1].pid
    assert deployed_planner["metadata"]["annotations"][SPEC_HASH] == planner_tmpl["metadata"]["annotations"][SPEC_HASH]
    assert f"resharded at step {topo['effectiveStep']}" in planner_log and f"reshard {topo['reshardId']}" in planner_log

    # the reference: the same resolved spec in an embedded run, DP 2 to step K, resharded there to DP 1
    # (EmbeddedRuntime.reshard with the state at K), the new rank resuming from it
    ref_spec = parse_spec(json.loads(spec_json))
    with EmbeddedRuntime(ref_spec, tmp_path / "reference") as rt:
        keys = {r: (rt.key_dir, f"client-r{r}") for r in range(2)}
        ref_old, ref_states, _ = train(rt.planner_endpoint, keys, 2, K, pause_s=0.0)
        rt.reshard({"modules": {"backbone": {"dp": 1}}}, ref_states[0], attempt="reference")
        ref_new, _, _ = train(rt.planner_endpoint, {0: (rt.key_dir, "client-r0")}, 1, STEPS, state=ref_states[0],
                              pause_s=0.0)
    for r in (0, 1):
        assert sorted(old[r]) == list(range(K))
        diff = [s for s in range(K) if old[r][s] != ref_old[r][s]]
        assert not diff, f"old world rank {r}: steps {diff} differ from the embedded run"
    assert sorted(new[0]) == list(range(K, STEPS))
    diff = [s for s in range(K, STEPS) if new[0][s] != ref_new[0][s]]
    assert not diff, f"new world: steps {diff} differ from the embedded run that resharded at step {K}"
