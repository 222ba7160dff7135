"""`generate --dp 2` and `serve --dp 2` across two torchrun "nodes" on one host: two launchers,
`--nnodes 2 --nproc-per-node 1` each, so every rank has LOCAL_RANK 0 and LOCAL_WORLD_SIZE 1 while
RANK is 0 or 1 and WORLD_SIZE 2, as on two hosts. Greedy outputs (without speculation and
adaptive) equal one process's `generate --no-spec`; the serving sockets every rank advertises are
on the interface the job runs over (not the loopback a hostname may resolve to); the frontend runs
under node 0's launcher; a signal to the launchers ends every process of the job.
See docs/multinode.md."""
from __future__ import annotations

import concurrent.futures as cf
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest

from collectives import free_port
from scripts.bench.server_process import alive, descendants

pytestmark = pytest.mark.multirank

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 8
# (prompt, dp_rank pin): unpinned prompt i goes to replica i % 2
PROMPTS = [("def fib(n):", None), ("import os\n", 1), ("x = [", 0), ("class Foo:", None),
           ("while True:", 1)]
START_S = 150.0      # a launch on the shared 2-core machine: model load, agreement, warm-up
TIMEOUT = "20"       # --timeout of generate
SERVE_TIMEOUT = "5"  # --timeout of serve: a rank silent this long counts as dead


def _env(extra: Optional[dict] = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "GLOO_SOCKET_IFNAME")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(extra or {})}


def _ipv4(ifname: str) -> Optional[str]:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def _network_interface() -> Optional[tuple[str, str]]:
    """(name, IPv4 address) of an interface other than loopback, or None."""
    for _, name in socket.if_nameindex():
        addr = _ipv4(name)
        if addr is not None and not addr.startswith("127."):
            return name, addr
    return None


class TwoNodes:
    """Two torchrun launchers, node 0 and node 1, each in its own session; every process of
    the job is recorded while it runs (to prove nothing is left after a stop, and to kill
    everything in `close`)."""

    def __init__(self, rdzv: str, argv: list[str], master_addr: str = "127.0.0.1",
                 env: Optional[dict] = None) -> None:
        port = free_port()
        self.logs = [tempfile.NamedTemporaryFile("w+b", prefix=f"node{n}-", suffix=f".{k}")
                     for n in (0, 1) for k in ("out", "err")]
        self.procs: list[subprocess.Popen] = []
        for node in (0, 1):
            if rdzv == "static":
                rendezvous = ["--node-rank", str(node), "--master-addr", master_addr,
                              "--master-port", str(port)]
            else:
                rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint",
                              f"{master_addr}:{port}", "--rdzv-id", f"multinode-{port}"]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "1", *rendezvous, "-m", "adaptive_dist", *argv]
            self.procs.append(subprocess.Popen(
                cmd, cwd=REPO, env=_env(env), stdout=self.logs[2 * node],
                stderr=self.logs[2 * node + 1], start_new_session=True))
        self.tree: set[int] = {p.pid for p in self.procs}

    def record(self) -> set[int]:
        for p in self.procs:
            self.tree |= descendants(p.pid)
        return self.tree

    def stdout(self, node: int) -> str:
        return Path(self.logs[2 * node].name).read_text(errors="replace")

    def stderr(self, node: int) -> str:
        return Path(self.logs[2 * node + 1].name).read_text(errors="replace")

    def output(self) -> str:
        return "\n".join(f"--- node {n} (exit {self.procs[n].poll()})\nstdout: "
                         f"{self.stdout(n)[-1500:]}\nstderr: {self.stderr(n)[-4000:]}"
                         for n in (0, 1))

    def wait(self, timeout_s: float, nodes: tuple[int, ...] = (0, 1)) -> list[Optional[int]]:
        """The launchers' exit codes (None: still running after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(self.procs[n].poll() is None for n in nodes):
            self.record()
            time.sleep(0.1)
        return [p.poll() for p in self.procs]

    def left_behind(self, grace_s: float = 5.0) -> list[int]:
        deadline = time.monotonic() + grace_s
        while True:
            living = [pid for pid in sorted(self.tree) if alive(pid)]
            if not living or time.monotonic() > deadline:
                return living
            time.sleep(0.1)

    def close(self) -> None:
        self.record()
        for pid in self.tree:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in self.logs:
            f.close()


def _last_json(text: str) -> Optional[dict]:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def _prompts_file(directory: Path, pinned: bool) -> Path:
    path = directory / ("pinned.jsonl" if pinned else "plain.jsonl")
    path.write_text("".join(json.dumps({"prompt": p, **({"dp_rank": d} if pinned and d is not None
                                                         else {})}) + "\n" for p, d in PROMPTS))
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    """The prompts, some pinned to a DP replica (for the two-node runs)."""
    return _prompts_file(tmp_path_factory.mktemp("multinode"), pinned=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """One process's `generate --no-spec --json` outputs (text and token ids per prompt)."""
    plain = _prompts_file(tmp_path_factory.mktemp("reference"), pinned=False)
    proc = subprocess.run([sys.executable, "-m", "adaptive_dist", "generate", "--prompts",
                           str(plain), "--no-spec", "--max-new-tokens", str(MAX_NEW),
                           "--json"], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=START_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc.stdout)
    assert out is not None and len(out["outputs"]) == len(PROMPTS), proc.stdout[-2000:]
    assert all(len(o["token_ids"]) > 0 for o in out["outputs"])
    return out["outputs"]


