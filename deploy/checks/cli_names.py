"""Checks that the deployment files configure Tessera with names the binary knows: every
`TESSERA_*` / `OTEL_*` environment variable and every `--flag` that deploy/ hands a role
must appear in that role's `tessera ROLE --help` (a misspelt variable is silently
ignored, so nothing else would catch it). Variables only the deployment itself reads
(the GPU launcher's, and the parts the manifests build addresses from) are listed below.

Where the role is known, the name must belong to it: a Kubernetes container named after
its role, a compose service by its command, a systemd unit by its ExecStart, the GPU
launcher's variables for the worker. The shared settings (the tessera-config ConfigMap,
compose's x-tessera-env, systemd's tessera.env) must each be read by some role.

Usage: python cli_names.py TESSERA_BINARY RENDERED.yaml...
"""
import re
import subprocess
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1]
ROLES = ("worker", "coordinator", "gateway")
# Read by deploy/docker/tessera-node-workers or used to build other values in the manifests.
DEPLOYMENT_ONLY = {"TESSERA_GPUS", "TESSERA_ADVERTISE_HOST", "TESSERA_WORKER_SERVICE", "TESSERA_BIN",
                   "TESSERA_WORKER_BASE_PORT", "TESSERA_ADMIN_BASE_PORT"}
# What the launcher sets for each worker it starts.
LAUNCHER_SETS = {"TESSERA_DEVICE", "TESSERA_WORKER_LISTEN", "TESSERA_ADVERTISE_ADDR", "TESSERA_ADMIN_LISTEN"}
OURS = re.compile(r"^(TESSERA_|OTEL_)")


def cli(binary):
    """Per role: (environment variable names, long flag names) from its --help."""
    out = {}
    for role in ROLES:
        text = subprocess.run([binary, role, "--help"], capture_output=True, text=True, check=True).stdout
        out[role] = (set(re.findall(r"\[env: ([A-Z0-9_]+)=", text)), set(re.findall(r"(--[a-z0-9-]+)", text)))
    return out


def check(where, role, env_names, flags, known, problems):
    for e in env_names:
        if not OURS.match(e) or e in DEPLOYMENT_ONLY:
            continue
        roles = [role] if role else list(ROLES)
        if not any(e in known[r][0] for r in roles):
            problems.append(f"{where}: {e} is not an environment variable of tessera {' or '.join(roles)}")
    for f in flags:
        roles = [role] if role else list(ROLES)
        if not any(f in known[r][1] for r in roles):
            problems.append(f"{where}: {f} is not a flag of tessera {' or '.join(roles)}")


def main(binary, *rendered):
    known = cli(binary)
    problems, n = [], 0
    for path in rendered:
        for doc in yaml.safe_load_all(Path(path).read_text()):
            if not doc:
                continue
            if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].startswith("tessera-config"):
                check(f"{path} ConfigMap", None, doc["data"], [], known, problems)
                n += len(doc["data"])
            if doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c["name"] not in ROLES:
                    continue
                env = [e["name"] for e in c.get("env", [])]
                flags = [a for a in c.get("args", []) if a.startswith("--")]
                check(f"{path} {doc['kind']}/{doc['metadata']['name']}", c["name"], env, flags, known, problems)
                n += len(env) + len(flags)
    compose = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    shared = compose.get("x-tessera-env", {})
    check("compose x-tessera-env", None, shared, [], known, problems)
    for name, svc in compose["services"].items():
        if "build" in svc:
            own = [k for k, v in svc["environment"].items() if shared.get(k) != v]
            check(f"compose service {name}", svc["command"][0], own, [], known, problems)
            n += len(own)
    for unit in sorted((DEPLOY / "systemd").glob("*.service")):
        text = unit.read_text()
        m = re.search(r"^ExecStart=\S+ (\w+) (.*)$", text, re.M)
        role, args = m.group(1), m.group(2)
        flags = re.findall(r"(--[a-z0-9-]+)", args)
        env = re.findall(r"^Environment=([A-Z0-9_]+)=", text, re.M)
        check(f"systemd {unit.name}", role, env, flags, known, problems)
        n += len(flags) + len(env)
    env_file = re.findall(r"^([A-Z0-9_]+)=", (DEPLOY / "systemd" / "tessera.env").read_text(), re.M)
    env_file += re.findall(r"^([A-Z0-9_]+)=", (DEPLOY / "systemd" / "gateway.env").read_text(), re.M)
    check("systemd environment files", None, env_file, [], known, problems)
    launcher = (DEPLOY / "docker" / "tessera-node-workers").read_text()
    set_there = set(re.findall(r"^\s+(TESSERA_[A-Z0-9_]+)=", launcher, re.M))
    if set_there != LAUNCHER_SETS:
        problems.append(f"tessera-node-workers sets {sorted(set_there)}, expected {sorted(LAUNCHER_SETS)}")
    check("tessera-node-workers", "worker", set_there, [], known, problems)
    n += len(env_file) + len(set_there)
    for p in problems:
        print(p)
    if problems:
        return 1
    print(f"{n} settings in deploy/ are names `tessera ROLE --help` knows")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
