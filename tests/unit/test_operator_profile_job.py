"""Profiling in the cluster: the Job that runs `mixplane profile` with the loaders' image and credentials, the result it
hands back in its termination message, and how the operator reads that back (pending, done, failed)."""

from __future__ import annotations

import json

import pytest
import yaml

from mixplane.cli import main
from mixplane.operator.builders import (
    ANN_PROFILE_SOURCES,
    LABEL_MIXTURE,
    LABEL_PROFILE,
    TERMINATION_LOG,
    ClusterOptions,
    profile_children,
    profile_shards,
)
from mixplane.operator.annotations import annotations_of
from mixplane.operator.reconcile import (
    ReconcileError,
    fallback_profile,
    job_outcome,
    profile_from_status,
    profile_outcome,
    spec_of,
)
from mixplane.profile import (
    TERMINATION_LIMIT,
    error_message,
    parse_message,
    profile_spec,
    termination_message,
)
from mixplane.spec import parse_spec

from .operator_testdata import text_image_mixture, write_text_and_images

OPTS = ClusterOptions(name="demo", namespace="ml", image="mixplane:1.2")


def body(sources: int = 2, secret: str | None = "s3-creds", **ann: str) -> dict:
    return {"apiVersion": "mixplane.io/v1alpha1", "kind": "DataMixture",
            "metadata": {"name": "demo", "namespace": "ml", "uid": "u-1", "generation": 1, "annotations": dict(ann)},
            "spec": {"sources": [{"name": f"src-{i:03d}", "uri": f"s3://b/s{i}/*.parquet", "kind": "tokens", "columns": ["ids"]}
                                 for i in range(sources)],
                     "mixture": {"weights": {f"src-{i:03d}": 1.0 for i in range(sources)}},
                     "batch": {"sequences": 4, "seq_len": 128}, "topology": {"modules": {"backbone": {"dp": 2}}},
                     "kubernetes": {"source_secret": secret} if secret else {}}}


def jobs_of(objs):
    return [o for o in objs if o["kind"] == "Job"]


