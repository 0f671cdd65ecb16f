"""Profiling a mixture's sources for the operator: the figures kept in the status, the annotation's, measured in
the operator's process, or by profiling Jobs with the loaders' image and credentials (a shell: it reads and
applies Jobs; what their pods' termination messages mean is decided by `reconcile.profile_outcome`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mixplane.operator.builders import ClusterOptions, owner_reference
from mixplane.operator.kube import Kube
from mixplane.operator.annotations import MixtureAnnotations, annotations_of
from mixplane.operator.reconcile import fallback_profile, profile_from_status


@dataclass(frozen=True)
class Profiled:
    """A profile to plan with, or (profile None) profiling Jobs still running; `jobs`: the status.profiling entry."""

    profile: dict[str, Any] | None
    jobs: dict[str, Any] | None = None
    failure: str = ""


def adopt(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    """`obj` controlled by the DataMixture `owner` (deleting the mixture deletes it), in its namespace, with its labels."""
    md = obj.setdefault("metadata", {})
    md["namespace"] = owner["metadata"]["namespace"]
    ref = owner_reference(owner)
    refs = [r for r in md.get("ownerReferences") or [] if r.get("uid") != ref["uid"]]
    md["ownerReferences"] = [*refs, ref]
    labels = dict((owner.get("metadata") or {}).get("labels") or {})
    labels.update(md.get("labels") or {})
    if labels:
        md["labels"] = labels
    return obj


def profile_for(k: Kube, body: Mapping[str, Any], spec: Any, opts: ClusterOptions, logger: Any,
                annotations: MixtureAnnotations | None = None) -> Profiled:
    """Kept profile, else the annotation's, else measured in-process or by profiling Jobs
    (`MixtureAnnotations.profiler_for`), else fallback costs (the Jobs failed, or in-process profiling failed under
    `mixplane.io/profiler: operator`). `annotations`: the pass's (parsed from `body` when not given)."""
    ann = annotations if annotations is not None else annotations_of(body)
    prof = profile_from_status(body) or ann.profile
    if prof is not None:
        return Profiled(prof)
    mode = ann.profiler_for(spec)
    # a mixture already waiting for its Jobs does not try in-process again on every poll
    if mode != "job" and (body.get("status") or {}).get("phase") != "Profiling":
        try:
            from mixplane.profile import profile_spec

            measured = profile_spec(spec, max_rows=512, max_cpu_s=0.5)
            return Profiled({**measured, "sources": {n: {**p, "measured_by": "operator"} for n, p in measured["sources"].items()}})
        except Exception as e:  # noqa: BLE001 - the data may live where only loader pods can read it
            if mode == "operator":
                logger.warning(f"profiling in the operator failed ({e}); using fallback costs by kind until a profile is given")
                return Profiled(fallback_profile(spec))
            logger.info(f"profiling in the operator failed ({e}); profiling in a Job with the loaders' image instead")
    return profile_by_jobs(k, body, spec, opts, logger)


def profile_by_jobs(k: Kube, body: Mapping[str, Any], spec: Any, opts: ClusterOptions, logger: Any) -> Profiled:
    """Apply the profiling Jobs (idempotent: same spec, same names; a finished Job is never re-run, delete it to
    retry), remove those of an earlier spec, and read what their pods' termination messages say."""
    from mixplane.operator.builders import ANN_PROFILE_SOURCES, LABEL_PROFILE, LABEL_PROFILE_DIGEST, profile_children
    from mixplane.operator.reconcile import now, profile_outcome

    objs = profile_children(spec, opts)
    digest = objs[1]["metadata"]["labels"][LABEL_PROFILE_DIGEST]
    for obj in objs:
        k.apply(adopt(obj, body))
    for kind, api in (("Job", "batch/v1"), ("ConfigMap", "v1")):
        for old in k.list(api, kind, opts.namespace, f"{LABEL_PROFILE}={opts.name},{LABEL_PROFILE_DIGEST}!={digest}"):
            k.delete(api, kind, opts.namespace, old["metadata"]["name"])
    jobs = []
    for obj in objs:
        if obj["kind"] == "Job":
            name = obj["metadata"]["name"]
            jobs.append((k.get("batch/v1", "Job", opts.namespace, name), k.list("v1", "Pod", opts.namespace, f"job-name={name}"),
                         obj["metadata"]["annotations"][ANN_PROFILE_SOURCES].split(",")))
    out = profile_outcome(spec, jobs)
    names = [o["metadata"]["name"] for o in objs if o["kind"] == "Job"]
    state = {"pending": "Running", "done": "Succeeded", "failed": "Failed"}[out.state]
    prev = (body.get("status") or {}).get("profiling") or {}
    entry = {"state": state, "jobs": names, "message": out.message or f"{len(names)} Job(s) succeeded",
             "time": prev.get("time") if prev.get("state") == state and prev.get("jobs") == names else now()}
    if out.state == "failed":
        logger.warning(f"profiling Job failed: {out.message}; sources not measured are sized by kind")
    return Profiled(out.profile, entry, out.message if out.state == "failed" else "")