@pytest.mark.parametrize("rdzv,mode", [("static", "--no-spec"), ("c10d", "--adaptive")])
def test_generate_on_two_nodes_equals_one_process(rdzv, mode, prompts_file, reference) -> None:
    nodes = TwoNodes(rdzv, ["generate", "--dp", "2", mode, "--prompts", str(prompts_file),
                            "--max-new-tokens", str(MAX_NEW), "--timeout", TIMEOUT, "--json"])
    try:
        codes = nodes.wait(START_S)
        assert codes == [0, 0], nodes.output()
        assert nodes.left_behind() == [], nodes.output()
        reports = [_last_json(nodes.stdout(n)) for n in (0, 1)]
        printed = [n for n in (0, 1) if reports[n] is not None]
        # rank 0 prints; the static rendezvous puts it on --node-rank 0, c10d on either node
        assert (printed == [0]) if rdzv == "static" else (len(printed) == 1), nodes.output()
        out = reports[printed[0]]
        assert (out["dp"], out["attn_tp"]) == (2, 1), out
        got = [(o["token_ids"], o["text"]) for o in out["outputs"]]
        assert got == [(o["token_ids"], o["text"]) for o in reference]
        for i, ((_, pin), o) in enumerate(zip(PROMPTS, out["outputs"])):
            assert o["dp_rank"] == (i % 2 if pin is None else pin), out["outputs"]
        assert [r["requests"] for r in out["dp_ranks"]] == [2, 3], out["dp_ranks"]
        if mode == "--adaptive":                       # speculation ran on both nodes
            assert all(r["mean_accept_length"] is not None for r in out["dp_ranks"]), out
    finally:
        nodes.close()


