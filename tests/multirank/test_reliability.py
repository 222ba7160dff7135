"""Ranks launched by hand (plain ``python -m adaptive_dist consensus`` processes with RANK,
WORLD_SIZE, MASTER_ADDR, ... set per process, as a multi-node launch does), on real gloo: every
way a job can fail ends every rank that is left with one line naming the problem, the documented
exit code (2 config/input, 3 divergence, 4 timeout/dead peer, 130 Ctrl-C), in bounded time."""
from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

import pytest

from multirank import HandLaunch, format_hand, launch_by_hand

pytestmark = pytest.mark.multirank

T = 3.0           # --timeout of these runs
SLACK = 5.0       # what a failure may take beyond the timeout (diagnosis grace + exit)
START_S = 60.0    # generous: importing torch on a loaded 2-core machine takes seconds


def _traces(d, rounds: int, ranks: int = 2):
    d.mkdir()
    for r in range(ranks):
        (d / f"rank{r}.jsonl").write_text('{"accept": [1, 2], "num_tokens": 8}\n' * rounds)
    return d


def _errors(res) -> list[str]:
    return [ln for ln in res.lines() if ln.startswith("[rank ")]


def _one_line_each(results, code: int) -> list[str]:
    """Every rank exited with ``code`` and printed exactly one line (no traceback); return
    the lines without their ``[rank R]`` prefix."""
    out = []
    for r in results:
        assert r.returncode == code, format_hand(results)
        assert "Traceback" not in r.stderr, format_hand(results)
        lines = _errors(r)
        assert len(lines) == 1 and lines[0].startswith(f"[rank {r.rank}] "), format_hand(results)
        out.append(lines[0].split("] ", 1)[1])
    return out


def test_ranks_started_with_different_flags_refuse_with_the_same_line(tmp_path):
    tr = str(_traces(tmp_path / "tr", 20))
    base = ["consensus", "--trace", tr]
    res = launch_by_hand([base + ["--timeout", "3", "--no-progress", "--out", str(tmp_path / "o")],
                          base + ["--timeout", "4", "--policy", "static"]], timeout=START_S)
    msgs = _one_line_each(res, 2)
    assert len(set(msgs)) == 1, msgs
    msg = msgs[0]
    assert msg.startswith("error: consensus: ranks were started with different settings")
    for part in ("--timeout (ranks [0] have 3.0, ranks [1] have 4.0)",
                 "--no-progress (ranks [0] have true, ranks [1] have false)",
                 "--out given (ranks [0] have true, ranks [1] have false)",
                 'policy (ranks [0] have "ema", ranks [1] have "static")'):
        assert part in msg, msg
    assert not (tmp_path / "o").exists()


def test_a_rank_whose_flags_do_not_parse_stops_every_rank_with_its_line(tmp_path):
    tr = str(_traces(tmp_path / "tr", 20))
    res = launch_by_hand([["consensus", "--trace", tr, "--timeout", "3"],
                          ["consensus", "--trace", tr, "--timeout", "nan"]], timeout=START_S)
    msgs = _one_line_each(res, 2)
    assert len(set(msgs)) == 1, msgs
    assert "rank(s) [1]: python -m adaptive_dist consensus: argument --timeout: 'nan'" in msgs[0]


def test_a_rank_that_never_joins_is_named_within_the_timeout(tmp_path):
    tr = str(_traces(tmp_path / "tr", 20))
    # rank 1 runs a command that never joins the job (it exits 0 at once)
    h = HandLaunch([["consensus", "--trace", tr, "--timeout", "3"], ["config"]])
    res = h.wait(timeout=START_S)
    assert res[1].returncode == 0
    lines = _errors(res[0])
    assert res[0].returncode == 4 and len(lines) == 1, format_hand(res)
    assert "start-up: rank(s) [1] of 2 did not join within 3 s" in lines[0]


@pytest.mark.parametrize("victim,transport", [(1, "shm"), (0, "shm"), (1, "doubling"),
                                               (0, "doubling")],
                         ids=["peer-shm", "store-host-shm", "peer-gloo", "store-host-gloo"])
def test_a_killed_rank_ends_the_survivor_within_the_timeout(tmp_path, victim, transport):
    """SIGKILL one rank mid-replay: the other exits 4 within --timeout plus a few seconds, with
    one line naming the problem (a silent peer, or rank 0 and its store gone), whether the
    round's reduction goes through shared memory (the default on one host) or gloo."""
    tr = str(_traces(tmp_path / "tr", 30_000))
    h = HandLaunch([["consensus", "--trace", tr, "--timeout", str(T)]] * 2,
                   env={"ADAPTIVE_DIST_CONSENSUS_TRANSPORT": transport})
    assert h.wait_for(0, "replay:", timeout=START_S), format_hand(h.wait(1))
    killed = h.kill(victim, signal.SIGKILL)
    res = h.wait(timeout=T + 30, since=killed)
    survivor = res[1 - victim]
    lines = _errors(survivor)
    assert survivor.returncode == 4 and len(lines) == 1, format_hand(res)
    assert survivor.elapsed < T + SLACK, format_hand(res)
    assert "Traceback" not in survivor.stderr
    assert lines[0].startswith(f"[rank {1 - victim}] CollectiveTimeoutError: ")
    if victim == 1:
        assert "rank(s) [1] did not answer" in lines[0] and "dead" in lines[0]
    else:
        assert "the rendezvous store is unreachable" in lines[0] and "rank 0" in lines[0]


