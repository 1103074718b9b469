"""Checks the rendered Kubernetes manifests of every overlay (deploy/check.sh renders them
with `kubectl kustomize` first).

1. Schemas: every built-in kind validates strictly (unknown fields are errors) against the
   Kubernetes OpenAPI schemas bundled with `kubernetes-validate` (offline), for the oldest
   and the newest version we support. The custom resources (the Prometheus Operator's
   ServiceMonitor and PrometheusRule, KEDA's ScaledObject) have no schema there: they are
   skipped by name, and checked below for what Tessera relies on (their targets exist; the
   PrometheusRule holds the same rules as deploy/observability/tessera-alerts.yml).
2. What deploy/k8s promises operators, per overlay: non-root pods, read-only root
   filesystems, no privilege escalation; probes on every Tessera container; a grace period
   that covers the preStop pause plus the drain timeout; a PodDisruptionBudget and a
   NetworkPolicy over every workload; GPU workers with GPU requests and a memory-backed
   /dev/shm; a replica shape (TP x PP) that the worker pods can fill; env values that
   reference ($(VAR)) only variables defined before them; mTLS set all or nothing on each
   role, its files inside a mounted Secret (and, where cert-manager issues them, a
   Certificate writing that Secret, from an Issuer that is rendered).

Usage: python manifests.py RENDERED.yaml...   (exit 1 and one line per problem on failure)
"""
import re
import sys
from pathlib import Path

import kubernetes_validate
import yaml

# The oldest Kubernetes these manifests target (NetworkPolicy endPort is GA in 1.25) and
# the newest bundled schema.
VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())
# Custom resources: no bundled schema; checked by check_custom below.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
                ("keda.sh/v1alpha1", "ScaledObject"),
                ("cert-manager.io/v1", "Certificate"), ("cert-manager.io/v1", "Issuer")}
TLS_FILES = ("TESSERA_TLS_CERT", "TESSERA_TLS_KEY", "TESSERA_TLS_CA")
ROLES = ("coordinator", "worker", "gateway")
# The rule file the PrometheusRule copies.
ALERT_RULES = Path(__file__).resolve().parents[1] / "observability" / "tessera-alerts.yml"
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
# Seconds between the drain's end and SIGKILL that a process gets to close connections.
GRACE_MARGIN_S = 5


def load(path):
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if d]


def name(doc):
    return f"{doc['kind']}/{doc['metadata']['name']}"


def check_schemas(docs, problems):
    for doc in docs:
        if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_KINDS:
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{name(doc)}: no schema for {doc.get('apiVersion')} in Kubernetes {version}")
            except kubernetes_validate.ValidationError as e:
                path = "/".join(str(p) for p in e.path)
                problems.append(f"{name(doc)}: invalid for Kubernetes {version} at {path}: {e.message}")


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in (selector or {}).items())


def env_value(container, key):
    for e in container.get("env", []):
        if e["name"] == key and "value" in e:
            return e["value"]
    return None


def prestop_sleep_s(container):
    cmd = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    if len(cmd) == 2 and cmd[0].endswith("sleep"):
        return int(cmd[1])
    return 0


def check_env_references(where, container, problems):
    """Kubernetes expands $(VAR) in an env value only when VAR is defined earlier in the
    list (or comes from envFrom); a later one stays literal text. Patches can reorder env."""
    defined = set()
    for e in container.get("env", []):
        for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
            if ref not in defined:
                problems.append(f"{where}: env {e['name']} uses $({ref}) before it is defined")
        defined.add(e["name"])


def check_tls(where, spec, container, docs, problems):
    """All three TESSERA_TLS_* files or none, each under a mounted Secret volume; a Secret
    that a cert-manager Certificate of the same render must write, if there are any."""
    files = {k: env_value(container, k) for k in TLS_FILES}
    if not any(files.values()):
        if env_value(container, "TESSERA_TLS_SERVER_NAME"):
            problems.append(f"{where}: TESSERA_TLS_SERVER_NAME without the TLS files")
        return
    if not all(files.values()):
        problems.append(f"{where}: mTLS half configured ({', '.join(k for k, v in files.items() if not v)} missing)")
        return
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    issued = {d["spec"]["secretName"] for d in docs if d["kind"] == "Certificate"}
    for key, path in files.items():
        mount = next((m for m in container.get("volumeMounts", [])
                      if path.startswith(m["mountPath"].rstrip("/") + "/")), None)
        secret = vols.get(mount["name"], {}).get("secret") if mount else None
        if not secret:
            problems.append(f"{where}: {key}={path} is not in a mounted Secret")
        elif not mount.get("readOnly"):
            problems.append(f"{where}: the Secret holding {key} is mounted writable")
        elif issued and secret["secretName"] not in issued:
            problems.append(f"{where}: Secret {secret['secretName']} ({key}) is not written by any Certificate")


