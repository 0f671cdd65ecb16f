"""The DataMixture CustomResourceDefinition, generated from the spec model (one source of truth).

Pure: the pydantic model in, a CRD manifest out. `mixplane crd` prints it; `crds/` and the Helm chart's
`crds/` hold the generated file and a test fails when they drift from the model.

The model's JSON schema is turned into a Kubernetes *structural* schema: `$ref`s inlined, `X | None` as
`nullable`, `dict[str, Any]` as preserved unknown fields, numeric bounds in OpenAPI 3.0 form, and every
default (also those from `default_factory`) written so the API server fills them in. Cross-field rules the
schema cannot express are checked by the validating webhook (`mixplane.operator.webhooks`).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import to_jsonable_python

from mixplane.spec import DataMixtureSpec

GROUP = "mixplane.io"
VERSION = "v1alpha1"
KIND = "DataMixture"
PLURAL = "datamixtures"
SINGULAR = "datamixture"
SHORT_NAMES = ["dmix"]
CRD_NAME = f"{PLURAL}.{GROUP}"
API_VERSION = f"{GROUP}/{VERSION}"
CONDITION_TYPES = ("Ready", "Progressing", "Degraded", "MixtureApplied", "TopologyApplied")
PHASES = ("Pending", "Profiling", "Running", "Updating", "Degraded", "Failed")
# spec fields whose model default must not be written by the API server: `name` defaults to metadata.name
NO_SERVER_DEFAULT = {"name"}


# ---- status: the operator writes it, the CRD's status schema comes from it ----

class _Status(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Condition(_Status):
    type: Literal["Ready", "Progressing", "Degraded", "MixtureApplied", "TopologyApplied", "PartitionsApplied", "StatusTooLarge"] = Field(..., description="Ready: every component is up; Progressing: children, a handoff or a mixture update are being rolled out; Degraded: a component is failing; MixtureApplied: the planner acknowledged the mixture the object holds (False: pending or refused, with the reason); TopologyApplied: the planner serves the topology the object holds (False: a reshard pending or refused, with the reason); PartitionsApplied: no re-partition the scaler wants is waiting (False: one pending or refused, with the reason); StatusTooLarge: the object would exceed the API server's size, so informational status fields were left out (Trimmed) or the status is not written (OverLimit), the message says which; False once it fits again.")
    status: Literal["True", "False", "Unknown"] = Field(..., description="Condition status.")
    reason: str = Field("", description="One CamelCase word saying why.")
    message: str = Field("", description="Human-readable detail.")
    lastTransitionTime: str | None = Field(None, description="When status last changed (RFC 3339).")
    observedGeneration: int | None = Field(None, ge=0, description="metadata.generation the condition was computed for.")


class ImageCostsStatus(_Status):
    decodeSeconds: float = Field(..., ge=0, description="CPU seconds of one image's decode, resize and patch cut (mean).")
    rawBytes: float = Field(..., ge=0, description="Encoded bytes per image (mean).")
    decodedBytes: float = Field(..., ge=0, description="Decoded patch bytes per image (mean).")
    images: int = Field(..., ge=0, description="Images the means come from.")


class SourceProfile(_Status):
    cpuSecondsPerToken: float = Field(..., ge=0, description="Measured CPU seconds per delivered token (`mixplane profile`).")
    memoryPerPartition: int = Field(..., ge=0, description="Measured bytes one Source Loader of this source holds.")
    meanTokens: float | None = Field(None, ge=0, description="Mean tokens per sample in the profiled pages.")
    maxPartitions: int | None = Field(None, ge=1, description="Partitions the source can be split into (its pages, row groups or rows; a source read block by block: at most its blocks).")
    filesListed: int | None = Field(None, ge=1, description="Files the profile listed. A kept profile without it (an older mixplane's) of a source that may be read block by block is measured again: its maxPartitions may count pages, not blocks.")
    measuredBy: Literal["operator", "job", "annotation", "fallback"] | None = Field(None, description="Where the figures come from: the operator in-process, a profiling Job, the mixplane.io/profile annotation, or costs by kind (not measured).")
    imageCosts: ImageCostsStatus | None = Field(None, description="An image source's measured image costs: what `image.decode_at: auto` is resolved from.")


class SourceStatus(_Status):
    name: str = Field(..., description="Source name.")
    targetWeight: float | None = Field(None, ge=0, description="Target share of tokens (or samples) in the current phase.")
    realisedWeight: float | None = Field(None, ge=0, description="Realised share in the current phase, from the planner.")
    partitions: int | None = Field(None, ge=0, description="Partitions (Source Loader replicas) the planner reads the source with now (after a re-partition: the count it acknowledged).")
    startPartitions: int | None = Field(None, ge=0, description="Partitions the planner was started with (the spec it reads; a re-partition does not change it).")
    loaderPods: int | None = Field(None, ge=0, description="Remote loader pods currently hosting its partitions.")
    sidecarPartitions: int | None = Field(None, ge=0, description="Partitions hosted by loader sidecars in trainer pods (sidecar placement).")
    deliveredTokensPerSecond: float | None = Field(None, ge=0, description="Tokens per second of the source in the steps the planner planned recently (planner STATUS).")
    profile: SourceProfile | None = Field(None, description="Profiled cost, kept so a restart does not re-profile.")
    decodeAt: Literal["loader", "constructor", "client"] | None = Field(None, description="An image source: where its images are decoded (`image.decode_at`, `auto` resolved from the profile's image costs) in the spec the components read.")


class MixtureUpdateStatus(_Status):
    generation: int = Field(..., ge=0, description="metadata.generation of the change.")
    effectiveStep: int = Field(..., ge=0, description="First step planned with the new mixture.")
    weights: dict[str, float] = Field(default_factory=dict, description="Weights in force from effectiveStep on.")


class SidecarStatus(_Status):
    slot: int = Field(..., ge=0, description="Trainer pod slot (its mixplane.io/trainer-index, Indexed Job completion index or StatefulSet ordinal).")
    pods: list[str] = Field(default_factory=list, description="Loader processes injected into that trainer pod.")
    partitions: str = Field("", description="source:partition pairs they host.")
    cpu: float = Field(0.0, ge=0, description="Cores they request.")


class ScalingStatus(_Status):
    step: int = Field(..., ge=0, description="Planner step when the decision was taken.")
    source: str = Field(..., description="Source whose loaders were re-targeted.")
    direction: Literal["up", "down"] = Field(..., description="More or fewer cores.")
    fromCores: float = Field(..., ge=0, description="Cores before.")
    toCores: float = Field(..., ge=0, description="Cores after.")
    interval: int = Field(..., ge=0, description="Timer interval of the operator's scaler (since it started).")
    loaderPods: int | None = Field(None, ge=0, description="Running loader pods of the source after the decision.")
    time: str | None = Field(None, description="When (RFC 3339).")


class ProfilingStatus(_Status):
    state: Literal["Running", "Succeeded", "Failed"] = Field(..., description="Where the profiling Jobs are.")
    jobs: list[str] = Field(default_factory=list, description="The profiling Jobs (one per group of sources).")
    message: str | None = Field(None, description="Why a Job failed (the pod's error, credentials redacted) or what runs.")
    time: str | None = Field(None, description="When the state was last observed to change (RFC 3339).")


class LayoutStatus(_Status):
    shares: dict[str, float] | None = Field(None, description="Shares the scaling policy sized the loader pods for (absent: the schedule's).")
    hosts: dict[str, str] = Field(default_factory=dict, description="The loader layout being served or moved to: loader host -> its partitions (source:replica, comma-separated).")
    draining: list[str] = Field(default_factory=list, description="Loader hosts outside the layout that still serve a partition: their Deployments stay until the planner handed it over.")
    settling: bool = Field(False, description="A handoff just finished: the scaling policy ignores the planner's waits for one interval.")


class ScalerStatus(_Status):
    observedAt: float | None = Field(None, description="When the scaling policy last observed the planner (seconds since the epoch).")
    last: dict[str, float] = Field(default_factory=dict, description="The planner's planned tokens at that time (the measured trainer rate).")
    state: dict[str, Any] = Field(default_factory=dict, description="The policy's allocations, moving averages, counters and corrected costs.")


class MixtureUpdateState(_Status):
    generation: int = Field(..., ge=0, description="metadata.generation whose mixture this is.")
    digest: str = Field(..., description="Digest of spec.mixture.")
    updateId: str = Field(..., description="The id the planner applies once (<uid>/<generation>).")
    state: Literal["Acknowledged", "Pending", "Refused"] = Field(..., description="Acknowledged by the planner, pending (not sent, or the planner was unreachable), or refused (retried with backoff).")
    effectiveStep: int | None = Field(None, ge=0, description="First step planned with this mixture.")
    plannerGeneration: int | None = Field(None, ge=0, description="The planner's mixture generation for it.")
    attempts: int = Field(0, ge=0, description="Sends that failed so far.")
    retryAt: float | None = Field(None, description="Next try (seconds since the epoch).")
    reason: str = Field("", description="Why it is in this state.")
    initial: bool | None = Field(None, description="The mixture the planner was started with (not a live update).")


class TopologyState(_Status):
    generation: int = Field(..., ge=0, description="metadata.generation whose topology this is.")
    digest: str = Field(..., description="Digest of spec.topology (and of how constructors are placed on it).")
    served: dict[str, Any] | None = Field(None, description="The topology the planner serves once this is acknowledged.")
    was: dict[str, Any] | None = Field(None, description="While a change is pending: the topology served before it (the children stay rendered with it).")
    reshardId: str = Field("", description="The id the planner applies once (<uid>/topology-<generation>).")
    state: Literal["Acknowledged", "Pending", "Refused"] = Field(..., description="Acknowledged by the planner, pending (not sent, or no answer), or refused (retried with backoff).")
    effectiveStep: int | None = Field(None, ge=0, description="First step planned for this world.")
    worldSize: int | None = Field(None, ge=1, description="Trainer ranks of this world.")
    plannerGeneration: int | None = Field(None, ge=0, description="The planner's spec generation for it.")
    attempts: int = Field(0, ge=0, description="Sends that failed so far.")
    retryAt: float | None = Field(None, description="Next try (seconds since the epoch).")
    reason: str = Field("", description="Why it is in this state.")
    initial: bool | None = Field(None, description="The topology the planner was started with (not a live change).")


class TopologyChange(_Status):
    generation: int = Field(..., ge=0, description="metadata.generation of the change.")
    effectiveStep: int = Field(..., ge=0, description="First step planned for the new world.")
    worldSize: int = Field(..., ge=0, description="Trainer ranks of the new world.")
    reshardId: str = Field("", description="The planner's id of it.")


class RepartitionState(_Status):
    source: str = Field(..., description="The source re-partitioned.")
    from_: int = Field(..., alias="from", ge=1, description="Partitions the planner read it with before.")
    partitions: int = Field(..., ge=1, description="Partitions asked for.")
    repartitionId: str = Field(..., description="The id the planner applies once (<uid>/repartition-<source>-<from>-<to>).")
    state: Literal["Acknowledged", "Pending", "Refused"] = Field(..., description="Acknowledged: applied by the planner; pending (not sent, no answer, or accepted for a step not reached: acceptedStep); refused (retried with backoff).")
    acceptedStep: int | None = Field(None, ge=0, description="The step the planner accepted it for (applied once every earlier step is complete).")
    effectiveStep: int | None = Field(None, ge=0, description="First step read with the new partitions (when applied).")
    attempts: int = Field(0, ge=0, description="Sends that failed so far.")
    retryAt: float | None = Field(None, description="Next try (seconds since the epoch).")
    reason: str = Field("", description="Why it is in this state.")


class RepartitionChange(_Status):
    source: str = Field(..., description="The source re-partitioned.")
    from_: int = Field(..., alias="from", ge=1, description="Partitions before.")
    partitions: int = Field(..., ge=1, description="Partitions after.")
    effectiveStep: int = Field(..., ge=0, description="First step read with them.")
    repartitionId: str = Field("", description="The planner's id of it.")


class ChildrenStatus(_Status):
    hash: str = Field(..., description="Digest of the children last applied.")
    appliedAt: float = Field(..., description="When (seconds since the epoch).")
    generation: int | None = Field(None, ge=0, description="metadata.generation they were rendered from.")


class MixtureStatus(_Status):
    """What the operator reports; `model_dump(by_alias=True, exclude_none=True)` is a valid status patch."""

    phase: Literal["Pending", "Profiling", "Running", "Updating", "Degraded", "Failed"] | None = Field(None, description="Lifecycle phase.")
    observedGeneration: int | None = Field(None, ge=0, description="metadata.generation last acted on.")
    plannerEndpoint: str | None = Field(None, description="Where trainers reach the planner (tcp://SERVICE:PORT); MIXPLANE_PLANNER.")
    step: int | None = Field(None, ge=0, description="Last planned step.")
    sourceCount: int | None = Field(None, ge=0, description="Number of sources.")
    loaderPods: int | None = Field(None, ge=0, description="Loader pods in total.")
    conditions: list[Condition] = Field(default_factory=list, description="Ready, Progressing, Degraded.")
    sources: list[SourceStatus] = Field(default_factory=list, description="Per source: target and realised weight, partitions, loader pods, profile.")
    updates: list[MixtureUpdateStatus] = Field(default_factory=list, description="Live mixture updates and the step each took effect at.")
    sidecars: list[SidecarStatus] = Field(default_factory=list, description="Sidecar placement: loader processes per trainer pod slot.")
    scaling: list[ScalingStatus] = Field(default_factory=list, description="Mixture-driven scaling decisions (last 20).")
    profiling: ProfilingStatus | None = Field(None, description="The profiling Jobs, when the sources were profiled in the cluster (kubernetes.source_secret, or the operator could not read them).")
    layout: LayoutStatus | None = Field(None, description="The loader layout the operator keeps or moves to (kept here so that a restarted operator continues it).")
    scaler: ScalerStatus | None = Field(None, description="The scaling policy's state.")
    mixtureUpdate: MixtureUpdateState | None = Field(None, description="The live update of spec.mixture: sent, acknowledged or retried.")
    topology: TopologyState | None = Field(None, description="The live change of spec.topology (RESHARD): sent, acknowledged (from which step the new world is served) or retried.")
    topologyChanges: list[TopologyChange] = Field(default_factory=list, description="Topology changes acknowledged and the step each took effect at (last 20).")
    repartition: RepartitionState | None = Field(None, description="The last re-partition the scaler asked for (REPARTITION): pending, refused or applied.")
    repartitions: list[RepartitionChange] = Field(default_factory=list, description="Re-partitions the planner applied and the step each took effect at (last 20).")
    children: ChildrenStatus | None = Field(None, description="The children last applied.")


# ---- pydantic JSON schema -> Kubernetes structural schema ----

class _FactoryDefaults(GenerateJsonSchema):
    """Also write defaults that come from `default_factory` (pydantic leaves them out)."""

    def get_default_value(self, schema: Any) -> Any:
        if "default" in schema:
            return schema["default"]
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return NoDefault
        return _minimal_default(factory())


def _minimal_default(value: Any) -> Any:
    """A model default becomes `{}`: the API server then fills in the nested defaults itself."""
    if isinstance(value, BaseModel):
        return {}
    if isinstance(value, dict):
        return {k: _minimal_default(v) for k, v in value.items()}
    return to_jsonable_python(value)


def _strip_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_none(v) for v in value]
    return value


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node as an OpenAPI v3.0 structural schema node."""
    node = dict(schema)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own description/default win over the model's
    node.pop("title", None)
    if "anyOf" in node:
        options = node.pop("anyOf")
        non_null = [o for o in options if o.get("type") != "null"]
        if sorted(o.get("type") for o in non_null) == ["integer", "string"]:  # e.g. sources[].workers: N or "auto"
            keep = {k: v for k, v in node.items() if k in ("description", "default")}
            return {"x-kubernetes-int-or-string": True, **keep}
        if len(non_null) != 1:
            raise ValueError(f"cannot express union {options!r} in a structural schema")
        inner = structural(non_null[0], defs)
        node = {**inner, **{k: v for k, v in node.items() if k not in inner or k in ("description", "default")}}
        if len(non_null) < len(options):
            node["nullable"] = True
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in node and not isinstance(node[bound], bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if "default" in node:
        d = _strip_none(_minimal_default(node["default"]))
        if d is None:
            node.pop("default")
        else:
            node["default"] = d
    t = node.get("type")
    if t == "object" or "properties" in node or "additionalProperties" in node:
        node["type"] = "object"
        props = node.get("properties")
        extra = node.pop("additionalProperties", None)
        if props is not None:
            node["properties"] = {k: structural(v, defs) for k, v in props.items()}
        elif isinstance(extra, dict) and extra:
            node["additionalProperties"] = structural(extra, defs)
        else:  # dict[str, Any]: free-form, kept as written
            node["x-kubernetes-preserve-unknown-fields"] = True
    if t == "array" and "items" in node:
        node["items"] = structural(node["items"], defs)
    return node


def spec_schema() -> dict[str, Any]:
    raw = DataMixtureSpec.model_json_schema(schema_generator=_FactoryDefaults)
    defs = raw.pop("$defs", {})
    out = structural(raw, defs)
    for name in NO_SERVER_DEFAULT:
        out["properties"][name].pop("default", None)
    return out


def status_schema() -> dict[str, Any]:
    raw = MixtureStatus.model_json_schema(schema_generator=_FactoryDefaults)
    defs = raw.pop("$defs", {})
    out = _drop_defaults(structural(raw, defs))
    # kopf keeps its own progress and handler results under status too: unknown fields are kept
    out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _drop_defaults(node: Any) -> Any:
    """The operator owns status: the API server must not invent any of it."""
    if isinstance(node, dict):
        return {k: _drop_defaults(v) for k, v in node.items() if k != "default"}
    if isinstance(node, list):
        return [_drop_defaults(v) for v in node]
    return node


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) of DataMixture."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "mixplane"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["mixplane"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                    {"name": "Sources", "type": "integer", "jsonPath": ".status.sourceCount"},
                    {"name": "Loaders", "type": "integer", "jsonPath": ".status.loaderPods"},
                    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                    {"name": "Realised", "type": "string", "jsonPath": ".status.sources[*].realisedWeight",
                     "description": "Realised share per source in the current phase, in spec.sources order."},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A DataMixture: sources, how to mix them over steps, the batch and the trainer's parallelism (mixplane).",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    header = "# Generated from src/mixplane/spec.py by `mixplane crd` (src/mixplane/operator/crd.py). Do not edit.\n"
    return header + yaml.safe_dump(copy.deepcopy(crd_manifest()), sort_keys=False, width=120, allow_unicode=True)