def test_a_stopped_rank_ends_the_survivor_within_the_timeout(tmp_path):
    """SIGSTOP rank 1 mid-replay (alive, silent: its watchdog thread stops too): rank 0, waiting
    in the round's exchange through shared memory (no closed socket tells it anything), exits 4
    within --timeout plus a few seconds naming rank 1 as dead or frozen, as on gloo (the
    ``stall`` case of the test below)."""
    tr = str(_traces(tmp_path / "tr", 30_000))
    h = HandLaunch([["consensus", "--trace", tr, "--timeout", str(T)]] * 2,
                   env={"ADAPTIVE_DIST_CONSENSUS_TRANSPORT": "shm"})
    assert h.wait_for(0, "replay:", timeout=START_S), format_hand(h.wait(1))
    time.sleep(2.0)    # into the rounds (30 000 of them take longer than this)
    stopped = h.kill(1, signal.SIGSTOP)
    try:
        h.procs[0].wait(timeout=T + 20)
    except Exception:
        pass
    h.kill(1, signal.SIGKILL)
    res = h.wait(timeout=10, since=stopped)
    lines = _errors(res[0])
    assert res[0].returncode == 4 and len(lines) == 1, format_hand(res)
    assert res[0].elapsed < T + SLACK, format_hand(res)
    assert lines[0].startswith("[rank 0] CollectiveTimeoutError: ")
    assert "rank(s) [1] did not answer" in lines[0] and "frozen" in lines[0], lines[0]


@contextmanager
def _sigint(disposition):
    """Start processes with SIGINT at ``disposition`` (None: as this process has it): they
    inherit an ignored SIGINT as a background job of a non-interactive shell does."""
    if disposition is None:
        yield
        return
    assert threading.current_thread() is threading.main_thread(), "signal dispositions"
    previous = signal.signal(signal.SIGINT, disposition)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("started_with", [None, signal.SIG_IGN, signal.SIG_DFL],
                         ids=["as-launched", "sigint-ignored", "sigint-default"])
def test_ctrl_c_ends_every_rank_with_one_line_and_130(tmp_path, started_with):
    """Ctrl-C reaches every process of the job (one process group): no traceback per rank.
    Also when the ranks start with SIGINT ignored (``cmd &`` in a script, nohup, a test runner
    started that way): the commands install their handler themselves."""
    tr = str(_traces(tmp_path / "tr", 30_000))
    with _sigint(started_with):
        h = HandLaunch([["consensus", "--trace", tr, "--timeout", str(T)]] * 2)
    assert h.wait_for(0, "replay:", timeout=START_S), format_hand(h.wait(1))
    for rank in (0, 1):
        h.kill(rank, signal.SIGINT)
    msgs = _one_line_each(h.wait(timeout=30), 130)
    assert all(m == "interrupted (Ctrl-C): stopping" for m in msgs), msgs


def test_a_failed_write_at_the_end_fails_every_rank_with_the_same_line(tmp_path):
    tr = str(_traces(tmp_path / "tr", 30))
    res = launch_by_hand([["consensus", "--trace", tr, "--timeout", "3", "--no-progress",
                           "--out", "/dev/full"]] * 2, timeout=START_S)
    msgs = _one_line_each(res, 2)
    assert len(set(msgs)) == 1, msgs
    assert ("writing the outputs failed, the job failed on every rank: rank(s) [0]: --out "
            "'/dev/full': write failed with 0 of 60 lines complete") in msgs[0]


@pytest.mark.parametrize("mode,code", [("skip_op", 3), ("stall", 4)])
def test_a_collective_error_ends_every_rank_within_the_timeout(tmp_path, mode, code):
    """Rank 1 misbehaves at round 5 (skips a model collective: gloo waits until the timeout, then
    the logs name the divergence; or stalls outside the collectives); ended as the CLI ends a
    failure: every rank exits with the documented code (3 divergence, 4 timeout), having seen
    the failure within --timeout plus a few seconds."""
    import rank_jobs
    from multirank import format_results, run_ranks

    res = run_ranks(rank_jobs.divergence_exit_job, 2, mode, str(tmp_path), T, timeout=90,
                    check=False)
    assert [r.exitcode for r in res] == [code, code], format_results(res)
    for r in (0, 1):
        stamp = tmp_path / f"rank{r}"
        if stamp.exists():  # a rank ended by its watchdog thread writes none (it never returned)
            took = float(stamp.read_text())
            print(f"{mode}: rank {r} saw the failure after {took:.2f} s")
            assert took < T + SLACK, format_results(res)


def test_an_unusable_output_path_on_one_rank_stops_every_rank_before_the_replay(tmp_path):
    """Each rank checks the paths it writes at start-up (--record-dir on every rank); one bad
    path stops every rank with the same line, naming the flag and the rank, before any replay."""
    tr = str(_traces(tmp_path / "tr", 20))
    (tmp_path / "a_file").write_text("x")
    base = ["consensus", "--trace", tr, "--timeout", "3", "--no-progress", "--out",
            str(tmp_path / "out.jsonl")]
    res = launch_by_hand([base + ["--record-dir", str(tmp_path / "rec")],
                          base + ["--record-dir", str(tmp_path / "a_file")]], timeout=START_S)
    msgs = _one_line_each(res, 2)
    assert len(set(msgs)) == 1, msgs
    assert msgs[0] == (f"error: checking the output paths failed, start-up refused on every rank: "
                       f"rank(s) [1]: --record-dir '{tmp_path}/a_file' is a file, not a directory")
    assert not (tmp_path / "out.jsonl").exists() and res[0].stdout == ""
