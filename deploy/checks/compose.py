"""Checks deploy/docker/compose.yaml without a container engine: it parses, every file it
mounts exists, every image is pinned to a version tag, the Tessera services build from
the repository's Dockerfile, their grace period covers their drain timeout, and the
Prometheus config scrapes every Tessera service of the file by the name compose gives it.

Usage: python compose.py deploy/docker/compose.yaml
"""
import sys
from pathlib import Path

import yaml


def main(path):
    path = Path(path)
    doc = yaml.safe_load(path.read_text())
    problems = []
    services = doc["services"]
    for name, svc in services.items():
        image = svc.get("image", "")
        if ":" not in image or image.endswith(":latest"):
            problems.append(f"{name}: image {image!r} is not pinned to a tag")
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                if not (path.parent / src).exists():
                    problems.append(f"{name}: mounts {src}, which does not exist")
            elif src not in doc.get("volumes", {}):
                problems.append(f"{name}: volume {src} is not declared")
        if "build" in svc:
            b = svc["build"]
            if not (path.parent / b["context"] / b["dockerfile"]).is_file():
                problems.append(f"{name}: builds from a missing Dockerfile")
            drain = int(svc["environment"].get("TESSERA_DRAIN_TIMEOUT_S", 30))
            grace = int(svc["stop_grace_period"].rstrip("s"))
            if grace <= drain:
                problems.append(f"{name}: stop_grace_period {grace}s does not cover the {drain} s drain")
            if not svc.get("read_only") or str(svc.get("user", "0")).startswith("0"):
                problems.append(f"{name}: runs as root or on a writable root filesystem")
    prom = yaml.safe_load((path.parent / "../observability/prometheus.yml").read_text())
    targets = {t.split(":")[0] for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, svc in services.items():
        if "build" in svc and name not in targets:
            problems.append(f"{name}: not scraped by deploy/observability/prometheus.yml")
    for p in problems:
        print(f"{path}: {p}")
    if problems:
        return 1
    print(f"{path}: {len(services)} services; mounts, images, drain and scrape targets consistent")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