def _frontend_config(nodes: TwoNodes) -> tuple[dict, int]:
    """The frontend's configuration (its environment: nothing of it is on a command line)
    and which node's launcher it runs under."""
    for node, launcher in enumerate(nodes.procs):
        for pid in descendants(launcher.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"workers.server.frontend" in argv:
                prefix = b"ADAPTIVE_DIST_FRONTEND_CONFIG="
                return json.loads(next(e[len(prefix):] for e in env
                                       if e.startswith(prefix))), node
    raise AssertionError(f"no frontend process under either launcher:\n{nodes.output()}")


def _wait_healthy(nodes: TwoNodes, url: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        nodes.record()
        assert all(p.poll() is None for p in nodes.procs), nodes.output()
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                nodes.record()
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not ready in {START_S} s:\n{nodes.output()}")


NETWORK = _network_interface()


@pytest.mark.parametrize("network,stop", [
    ("master_addr", "sigterm_both"),         # MASTER_ADDR on the interface: the route to it
    ("master_addr", "sigint_node0"),         # node 1 follows
    ("gloo_socket_ifname", "sigint_node1"),  # MASTER_ADDR loopback, GLOO_SOCKET_IFNAME names it;
])                                           # node 0 follows (no 300 s in torchrun's exit barrier)
def test_serve_on_two_nodes_equals_one_process_and_stops_cleanly(network, stop,
                                                                  reference) -> None:
    if NETWORK is None:
        pytest.skip("this host has no network interface besides loopback")
    ifname, addr = NETWORK
    master, env = (addr, {}) if network == "master_addr" else ("127.0.0.1",
                                                              {"GLOO_SOCKET_IFNAME": ifname})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    nodes = TwoNodes("static", ["serve", "--dp", "2", "--adaptive", "--max-batch-size", "4",
                                "--max-model-len", "256", "--timeout", SERVE_TIMEOUT,
                                "--port", str(port)], master_addr=master, env=env)
    try:
        _wait_healthy(nodes, url)
        config, node = _frontend_config(nodes)
        assert node == 0, nodes.output()                 # spawned by rank 0, on node 0
        hosts = {a["address"].rsplit(":", 1)[0] for a in config["ranks"]}
        hosts.add(config["pull_address"].rsplit(":", 1)[0])
        assert hosts == {f"tcp://{addr}"}, config       # reachable from the other host

        def one(i: int) -> tuple[str, list[int]]:
            body = {"model": "tiny_pair", "prompt": PROMPTS[i][0], "max_tokens": MAX_NEW,
                    "temperature": 0, "return_token_ids": True, "dp_rank": i % 2}
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"], choice["token_ids"]

        with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, range(len(PROMPTS))))
        assert got == [(o["text"], o["token_ids"]) for o in reference]

        nodes.record()
        sig = signal.SIGTERM if stop == "sigterm_both" else signal.SIGINT
        signalled = {"sigterm_both": (0, 1), "sigint_node0": (0,), "sigint_node1": (1,)}[stop]
        start = time.monotonic()
        for n in signalled:
            nodes.procs[n].send_signal(sig)
        codes = nodes.wait(int(SERVE_TIMEOUT) + 25)
        assert None not in codes, (time.monotonic() - start, nodes.output())
        assert nodes.left_behind() == [], nodes.output()
        errs = [nodes.stderr(0), nodes.stderr(1)]
        assert any(f"[rank {n}] stopping: received {sig.name}" in errs[n] for n in signalled), \
            nodes.output()
        assert all(f"[rank {n}] stopping: " in errs[n] for n in (0, 1)), nodes.output()
        assert "[rank 0] the frontend exited (code 0)" in errs[0], nodes.output()
    finally:
        nodes.close()


def test_the_advertised_address_follows_the_job_s_network(monkeypatch) -> None:
    """`zmq_host` directly, in the environment each case of a launch sets: one node (loopback),
    nodes whose MASTER_ADDR is on an interface (that interface's address, not what the
    hostname resolves to), GLOO_SOCKET_IFNAME (its address), a name that is no interface."""
    from workers.server.launch import zmq_host

    for key in ("GLOO_SOCKET_IFNAME", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert zmq_host() == "127.0.0.1"                     # one node: LOCAL_WORLD_SIZE = WORLD_SIZE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert zmq_host() == "127.0.0.1"                     # two nodes on this host
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-if0")
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME='no-such-if0'"):
        zmq_host()
    if NETWORK is None:
        return
    ifname, addr = NETWORK
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", f"{ifname},lo")
    assert zmq_host() == addr
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", addr)
    assert zmq_host() == addr