def test_the_job_runs_profile_with_the_loaders_image_and_credentials_and_nothing_else():
    objs = profile_children(spec_of(body()), OPTS)
    kinds = [o["kind"] for o in objs]
    assert kinds == ["ServiceAccount", "ConfigMap", "Job"]
    (job,) = jobs_of(objs)
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "mixplane:1.2" and c["command"] == ["mixplane"]
    assert c["args"] == ["profile", "/etc/mixplane/spec/spec.json", "--sources", "src-000,src-001", "--termination-log", TERMINATION_LOG]
    assert c["terminationMessagePath"] == TERMINATION_LOG and c["terminationMessagePolicy"] == "File"
    assert c["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]  # the storage credentials, as loaders get them
    # the pod holds no API token and no CURVE key: only the spec and a scratch dir
    assert pod["automountServiceAccountToken"] is False and pod["serviceAccountName"] == "demo-mixplane"
    assert {v["name"] for v in pod["volumes"]} == {"spec", "tmp"} and "secret" not in json.dumps(pod["volumes"])
    assert pod["restartPolicy"] == "Never" and job["spec"]["backoffLimit"] == 1 and job["spec"]["activeDeadlineSeconds"] > 0
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"] and c["resources"]["limits"]["cpu"]
    # not a component: no NetworkPolicy of the mixture admits it to the planner or the constructors
    assert LABEL_MIXTURE not in pod.get("metadata", {}).get("labels", {}) and LABEL_MIXTURE not in job["spec"]["template"]["metadata"]["labels"]
    assert job["spec"]["template"]["metadata"]["labels"][LABEL_PROFILE] == "demo"
    cm = objs[1]
    assert pod["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert json.loads(cm["data"]["spec.json"])["kubernetes"]["source_secret"] == "s3-creds"  # a name, never a key


def test_the_job_is_the_same_for_the_same_spec_and_new_when_sources_or_image_change():
    a = profile_children(spec_of(body()), OPTS)
    assert a == profile_children(spec_of(body()), OPTS)  # a restarted operator re-applies the same objects
    other = body()
    other["spec"]["sources"][0]["uri"] = "s3://b/elsewhere/*.parquet"
    b = profile_children(spec_of(other), OPTS)
    c = profile_children(spec_of(body()), ClusterOptions(name="demo", namespace="ml", image="mixplane:1.3"))
    names = {tuple(o["metadata"]["name"] for o in x[1:]) for x in (a, b, c)}
    assert len(names) == 3
    w = body()
    w["spec"]["mixture"]["weights"]["src-000"] = 3.0  # weights do not change what a source costs: the same Job
    assert jobs_of(profile_children(spec_of(w), OPTS)) == jobs_of(a)


def test_hundreds_of_sources_are_split_so_every_result_fits_a_termination_message():
    spec = spec_of(body(300))
    jobs = jobs_of(profile_children(spec, OPTS))
    assert len(jobs) > 1 and len({j["metadata"]["name"] for j in jobs}) == len(jobs)
    covered = [n for j in jobs for n in j["metadata"]["annotations"][ANN_PROFILE_SOURCES].split(",")]
    assert covered == [s.name for s in spec.sources]
    for j in jobs:
        assert len(j["metadata"]["name"]) <= 63
        names = j["metadata"]["annotations"][ANN_PROFILE_SOURCES].split(",")
        # the widest figures each source can have still fit
        widest = {"version": 1, "sources": {n: {"cpu_s_per_token": -1.23456789e-100, "memory_per_partition": (1 << 63) - 1,
                                                "max_partitions": (1 << 63) - 1, "mean_tokens_per_sample": 123456.789e200}
                                            for n in names}}
        assert len(termination_message(widest)) <= TERMINATION_LIMIT
    long = ["x" * 40 + f"{i}" for i in range(100)]
    assert all(len(s) >= 1 for s in profile_shards(long, TERMINATION_LIMIT))


def test_termination_message_is_a_slim_profile_and_too_many_sources_are_refused():
    prof = {"version": 1, "sources": {"a": {"cpu_s_per_token": 1.234567891e-6, "memory_per_partition": 41943040, "max_partitions": 12,
                                            "mean_tokens_per_sample": 511.123456, "rows": 5, "kind": "text"}}}
    msg = termination_message(prof)
    doc = parse_message(msg)
    assert doc["sources"]["a"] == {"cpu_s_per_token": 1.23457e-6, "memory_per_partition": 41943040, "max_partitions": 12,
                                   "mean_tokens_per_sample": 511.123}
    many = {"version": 1, "sources": {f"s{i}": prof["sources"]["a"] for i in range(200)}}
    with pytest.raises(ValueError, match="4096"):
        termination_message(many)


def test_errors_are_redacted_and_cut_to_fit():
    env = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG", "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "HF_TOKEN": "hf_abcdef",
           "PATH": "/usr/bin"}
    text = "access denied for AKIAEXAMPLE signing with wJalrXUtnFEMI/K7MDENG and hf_abcdef in /usr/bin " + "x" * 9000
    msg = error_message(text, env)
    assert len(msg) <= TERMINATION_LIMIT
    err = parse_message(msg)["error"]
    assert "wJalrXUtnFEMI" not in err and "AKIAEXAMPLE" not in err and "hf_abcdef" not in err
    assert err.startswith("access denied for *** signing with *** and *** in /usr/bin") and err.endswith("...")
    for bad in ("", "{", '{"version": 2}', '{"version": 1, "sources": {"a": {"cpu_s_per_token": 1}}}',
                '{"version": 1, "sources": {"a": {"cpu_s_per_token": -1, "memory_per_partition": 1, "max_partitions": 1, "mean_tokens_per_sample": 1}}}'):
        with pytest.raises(ValueError):
            parse_message(bad)


def pod(name: str, exit_code: int | None, message: str = "", reason: str = "Completed") -> dict:
    st: dict = {"phase": "Pending"}
    if exit_code is not None:
        st = {"phase": "Succeeded" if exit_code == 0 else "Failed",
              "containerStatuses": [{"name": "profile", "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message}}}]}
    return {"metadata": {"name": name}, "status": st}


def job(name: str, failed: str | None = None) -> dict:
    conds = [{"type": "Failed", "status": "True", "reason": failed, "message": "Job has reached the specified backoff limit"}] if failed else []
    return {"metadata": {"name": name}, "status": {"conditions": conds}}


GOOD = termination_message({"version": 1, "sources": {
    "src-000": {"cpu_s_per_token": 2e-6, "memory_per_partition": 50 << 20, "max_partitions": 8, "mean_tokens_per_sample": 300.0},
    "src-001": {"cpu_s_per_token": 3e-6, "memory_per_partition": 60 << 20, "max_partitions": 4, "mean_tokens_per_sample": 200.0}}})


def test_a_succeeded_pod_gives_the_profile_the_status_keeps():
    names = ["src-000", "src-001"]
    assert job_outcome(job("j"), [pod("j-a", None)], names).state == "pending"
    out = job_outcome(job("j"), [pod("j-a", 1, error_message("boom", {})), pod("j-b", 0, GOOD)], names)  # the retry succeeded
    assert out.state == "done" and out.profile["sources"]["src-001"]["cpu_s_per_token"] == 3e-6
    assert all(p["measured_by"] == "job" for p in out.profile["sources"].values())
    spec = spec_of(body())
    total = profile_outcome(spec, [(job("j"), [pod("j-b", 0, GOOD)], names)])
    assert total.state == "done" and not any(p.get("source") == "fallback" for p in total.profile["sources"].values())
    # kept in the status (as status_of writes it), it comes back: a restart does not profile again
    from mixplane.operator.reconcile import desired, status_of
    from tests.unit.operator_testdata import FakeKeys

    keys = FakeKeys({r: ("p" * 40, "s" * 40) for r in ("server", "component", "client", "admin")})
    b = body(**{"mixplane.io/tokens-per-second": "20000"})
    d = desired(b, OPTS, total.profile, keys)
    st = status_of(b, d, OPTS, total.profile, ready=False, progressing=(True, "RollingOut", "x"), degraded=(False, "AsPlanned", ""))
    assert {s["name"]: s["profile"]["measuredBy"] for s in st["sources"]} == {"src-000": "job", "src-001": "job"}
    kept = profile_from_status({**b, "status": st})
    assert kept["sources"]["src-000"]["max_partitions"] == 8 and kept["sources"]["src-000"]["cpu_s_per_token"] == 2e-6


def test_a_jobs_profile_carries_the_files_listed_so_the_status_keeps_a_block_read_sources_profile():
    """The termination message carries files_listed (what tells a kept profile's max_partitions counts blocks where the
    source is read block by block: reconcile.profile_from_status): a Job's profile of many pages comes back from
    the status; without the count (an older image's message) it would be measured again."""
    from mixplane.operator.reconcile import desired, status_of
    from tests.unit.operator_testdata import FakeKeys

    names = ["src-000", "src-001"]
    prof = {"version": 1, "sources": {n: {"cpu_s_per_token": 2e-6, "memory_per_partition": 50 << 20, "max_partitions": 196,
                                          "mean_tokens_per_sample": 300.0, "files_listed": 50_000} for n in names}}
    msg = termination_message(prof)
    assert parse_message(msg)["sources"]["src-000"]["files_listed"] == 50_000
    for bad in (0, "many"):
        broken = json.loads(msg)
        broken["sources"]["src-001"]["files_listed"] = bad
        with pytest.raises(ValueError, match="sources.src-001: figures out of range"):
            parse_message(json.dumps(broken))
    out = profile_outcome(spec_of(body()), [(job("j"), [pod("j-a", 0, msg)], names)])
    assert out.state == "done"
    keys = FakeKeys({r: ("p" * 40, "s" * 40) for r in ("server", "component", "client", "admin")})
    b = body(**{"mixplane.io/tokens-per-second": "20000"})
    st = status_of(b, desired(b, OPTS, out.profile, keys), OPTS, out.profile, ready=False,
                   progressing=(True, "RollingOut", "x"), degraded=(False, "AsPlanned", ""))
    assert {s["profile"]["filesListed"] for s in st["sources"]} == {50_000}
    assert profile_from_status({**b, "status": st})["sources"]["src-001"]["max_partitions"] == 196
    for s in st["sources"]:
        del s["profile"]["filesListed"]
    assert profile_from_status({**b, "status": st}) is None


def test_a_failed_job_says_why_and_falls_back_for_its_sources_only():
    spec = spec_of(body(3))
    ok = termination_message({"version": 1, "sources": {"src-000": {"cpu_s_per_token": 2e-6, "memory_per_partition": 1 << 20,
                                                                    "max_partitions": 2, "mean_tokens_per_sample": 10.0}}})
    err = error_message("OSError: access denied for key AKIAX", {"AWS_ACCESS_KEY_ID": "AKIAX"})
    out = profile_outcome(spec, [(job("j0"), [pod("j0-a", 0, ok)], ["src-000"]),
                                 (job("j1", "BackoffLimitExceeded"), [pod("j1-a", 1, err), pod("j1-b", 1, err)], ["src-001", "src-002"])])
    assert out.state == "failed"
    assert "j1" in out.message and "BackoffLimitExceeded" in out.message and "access denied for key ***" in out.message
    assert "AKIAX" not in out.message
    assert out.profile["sources"]["src-000"]["measured_by"] == "job"
    assert out.profile["sources"]["src-001"]["source"] == "fallback" and out.profile["sources"]["src-002"]["source"] == "fallback"
    # a pod killed before it wrote anything, and a Job past its deadline with no pod at all
    oom = profile_outcome(spec_of(body(1)), [(job("j", "BackoffLimitExceeded"), [pod("j-a", 137, "", "OOMKilled")], ["src-000"])])
    assert "OOMKilled (exit code 137)" in oom.message
    late = profile_outcome(spec_of(body(1)), [(job("j", "DeadlineExceeded"), [], ["src-000"])])
    assert late.state == "failed" and "DeadlineExceeded" in late.message
    # one Job still running: the mixture waits for it
    assert profile_outcome(spec, [(job("j0"), [pod("j0-a", 0, ok)], ["src-000"]), (job("j1"), [], ["src-001"])]).state == "pending"
    assert profile_outcome(spec, [(None, [], ["src-000"])]).state == "pending"
    # a pod that exited 0 with a profile of other sources is not taken
    assert job_outcome(job("j"), [pod("j-a", 0, GOOD)], ["src-000"]).state == "failed"


def test_where_sources_are_profiled():
    assert annotations_of(body()).profiler_for(spec_of(body())) == "job"  # the loaders' credentials are a Secret: never in-process
    b = body(secret=None)
    assert annotations_of(b).profiler_for(spec_of(b)) == "auto"
    b = body(secret=None, **{"mixplane.io/profiler": "job"})
    assert annotations_of(b).profiler_for(spec_of(b)) == "job"
    b = body(**{"mixplane.io/profiler": "operator"})
    assert annotations_of(b).profiler_for(spec_of(b)) == "operator"
    b = body(**{"mixplane.io/profiler": "pod"})
    with pytest.raises(ReconcileError, match="mixplane.io/profiler"):
        annotations_of(b).profiler_for(spec_of(b))
    assert all(p["measured_by"] == "fallback" for p in fallback_profile(spec_of(body()))["sources"].values())
    # costs by kind in the status are never taken as a kept profile, whatever the conditions say now
    b = body()
    st = {"sources": [{"name": n, "profile": {"cpuSecondsPerToken": 2e-7, "memoryPerPartition": 1, "measuredBy": m,
                                              "filesListed": 3}}
                      for n, m in (("src-000", "job"), ("src-001", "fallback"))], "conditions": []}
    assert profile_from_status({**b, "status": st}) is None
    st["sources"][1]["profile"]["measuredBy"] = "job"
    assert profile_from_status({**b, "status": st}) is not None


def test_cli_writes_the_termination_message_of_the_sources_asked(tmp_path, capsys):
    paths = write_text_and_images(tmp_path / "d", images=4, side=64)
    doc = text_image_mixture(paths)
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump(doc))
    log = tmp_path / "termination-log"
    assert main(["profile", str(tmp_path / "mix.yaml"), "--max-rows", "16", "--sources", "pairs", "--termination-log", str(log)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed["sources"]) == {"pairs"} and "rows" in printed["sources"]["pairs"]  # the full profile in the log
    got = parse_message(log.read_text())
    assert set(got["sources"]) == {"pairs"}
    assert got["sources"]["pairs"]["cpu_s_per_token"] == pytest.approx(printed["sources"]["pairs"]["cpu_s_per_token"], rel=1e-5)
    # a failure is written for the operator too, without the credentials of the environment
    assert main(["profile", str(tmp_path / "mix.yaml"), "--sources", "nope", "--termination-log", str(log)]) == 1
    assert "no source named nope" in parse_message(log.read_text())["error"]
    doc["sources"][0]["uri"] = str(tmp_path / "missing" / "*.parquet")  # an invalid spec: exit 2, and the operator hears of it
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    assert main(["profile", str(tmp_path / "bad.yaml"), "--termination-log", str(log)]) == 2
    assert "sources[0]" in parse_message(log.read_text())["error"]  # the spec's problem, named
    with pytest.raises(ValueError, match="no source named"):
        profile_spec(parse_spec(text_image_mixture(paths)), ["nope"])


def test_profiling_needs_no_trainer_pod_keys():
    """A mixture whose rank keys cannot be issued (rank_binding: required, 3 trainer pods for 2 ranks) is refused by
    reconcile's key step with a ReconcileError; building its profiling Jobs must not raise a bare ValueError first."""
    from mixplane.operator.builders import pod_rank_keys
    from mixplane.operator.reconcile import spec_of

    b = body()
    b["spec"]["runtime"] = {"rank_binding": "required"}
    b["spec"]["kubernetes"]["trainer_pods"] = 3
    spec = spec_of(b)
    with pytest.raises(ValueError, match="one block per pod"):
        pod_rank_keys(spec)
    objs = profile_children(spec, OPTS)
    assert len(jobs_of(objs)) == 1 and jobs_of(objs)[0]["spec"]["template"]["spec"]["containers"][0]["envFrom"] == \
        [{"secretRef": {"name": "s3-creds"}}]
