"""Tests deploy/docker/tessera-node-workers (the GPU pods' launcher) with a stand-in
`tessera` that records how it was started: worker i gets cuda:i, port 50061+i, admin port
9090+i and advertises HOST:port; SIGTERM stops every worker and the launcher exits 0; a
worker that dies on its own stops the others and the launcher exits non-zero; a GPU count
outside 1-9 (ids would no longer sort by GPU) is refused.

Usage: python launcher.py PATH/TO/tessera-node-workers
"""
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAKE = """#!/bin/sh
out="$FAKE_DIR/$TESSERA_DEVICE"
echo "$* $TESSERA_DEVICE $TESSERA_WORKER_LISTEN $TESSERA_ADVERTISE_ADDR $TESSERA_ADMIN_LISTEN" > "$out.started"
trap 'echo term > "$out.stopped"; exit 0' TERM
if [ "$TESSERA_DEVICE" = "$FAKE_DIE" ]; then sleep 1; exit 3; fi
while :; do sleep 0.1; done
"""


def run(launcher, tmp, gpus, die=""):
    fake = tmp / "tessera"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {**os.environ, "TESSERA_GPUS": str(gpus), "TESSERA_ADVERTISE_HOST": "node-3.workers.ns.svc",
           "TESSERA_BIN": str(fake), "FAKE_DIR": str(tmp), "FAKE_DIE": die}
    return subprocess.Popen(["sh", launcher], env=env, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def main(launcher):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        p = run(launcher, tmp, 3)
        wait_for(lambda: len(list(tmp.glob("*.started"))) == 3, 10, "3 workers to start")
        for i in range(3):
            got = (tmp / f"cuda:{i}.started").read_text().split()
            want = ["worker", f"cuda:{i}", f"0.0.0.0:{50061 + i}", f"node-3.workers.ns.svc:{50061 + i}",
                    f"0.0.0.0:{9090 + i}"]
            assert got == want, f"worker {i} started as {got}, expected {want}"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=10) == 0, f"SIGTERM: exit {p.returncode}, {p.stderr.read()}"
        assert len(list(tmp.glob("*.stopped"))) == 3, "SIGTERM did not reach every worker"

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        p = run(launcher, tmp, 3, die="cuda:1")
        code = p.wait(timeout=15)
        assert code != 0, "a worker died and the launcher exited 0"
        stopped = sorted(f.name for f in tmp.glob("*.stopped"))
        assert stopped == ["cuda:0.stopped", "cuda:2.stopped"], f"survivors not stopped: {stopped}"

    with tempfile.TemporaryDirectory() as d:
        p = run(launcher, Path(d), 10)
        assert p.wait(timeout=5) == 2 and "1-9" in p.stderr.read(), "10 GPUs accepted"
    print(f"{launcher}: starts one worker per GPU, stops them together")


if __name__ == "__main__":
    main(sys.argv[1])
