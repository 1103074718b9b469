#!/usr/bin/env bash
# Checks everything in deploy/ that can be checked without a cluster, a GPU or a container
# engine (scripts/test runs it; scripts/setup installs kubectl, systemd-analyze and
# promtool). About a minute, most of it installing checkov the first time:
# - every overlay in deploy/k8s/overlays renders with `kubectl kustomize` and its
#   resources validate against the Kubernetes schemas and Tessera's own rules
#   (deploy/checks/manifests.py);
# - every TESSERA_* variable and --flag that deploy/ gives a role is one that role's
#   --help lists (deploy/checks/cli_names.py; needs target/release/tessera or TESSERA_BIN);
# - checkov finds nothing in the rendered manifests and the Dockerfile (each accepted
#   finding is skipped in place, with its reason);
# - promtool accepts the Prometheus config and alert rules, the alert rules' unit tests
#   pass, and the dashboard's queries are valid PromQL (deploy/checks/dashboard.py);
# - systemd-analyze verify accepts the units, with no warning, and their stop timeout
#   outlasts the drain timeout of tessera.env;
# - the GPU node launcher starts one worker per GPU and stops them on SIGTERM;
# - the compose file's mounts exist and its images are pinned.
# The metric names the dashboard and alerts use are compared with a running cluster's
# /metrics by tests/e2e/test_deploy_metrics.py.
set -euo pipefail
cd "$(dirname "$0")/.."
tools="$PWD/target/deploy-tools"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
step() { printf '\n== deploy check: %s\n' "$*"; }

# Python tools, in their own venv, reinstalled when deploy/requirements.txt changes.
venv="$tools/venv"
stamp="$venv/.requirements"
if ! cmp -s deploy/requirements.txt "$stamp" 2>/dev/null; then
    step "installing checkov and kubernetes-validate into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r deploy/requirements.txt
    cp deploy/requirements.txt "$stamp"
fi
py="$venv/bin/python"
promtool="$(command -v promtool || echo "$tools/bin/promtool")"
[ -x "$promtool" ] || { echo "deploy check: promtool not found (run scripts/setup)" >&2; exit 1; }
command -v kubectl >/dev/null || { echo "deploy check: kubectl not found (run scripts/setup)" >&2; exit 1; }

step "kubectl kustomize (kubectl $(kubectl version --client -o json 2>/dev/null | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p'))"
mkdir -p "$work/rendered"
for overlay in deploy/k8s/overlays/*/; do
    name="$(basename "$overlay")"
    # stderr: kustomize v5's deprecation notes for the fields that keep kubectl 1.20 working.
    if ! kubectl kustomize "$overlay" >"$work/rendered/$name.yaml" 2>"$work/$name.err"; then
        cat "$work/$name.err" >&2
        echo "deploy check: $overlay does not render" >&2
        exit 1
    fi
    echo "$overlay: $(grep -c '^kind:' "$work/rendered/$name.yaml") resources"
done

step "Kubernetes schemas and Tessera's manifest rules"
"$py" deploy/checks/manifests.py "$work"/rendered/*.yaml

step "settings against the binary's flags and environment variables"
bin="${TESSERA_BIN:-target/release/tessera}"
if [ -x "$bin" ]; then
    "$py" deploy/checks/cli_names.py "$bin" "$work"/rendered/*.yaml
else
    echo "skipped: no $bin (cargo build --release --bin tessera; scripts/test builds it first)"
fi

step "checkov (Kubernetes manifests, Dockerfile)"
"$venv/bin/checkov" --quiet --compact --skip-download --framework kubernetes -d "$work/rendered"
"$venv/bin/checkov" --quiet --compact --skip-download --framework dockerfile -d deploy/docker

step "promtool"
"$promtool" check config deploy/observability/prometheus.yml
"$promtool" check rules deploy/observability/tessera-alerts.yml
"$promtool" test rules deploy/observability/tessera-alerts.test.yml
"$py" deploy/checks/dashboard.py deploy/observability/grafana/tessera-dashboard.json "$promtool"

step "systemd-analyze verify"
# verify needs every ExecStart binary to exist: the copies point at a stand-in.
mkdir -p "$work/systemd"
cp deploy/systemd/*.service deploy/systemd/*.target "$work/systemd/"
printf '#!/bin/sh\nexit 0\n' >"$work/systemd/tessera"
chmod +x "$work/systemd/tessera"
sed -i "s#/usr/local/bin/tessera #$work/systemd/tessera #" "$work"/systemd/*.service
units=("$work/systemd/tessera-worker@0.service" "$work/systemd/tessera-worker@7.service")
for u in "$work"/systemd/*.service "$work"/systemd/*.target; do
    case "$u" in *@.service) ;; *) units+=("$u") ;; esac
done
# It prints unknown keys and bad values as warnings and still exits 0: any output fails.
if ! out="$(systemd-analyze verify --man=no "${units[@]}" 2>&1)" || [ -n "$out" ]; then
    echo "$out" >&2
    echo "deploy check: systemd-analyze verify rejects the units" >&2
    exit 1
fi
echo "${#units[@]} units verified"
# Stopping must outlast the drain, or systemd kills requests the drain would finish.
drain="$(sed -n 's/^TESSERA_DRAIN_TIMEOUT_S=//p' deploy/systemd/tessera.env)"
for u in deploy/systemd/*.service; do
    stop="$(sed -n 's/^TimeoutStopSec=//p' "$u")"
    if [ -z "$stop" ] || [ "$stop" -le "$((drain + 5))" ]; then
        echo "deploy check: $u: TimeoutStopSec=${stop:-unset} does not outlast the ${drain} s drain (+5 s)" >&2
        exit 1
    fi
done
echo "TimeoutStopSec of every unit outlasts TESSERA_DRAIN_TIMEOUT_S=$drain"

step "GPU node launcher (deploy/docker/tessera-node-workers)"
"$py" deploy/checks/launcher.py deploy/docker/tessera-node-workers

step "compose file"
"$py" deploy/checks/compose.py deploy/docker/compose.yaml

echo
echo "deploy check: all passed"
