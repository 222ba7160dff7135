"""Start and stop a server as a real subprocess (the serving benchmarks and tests: ``scripts.bench.serve --launch``, ``scripts.bench.soak``).

``ServerProcess`` runs ``python -m adaptive_dist serve ...`` (or the same under
``torch.distributed.run`` for several ranks) on a free port, waits until ``/health`` answers 200,
records the whole process tree while it runs (so a test can prove nothing is left behind after
it stopped), and stops it with a signal.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence


def descendants(pid: int) -> set[int]:
    """Every live descendant of `pid` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class ServerProcess:
    """One server job: `nproc` ranks (torchrun when > 1) serving on `port`."""

    def __init__(self, args: Sequence[str], port: int, nproc: int = 1,
                 env: Optional[dict[str, str]] = None,
                 launcher_args: Sequence[str] = (),
                 open_files: Optional[int] = None) -> None:
        """`open_files`: the job's open-file limit (soft and hard), as `ulimit -n` would set
        it (None: this process's)."""
        self.port, self.nproc = port, nproc
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="serve-", suffix=".log", delete=False)
        if nproc == 1:
            cmd = [sys.executable, "-m", "adaptive_dist", "serve"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                   "--master-port", str(_free_port()), *launcher_args,
                   "-m", "adaptive_dist", "serve"]
        cmd += ["--port", str(port), *args]
        limit = None
        if open_files is not None:
            def limit() -> None:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
                                     preexec_fn=limit)
        self.tree: set[int] = {self.proc.pid}

    def wait_ready(self, timeout_s: float = 120.0) -> "ServerProcess":
        """Block until /health is 200 (`RuntimeError` with the log if it exits or times out)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.record_tree()
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n"
                                   f"{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    self.record_tree()
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server was not ready in {timeout_s} s:\n{self.output()}")

    def record_tree(self) -> set[int]:
        """Add the job's current processes to `tree`; return them."""
        now = descendants(self.proc.pid) | {self.proc.pid}
        self.tree |= now
        return now

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def signal(self, sig: int = signal.SIGINT) -> None:
        self.record_tree()
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> Optional[int]:
        """The launch's exit code, or None if it still runs after `timeout_s`."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def left_behind(self, grace_s: float = 5.0) -> list[int]:
        """Processes of the job still alive `grace_s` after the launch exited."""
        deadline = time.monotonic() + grace_s
        while True:
            living = [p for p in sorted(self.tree) if alive(p)]
            if not living or time.monotonic() > deadline:
                return living
            time.sleep(0.1)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT, then SIGKILL to the whole tree if it does not end in time."""
        if self.proc.poll() is None:
            self.signal(signal.SIGINT)
            if self.wait_exit(timeout_s) is None:
                for pid in self.tree:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _free_port() -> int:
    from collectives import free_port

    return free_port()