def check_workload(doc, docs, config, problems):
    pod = doc["spec"]["template"]
    spec, labels = pod["spec"], pod["metadata"]["labels"]
    where = name(doc)
    psc = spec.get("securityContext", {})
    if spec.get("automountServiceAccountToken") is not False:
        problems.append(f"{where}: automountServiceAccountToken is not false")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc = c.get("securityContext", {})
        cw = f"{where} container {c['name']}"
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) and sc.get("runAsUser", psc.get("runAsUser", 0)) > 0):
            problems.append(f"{cw}: may run as root")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{cw}: root filesystem is writable")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{cw}: allows privilege escalation")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            problems.append(f"{cw}: does not drop all capabilities")
    for key in ("hostIPC", "hostPID", "hostNetwork"):
        if spec.get(key):
            problems.append(f"{where}: {key} is set")
    for c in spec.get("initContainers", []) + spec["containers"]:
        check_env_references(f"{where} container {c['name']}", c, problems)
        if c["name"] in ROLES:
            check_tls(f"{where} container {c['name']}", spec, c, docs, problems)
    for c in spec["containers"]:
        cw = f"{where} container {c['name']}"
        for probe in ("livenessProbe", "readinessProbe"):
            if probe not in c:
                problems.append(f"{cw}: no {probe}")
        drain = env_value(c, "TESSERA_DRAIN_TIMEOUT_S")
        if c.get("image", "").split("/")[-1].startswith("tessera"):
            if drain is None:
                problems.append(f"{cw}: no literal TESSERA_DRAIN_TIMEOUT_S to match the grace period against")
            else:
                need = prestop_sleep_s(c) + int(drain) + GRACE_MARGIN_S
                grace = spec.get("terminationGracePeriodSeconds", 30)
                if grace < need:
                    problems.append(f"{cw}: terminationGracePeriodSeconds {grace} < preStop {prestop_sleep_s(c)} s "
                                    f"+ drain {drain} s + {GRACE_MARGIN_S} s")
        gpus = int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        if gpus:
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            shm = vols.get(mounts.get("/dev/shm"), {})
            if shm.get("emptyDir", {}).get("medium") != "Memory":
                problems.append(f"{cw}: GPU worker without a memory-backed /dev/shm (NCCL needs it)")
            per_pod = int(env_value(c, "TESSERA_GPUS") or 1)
            if per_pod != gpus:
                problems.append(f"{cw}: {gpus} GPUs requested but TESSERA_GPUS={per_pod} worker processes")
            ranks = int(config.get("TESSERA_TP", 1)) * int(config.get("TESSERA_PP", 1))
            total = per_pod * doc["spec"].get("replicas", 1)
            if total % ranks:
                problems.append(f"{where}: {total} GPU workers do not fill replicas of TP x PP = {ranks} ranks")
    ns = doc["metadata"].get("namespace")
    if not ns:
        problems.append(f"{where}: no namespace")
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget" and selects(d["spec"]["selector"].get("matchLabels"), labels)]
    if not pdbs:
        problems.append(f"{where}: no PodDisruptionBudget selects its pods")
    nps = [d for d in docs if d["kind"] == "NetworkPolicy" and selects(d["spec"]["podSelector"].get("matchLabels"), labels)]
    if not nps:
        problems.append(f"{where}: no NetworkPolicy selects its pods")


def check_custom(docs, problems):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    for d in docs:
        if d["kind"] == "ScaledObject":
            target = d["spec"]["scaleTargetRef"]["name"]
            if target not in by_kind.get("Deployment", {}):
                problems.append(f"{name(d)}: scales Deployment {target}, which is not rendered")
            for t in d["spec"]["triggers"]:
                if "tessera:num_requests_waiting" not in t.get("metadata", {}).get("query", ""):
                    problems.append(f"{name(d)}: a trigger does not read tessera:num_requests_waiting")
        if d["kind"] == "Certificate":
            ref = d["spec"]["issuerRef"]
            if ref.get("kind", "Issuer") == "Issuer" and ref["name"] not in by_kind.get("Issuer", {}):
                problems.append(f"{name(d)}: issued by Issuer {ref['name']}, which is not rendered")
        if d["kind"] == "PrometheusRule":
            if d["spec"]["groups"] != yaml.safe_load(ALERT_RULES.read_text())["groups"]:
                problems.append(f"{name(d)}: its groups differ from {ALERT_RULES.name}; copy them again")
        if d["kind"] == "ServiceMonitor":
            services = [s for s in by_kind.get("Service", {}).values()
                        if selects(d["spec"]["selector"]["matchLabels"], s["metadata"].get("labels", {}))]
            if len(services) != 1:
                problems.append(f"{name(d)}: selects {len(services)} Services, expected 1")
                continue
            ports = {p.get("name") for p in services[0]["spec"]["ports"]}
            for ep in d["spec"]["endpoints"]:
                if ep["port"] not in ports:
                    problems.append(f"{name(d)}: port {ep['port']} is not a port of Service {name(services[0])}")


def check_file(path):
    problems = []
    docs = load(path)
    check_schemas(docs, problems)
    config = next((d.get("data", {}) for d in docs
                   if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("tessera-config")), {})
    for d in docs:
        if d["kind"] in WORKLOAD_KINDS:
            check_workload(d, docs, config, problems)
    check_custom(docs, problems)
    kinds = {d["kind"] for d in docs}
    for needed in ("Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor",
                   "PrometheusRule", "ScaledObject"):
        if needed not in kinds:
            problems.append(f"no {needed} rendered")
    return len(docs), problems


def main(paths):
    failed = False
    for path in paths:
        n, problems = check_file(path)
        for p in problems:
            print(f"{path}: {p}")
        failed |= bool(problems)
        if not problems:
            print(f"{path}: {n} resources valid for Kubernetes {' and '.join(VERSIONS)} "
                  f"(custom resources {', '.join(sorted(k for _, k in CUSTOM_KINDS))} checked without a schema)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
