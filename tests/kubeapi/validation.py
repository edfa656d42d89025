"""What kube-apiserver checks on every object, worded like it.

Ports of k8s.io/apimachinery's `util/validation` (qualified names, label values, DNS names),
`api/validation/objectmeta.go` (labels, annotations, ownerReferences, finalizers), core's
`pkg/apis/core/validation/events.go`, the field-selector labels each kind supports
(`pkg/apis/core/v1/conversion.go`, apiextensions' `crConverter`) and the option checks of
`apis/meta/v1/validation` (dryRun, fieldManager, propagationPolicy). Every function returns
(field, reason, message-without-field) triples, what `errors.invalid` renders as a 422.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ApiError

Cause = tuple[str, str, str]

# --------------------------------------------------------------------------- apimachinery util/validation


def regex_error(msg: str, fmt: str, *examples: str) -> str:
    """validation.RegexError, including its double space before each " or "."""
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    out = msg + " (e.g. "
    for i, ex in enumerate(examples):
        if i > 0:
            out += " or "
        out += f"'{ex}', "
    return out + f"regex used for validation is '{fmt}')"


def max_len_error(n: int) -> str:
    return f"must be no more than {n} characters"


QNAME_FMT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
QNAME_MSG = "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
LABEL_VALUE_FMT = f"({QNAME_FMT})?"
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                   "and must start and end with an alphanumeric character")
DNS1123_LABEL_FMT = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL_MSG = ("a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
                     "start and end with an alphanumeric character")
DNS1123_SUBDOMAIN_FMT = DNS1123_LABEL_FMT + r"(\." + DNS1123_LABEL_FMT + ")*"
DNS1123_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                         "and must start and end with an alphanumeric character")
DNS1035_LABEL_FMT = "[a-z]([-a-z0-9]*[a-z0-9])?"
DNS1035_LABEL_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                     "alphabetic character, and end with an alphanumeric character")

_QNAME = re.compile(f"^{QNAME_FMT}$")
_LABEL_VALUE = re.compile(f"^{LABEL_VALUE_FMT}$")
_DNS1123_LABEL = re.compile(f"^{DNS1123_LABEL_FMT}$")
_DNS1123_SUBDOMAIN = re.compile(f"^{DNS1123_SUBDOMAIN_FMT}$")
_DNS1035_LABEL = re.compile(f"^{DNS1035_LABEL_FMT}$")


def is_dns1123_subdomain(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append(max_len_error(253))
    if not _DNS1123_SUBDOMAIN.match(value):
        errs.append(regex_error(DNS1123_SUBDOMAIN_MSG, DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errs


def is_dns1123_label(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append(max_len_error(63))
    if not _DNS1123_LABEL.match(value):
        errs.append(regex_error(DNS1123_LABEL_MSG, DNS1123_LABEL_FMT, "my-name", "123-abc"))
    return errs


def is_dns1035_label(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append(max_len_error(63))
    if not _DNS1035_LABEL.match(value):
        errs.append(regex_error(DNS1035_LABEL_MSG, DNS1035_LABEL_FMT, "my-name", "abc-123"))
    return errs


def is_path_segment_name(value: str) -> list[str]:
    """path.IsValidPathSegmentName: what every object name must be, whatever its kind."""
    if value in (".", ".."):
        return [f"may not be '{value}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in value]


def is_qualified_name(value: str) -> list[str]:
    errs: list[str] = []
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs += ["prefix part " + m for m in is_dns1123_subdomain(prefix)]
    else:
        return ["a qualified name " + regex_error(QNAME_MSG, QNAME_FMT, "MyName", "my.name", "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > 63:
        errs.append("name part " + max_len_error(63))
    if not _QNAME.match(name):
        errs.append("name part " + regex_error(QNAME_MSG, QNAME_FMT, "MyName", "my.name", "123-abc"))
    return errs


def is_valid_label_value(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append(max_len_error(63))
    if not _LABEL_VALUE.match(value):
        errs.append(regex_error(LABEL_VALUE_MSG, LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errs


def go_value(v: Any) -> str:
    """How field.Invalid prints a bad value: strings quoted, other values Go-ish."""
    from .schema import _go_value

    return _go_value(v)


def invalid(field: str, value: Any, msg: str) -> Cause:
    return (field, "FieldValueInvalid", f"Invalid value: {go_value(value)}: {msg}")


# --------------------------------------------------------------------------- names

#: The name rule of each built-in resource (default: DNS-1123 subdomain).
_NAME_RULES = {
    ("", "namespaces"): is_dns1123_label,
    ("", "services"): is_dns1035_label,  # ValidateServiceName = NameIsDNS1035Label
    ("", "events"): is_path_segment_name,  # core/v1 Events: only the path-segment rule
}


def name_errors(group: str, plural: str, name: str, generate_name: str | None = None) -> list[Cause]:
    rule = _NAME_RULES.get((group, plural), is_dns1123_subdomain)
    errs: list[Cause] = []
    if generate_name:
        # nameFn(generateName, prefix=true) masks one trailing dash
        masked = generate_name[:-1] + "a" if generate_name.endswith("-") else generate_name
        errs += [invalid("metadata.generateName", generate_name, m) for m in rule(masked)]
    if not name:
        return errs + [("metadata.name", "FieldValueRequired", "Required value: name or generateName is required")]
    return errs + [invalid("metadata.name", name, m) for m in rule(name)]


# --------------------------------------------------------------------------- ObjectMeta

TOTAL_ANNOTATION_SIZE = 256 * 1024
FINALIZER_ORPHAN = "orphan"
FINALIZER_FOREGROUND = "foregroundDeletion"


def object_meta_errors(md: dict) -> list[Cause]:
    """validateObjectMetaAccessorWithOptsCommon: labels, annotations, ownerReferences, finalizers."""
    errs: list[Cause] = []
    labels = md.get("labels")
    if labels is not None and not isinstance(labels, dict):
        return [("metadata.labels", "FieldValueTypeInvalid", "Invalid value: must be a map of strings")]
    for k, v in (labels or {}).items():
        errs += [invalid("metadata.labels", k, m) for m in is_qualified_name(str(k))]
        if not isinstance(v, str):
            errs.append(("metadata.labels", "FieldValueTypeInvalid", f"Invalid value: {go_value(v)}: must be a string"))
            continue
        errs += [invalid("metadata.labels", v, m) for m in is_valid_label_value(v)]
    ann = md.get("annotations")
    if ann is not None and not isinstance(ann, dict):
        return errs + [("metadata.annotations", "FieldValueTypeInvalid", "Invalid value: must be a map of strings")]
    size = 0
    for k, v in (ann or {}).items():
        errs += [invalid("metadata.annotations", k, m) for m in is_qualified_name(str(k).lower())]
        size += len(str(k).encode()) + len(str(v if v is not None else "").encode())
    if size > TOTAL_ANNOTATION_SIZE:
        errs.append(("metadata.annotations", "FieldValueTooLong", f"Too long: must have at most {TOTAL_ANNOTATION_SIZE} bytes"))
    errs += owner_reference_errors(md.get("ownerReferences") or [])
    errs += finalizer_errors(md.get("finalizers") or [])
    return errs


def owner_reference_errors(refs: list) -> list[Cause]:
    errs: list[Cause] = []
    path = "metadata.ownerReferences"
    first_controller = ""
    for ref in refs:
        if not isinstance(ref, dict):
            errs.append((path, "FieldValueTypeInvalid", "Invalid value: must be an object"))
            continue
        api_version, kind = ref.get("apiVersion") or "", ref.get("kind") or ""
        version = api_version.rpartition("/")[2]
        if not version:
            errs.append(invalid(f"{path}.apiVersion", api_version, "version must not be empty"))
        if not kind:
            errs.append(invalid(f"{path}.kind", kind, "must not be empty"))
        if not ref.get("name"):
            errs.append(invalid(f"{path}.name", ref.get("name") or "", "must not be empty"))
        if not ref.get("uid"):
            errs.append(invalid(f"{path}.uid", ref.get("uid") or "", "must not be empty"))
        if api_version == "v1" and kind == "Event":
            errs.append(invalid(path, ref, "/v1, Kind=Event is disallowed from being an owner"))
        if ref.get("controller") is True:
            cur = f"{kind}/{ref.get('name')}"
            if first_controller:
                errs.append(invalid(path, refs, "Only one reference can have Controller set to true. "
                                    f'Found "true" in references for {first_controller} and {cur}'))
            else:
                first_controller = cur
    return errs


def finalizer_errors(finalizers: list) -> list[Cause]:
    errs: list[Cause] = []
    for f in finalizers:
        errs += [invalid("metadata.finalizers", f, m) for m in is_qualified_name(str(f))]
    if FINALIZER_ORPHAN in finalizers and FINALIZER_FOREGROUND in finalizers:
        errs.append(("metadata.finalizers", "FieldValueInvalid",
                     f"Invalid value: {go_value(list(finalizers))}: finalizer {FINALIZER_ORPHAN} and "
                     f"{FINALIZER_FOREGROUND} cannot be both set"))
    return errs


def new_finalizer_error(new: list, old: list) -> Cause | None:
    """ValidateNoNewFinalizers, for an object whose deletion has started."""
    extra = sorted(set(new) - set(old))
    if not extra:
        return None
    shown = "[]string{" + ", ".join(f'"{f}"' for f in extra) + "}"
    return ("metadata.finalizers", "FieldValueForbidden",
            f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {shown}")


# --------------------------------------------------------------------------- Events

REPORTING_INSTANCE_LIMIT = ACTION_LIMIT = REASON_LIMIT = 128
NOTE_LIMIT = 1024


def event_errors(group: str, ev: dict) -> list[Cause]:
    """ValidateEventCreate for core/v1 (legacy rules only) and events.k8s.io/v1 (strict) Events.

    events.k8s.io/v1 names its fields differently (regarding, note, reportingController,
    deprecated*); they are read as the internal Event's.
    """
    strict = group == "events.k8s.io"
    md = ev.get("metadata") or {}
    ns = md.get("namespace", "")
    if strict:
        involved = ev.get("regarding") or {}
        message = ev.get("note") or ""
        controller = ev.get("reportingController") or ""
        first, last, count = ev.get("deprecatedFirstTimestamp"), ev.get("deprecatedLastTimestamp"), ev.get("deprecatedCount")
        source = ev.get("deprecatedSource") or {}
    else:
        involved = ev.get("involvedObject") or {}
        message = ev.get("message") or ""
        controller = ev.get("reportingComponent") or ""
        first, last, count = ev.get("firstTimestamp"), ev.get("lastTimestamp"), ev.get("count")
        source = ev.get("source") or {}
    inv_ns = involved.get("namespace") or ""
    event_time = ev.get("eventTime")
    reason = ev.get("reason") or ""
    errs: list[Cause] = []
    # legacyValidateEvent
    if not event_time:
        if (not inv_ns and ns not in ("", "default")) or (inv_ns and ns != inv_ns):
            errs.append(invalid("involvedObject.namespace", inv_ns, "does not match event.namespace"))
    else:
        if not inv_ns and ns not in ("default", "kube-system"):
            errs.append(invalid("involvedObject.namespace", inv_ns, "does not match event.namespace"))
        if not controller:
            errs.append(("reportingController", "FieldValueRequired", "Required value"))
        errs += [invalid("reportingController", controller, m) for m in is_qualified_name(controller)]
        instance = ev.get("reportingInstance") or ""
        if not instance:
            errs.append(("reportingInstance", "FieldValueRequired", "Required value"))
        if len(instance) > REPORTING_INSTANCE_LIMIT:
            errs.append(invalid("reportingInstance", "", f"can have at most {REPORTING_INSTANCE_LIMIT} characters"))
        action = ev.get("action") or ""
        if not action:
            errs.append(("action", "FieldValueRequired", "Required value"))
        if len(action) > ACTION_LIMIT:
            errs.append(invalid("action", "", f"can have at most {ACTION_LIMIT} characters"))
        if not reason:
            errs.append(("reason", "FieldValueRequired", "Required value"))
        if len(reason) > REASON_LIMIT:
            errs.append(invalid("reason", "", f"can have at most {REASON_LIMIT} characters"))
        if len(message) > NOTE_LIMIT:
            errs.append(invalid("message", "", f"can have at most {NOTE_LIMIT} characters"))
    errs += [invalid("namespace", ns, m) for m in is_dns1123_subdomain(ns)]
    if not strict:
        return errs
    # events.k8s.io/v1: the strict rules on top
    series = ev.get("series")
    if series is not None:
        if int((series or {}).get("count") or 0) < 2:
            errs.append(invalid("series.count", "", "should be at least 2"))
        if not (series or {}).get("lastObservedTime"):
            errs.append(("series.lastObservedTime", "FieldValueRequired", "Required value"))
    if not event_time:
        errs.append(("eventTime", "FieldValueRequired", "Required value"))
    if ev.get("type") not in ("Normal", "Warning"):
        errs.append(invalid("type", "", f"has invalid value: {ev.get('type') or ''}"))
    if first:
        errs.append(invalid("firstTimestamp", "", "needs to be unset"))
    if last:
        errs.append(invalid("lastTimestamp", "", "needs to be unset"))
    if count:
        errs.append(invalid("count", "", "needs to be unset"))
    if source.get("component") or source.get("host"):
        errs.append(invalid("source", "", "needs to be unset"))
    return errs


# --------------------------------------------------------------------------- field selectors

_META_FIELDS = ("metadata.name", "metadata.namespace")
#: Field labels each built-in kind accepts in fieldSelector (pkg/apis/*/v1/conversion.go).
FIELD_LABELS: dict[tuple[str, str], tuple[str, ...]] = {
    ("", "pods"): _META_FIELDS + ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName", "spec.serviceAccountName",
                                  "spec.hostNetwork", "status.phase", "status.podIP", "status.podIPs",
                                  "status.nominatedNodeName", "spec.host"),
    ("", "nodes"): ("metadata.name", "spec.unschedulable"),
    ("", "events"): _META_FIELDS + ("involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
                                    "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
                                    "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"),
    ("events.k8s.io", "events"): _META_FIELDS + ("regarding.kind", "regarding.namespace", "regarding.name",
                                                 "regarding.uid", "regarding.apiVersion", "regarding.resourceVersion",
                                                 "regarding.fieldPath", "reason", "reportingController", "type"),
    ("", "namespaces"): ("metadata.name", "status.phase"),
    ("", "secrets"): _META_FIELDS + ("type",),
    ("", "services"): _META_FIELDS + ("spec.clusterIP", "spec.type"),
}
#: Where a field label reads from when it is not the dotted path itself.
FIELD_PATHS = {("", "events", "source"): "source.component", ("", "pods", "spec.host"): "spec.nodeName",
               ("", "pods", "status.podIPs"): "status.podIP"}


def check_field_labels(group: str, plural: str, custom: bool, namespaced: bool, labels: list[str]) -> None:
    """400 BadRequest for a field label the kind does not support, worded like ConvertFieldLabel."""
    for label in labels:
        if custom:
            if label == "metadata.name" or (namespaced and label == "metadata.namespace"):
                continue
            raise ApiError(400, f"field label not supported: {label}", "BadRequest")
        allowed = FIELD_LABELS.get((group, plural))
        if allowed is None:
            if label in _META_FIELDS:
                continue
            raise ApiError(400, f'"{label}" is not a known field selector: only "metadata.name", "metadata.namespace"',
                           "BadRequest")
        if label not in allowed:
            raise ApiError(400, f"field label not supported: {label}", "BadRequest")


# --------------------------------------------------------------------------- request options


def options_errors(kind: str, q: Any, patch_type: str | None = None) -> list[Cause]:
    """ValidateCreateOptions / UpdateOptions / PatchOptions / DeleteOptions on the query."""
    errs: list[Cause] = []
    dry = q.getall("dryRun", []) if hasattr(q, "getall") else ([q["dryRun"]] if "dryRun" in q else [])
    bad = [d for d in dry if d != "All"]
    if bad:
        shown = "[]string{" + ", ".join(f'"{d}"' for d in dry) + "}"
        errs.append(("dryRun", "FieldValueNotSupported", f'Unsupported value: {shown}: supported values: "All"'))
    fm = q.get("fieldManager", "")
    if len(fm) > 128:
        errs.append(("fieldManager", "FieldValueTooLong", "Too long: must have at most 128 bytes"))
    for i, ch in enumerate(fm):
        if not ch.isprintable():
            errs.append(invalid("fieldManager", fm, f"invalid character U+{ord(ch):04X} (at position {i})"))
    if kind == "PatchOptions":
        if patch_type == "application/apply-patch+yaml":
            if not fm:
                errs.append(("fieldManager", "FieldValueRequired", "Required value: is required for apply patch"))
        elif "force" in q:
            errs.append(("force", "FieldValueForbidden", "Forbidden: may not be specified for non-apply patch"))
    fv = q.get("fieldValidation", "")
    if fv not in ("", "Ignore", "Warn", "Strict"):
        errs.append(("fieldValidation", "FieldValueNotSupported",
                     f'Unsupported value: "{fv}": supported values: "", "Ignore", "Strict", "Warn"'))
    return errs


def delete_options_errors(q: Any, body: dict) -> list[Cause]:
    errs = options_errors("DeleteOptions", q)
    policy = q.get("propagationPolicy") or body.get("propagationPolicy")
    if body.get("orphanDependents") is not None and policy is not None:
        errs.append(invalid("propagationPolicy", policy, "orphanDependents and deletionPropagation cannot be both set"))
    if policy is not None and policy not in ("Foreground", "Background", "Orphan"):
        errs.append(("propagationPolicy", "FieldValueNotSupported",
                     f'Unsupported value: "{policy}": supported values: "Foreground", "Background", "Orphan", "nil"'))
    return errs


# --------------------------------------------------------------------------- training-operator's webhook

PYTORCHJOB_WEBHOOK = "validator.pytorchjob.training-operator.kubeflow.org"
_MANAGED_BY = ("kubeflow.org/training-operator", "kueue.x-k8s.io/multikueue")


def pytorchjob_webhook_errors(job: dict) -> list[str]:
    """training-operator v1.9's validating webhook for PyTorchJobs (pkg/webhooks/pytorch), which a
    cluster running it answers with 403 `admission webhook ... denied the request: ...`."""
    out: list[str] = []
    name = (job.get("metadata") or {}).get("name") or ""
    name_errs = is_dns1035_label(name)
    if name_errs:
        out.append(f"metadata.name: Invalid value: {go_value(name)}: should match: {','.join(name_errs)}")
    spec = job.get("spec") or {}
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by is not None and managed_by not in _MANAGED_BY:
        out.append(f"spec.runPolicy.managedBy: Unsupported value: {go_value(managed_by)}: supported values: "
                   + ", ".join(f'"{m}"' for m in _MANAGED_BY))
    rspecs = spec.get("pytorchReplicaSpecs")
    base = "spec.pytorchReplicaSpecs"
    if spec.get("elasticPolicy") is not None:
        if "Worker" not in (rspecs or {}):
            out.append(f"{base}[Worker]: Required value: must be configured if elastic policy is used")
        if (spec.get("elasticPolicy") or {}).get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            out.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    if rspecs is None:
        out.append(f"{base}: Required value: must be required")
    for rtype in sorted(rspecs or {}):
        rspec = (rspecs or {})[rtype] or {}
        role = f"{base}[{rtype}]"
        containers = ((rspec.get("template") or {}).get("spec") or {}).get("containers") or []
        cpath = f"{role}.template.spec.containers"
        if not containers:
            out.append(f"{cpath}: Required value: must be specified")
        if rtype not in ("Master", "Worker"):
            out.append(f'{role}: Unsupported value: {go_value(rtype)}: supported values: "Master", "Worker"')
        for i, c in enumerate(containers):
            if not (c or {}).get("image"):
                out.append(f"{cpath}[{i}].image: Required value: must be required")
        if not any((c or {}).get("name") == "pytorch" for c in containers):
            out.append(f"{cpath}: Required value: must have at least one container with name pytorch")
        replicas = rspec.get("replicas")
        if rtype == "Master" and replicas != 1:
            out.append(f"{role}.replicas: Forbidden: must be 1")
        elif rtype != "Master" and replicas is not None and replicas < 1:
            out.append(f"{role}.replicas: Forbidden: must be at least 1")
    return out
