"""Helpers shared by the end-to-end tests: starting and stopping a `tessera serve` cluster
(its own process group, so teardown can prove nothing it started is left), reading
/metrics, reading raw SSE streams, and checking OpenAI's error shape.

The cluster runs as separate processes (workers, coordinator, gateway) joined by gRPC,
exactly as `tessera serve` starts them; the tests only ever talk HTTP to the gateway.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import openai
import requests

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
READY_TIMEOUT_S = 120.0
# Ids that end a SmolLM2 sequence: <|im_end|> (the GGUF's EOS) and <|endoftext|>.
EOG_IDS = (2, 0)


def tessera_bin() -> Path:
    path = Path(os.environ.get("TESSERA_BIN", REPO / "target" / "release" / "tessera"))
    if not path.is_file():
        raise RuntimeError(f"no tessera binary at {path}: run `cargo build --release` or set TESSERA_BIN")
    return path


def model_path() -> str:
    """TESSERA_MODEL_PATH, else the default model (`tessera fetch-model` prints its path)."""
    path = os.environ.get("TESSERA_MODEL_PATH")
    if not path:
        out = subprocess.run([str(tessera_bin()), "fetch-model"], check=True, capture_output=True, text=True)
        path = out.stdout.strip().splitlines()[-1]
    if not Path(path).is_file():
        raise RuntimeError(f"model file {path!r} does not exist")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """One running `tessera serve`: its base URL and the process group to stop."""

    def __init__(self, name: str, log_dir: Path, coordinator_args: str = "", gateway_args: str = "",
                 serve_args: tuple = ()):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.api_key = None
        for flag, value in zip(gateway_args.split(), gateway_args.split()[1:]):
            if flag == "--api-key":
                self.api_key = value.split(",")[0]
        last_error = None
        # The port is free when picked but could be taken before the gateway binds it.
        for _ in range(3):
            self.port = free_port()
            self.base = f"http://127.0.0.1:{self.port}"
            cmd = [str(tessera_bin()), "serve", "--port", str(self.port), "--model", model_path(), "--workers", "1",
                   *serve_args]
            # `--flag=value`: clap would take a separate value that starts with "--" for a flag.
            if coordinator_args:
                cmd.append(f"--coordinator-args={coordinator_args}")
            if gateway_args:
                cmd.append(f"--gateway-args={gateway_args}")
            self.log = open(self.log_path, "ab")
            # Its own session and process group: every worker, the coordinator and the
            # gateway inherit it, so teardown can signal (and check) them all at once.
            self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, cwd=REPO)
            self.pgid = self.proc.pid
            try:
                self._wait_ready()
                return
            except RuntimeError as e:
                last_error = e
                self.stop()
        raise RuntimeError(f"cluster {name} did not start: {last_error}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"`tessera serve` exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url("/ready"), timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready after {READY_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def stop(self) -> list[str]:
        """SIGTERM to the whole group (serve drains its children), SIGKILL to whatever is
        left after a grace period. Returns what had to be killed (empty when the SIGTERM
        was enough)."""
        leftovers = []
        if self.group_alive():
            os.killpg(self.pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            leftovers.append(f"serve (pid {self.proc.pid}) ignored SIGTERM for 20 s")
        deadline = time.monotonic() + 10
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.group_alive():
            leftovers.append(f"processes of group {self.pgid} outlived SIGTERM")
            os.killpg(self.pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            deadline = time.monotonic() + 5
            while self.group_alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        self.log.close()
        return leftovers

    def url(self, path: str) -> str:
        return self.base + path

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        # No retries: a 429/5xx must reach the test, not be papered over by the client.
        kw.setdefault("api_key", self.api_key or "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.url("/v1"), **kw)

    def post(self, path: str, body, **kw) -> requests.Response:
        headers = {**self.headers(), **kw.pop("headers", {})}
        kw.setdefault("timeout", 120)
        if isinstance(body, (bytes, str)):
            return requests.post(self.url(path), data=body, headers={"Content-Type": "application/json", **headers}, **kw)
        return requests.post(self.url(path), json=body, headers=headers, **kw)

    def tokenize(self, text: str, special: bool = False) -> list[int]:
        r = self.post("/tokenize", {"prompt": text, "add_special_tokens": special})
        r.raise_for_status()
        return r.json()["tokens"]

    def metrics(self) -> dict[str, float]:
        r = requests.get(self.url("/metrics"), timeout=10)
        r.raise_for_status()
        return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format, samples without labels only (all Tessera exports)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.strip()] = float(value)
    return out


def sse_events(response: requests.Response):
    """The `data:` payloads of a raw SSE response, decoded; stops at `[DONE]`.

    Lines are split as bytes and decoded as UTF-8 (SSE's encoding): `text/event-stream`
    carries no charset, so requests would decode it as ISO-8859-1, where the byte 0x85 of
    a UTF-8 character (e.g. the second byte of "Å") is NEL, a line break to `splitlines`."""
    for raw in response.iter_lines():
        line = raw.decode("utf-8")
        if not line or not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def assert_openai_error(response: requests.Response, status: int, param="<any>", code="<any>", error_type=None):
    """The status and OpenAI's body `{"error": {"message", "type", "param", "code"}}`."""
    assert response.status_code == status, f"expected {status}, got {response.status_code}: {response.text[:500]}"
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if error_type is not None:
        assert err["type"] == error_type, err
    if param != "<any>":
        assert err["param"] == param, err
    if code != "<any>":
        assert err["code"] == code, err
    return err


def greedy_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    """A greedy answer: a chat turn when `prompt` ends with a period, else a completion."""
    if prompt.endswith("."):
        r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def worker_pids(cluster: "Cluster") -> list[int]:
    """The `tessera worker` processes of a cluster's process group."""
    out = subprocess.run(["pgrep", "-g", str(cluster.pgid), "-f", "tessera worker"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


class Stream:
    """One streamed completion read on its own thread: its text so far, how it ended
    (`"done"`: [DONE] after a finish_reason; `"error"`: an error event; `"http <code>"`;
    `"broken: ..."`: the connection failed) and when (time.monotonic())."""

    def __init__(self, cluster: "Cluster", body: dict, timeout: float = 120):
        import threading
        self.text, self.tokens_seen, self.finish_reason, self.error = "", 0, None, None
        self.ended, self.ended_at = None, None
        self._thread = threading.Thread(target=self._run, args=(cluster, {**body, "stream": True}, timeout),
                                        daemon=True)
        self._thread.start()

    def _run(self, cluster, body, timeout):
        try:
            with requests.post(cluster.url("/v1/completions"), json=body, headers=cluster.headers(), stream=True,
                               timeout=timeout) as r:
                if r.status_code != 200:
                    self.ended = f"http {r.status_code}"
                    return
                done = False
                for event in sse_events(r):
                    if "error" in event:
                        self.error = event["error"]
                        self.ended = "error"
                        return
                    for choice in event.get("choices", []):
                        self.text += choice.get("text") or ""
                        self.tokens_seen += 1
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                else:
                    done = True
                self.ended = "done" if done and self.finish_reason else "broken: no [DONE] after a finish_reason"
        except requests.RequestException as e:
            self.ended = f"broken: {e}"
        finally:
            self.ended_at = time.monotonic()

    def join(self, timeout: float) -> bool:
        """Waits for the end; False if the stream is still open after `timeout` s."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def wait_until(predicate, timeout: float, what: str, period: float = 0.05):
    """Polls `predicate` until it is truthy; fails the test after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def admin_addresses(cluster: "Cluster") -> dict[str, list[str]]:
    """The admin endpoints (`/health`, `/ready`, `/metrics`) the cluster's coordinator and
    workers announced on stdout (`tessera <role> admin on ADDR`), by role, in the order they
    were printed (a restarted process appears again, later)."""
    import re
    cluster.log.flush()
    found: dict[str, list[str]] = {}
    for m in re.finditer(r"tessera (\w+) admin on (\S+)", cluster.log_path.read_text(errors="replace")):
        found.setdefault(m.group(1), []).append(m.group(2))
    return found


def scrape(url: str) -> str:
    """The Prometheus text of one `/metrics` endpoint (a full URL)."""
    r = requests.get(url, timeout=10)
    r.raise_for_status()
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    return r.text


def metric_families(text: str) -> dict[str, str]:
    """The metric names a Prometheus text declares (`# TYPE name kind`), with their kinds."""
    out = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out[name] = kind
    return out
