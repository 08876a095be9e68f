"""Tests of ``python -m jax_moe_comm.launch`` on the CPU platform (loopback only, no GPU).

The launcher and its workers run as real subprocesses; the worker script is tests/launch_child.py.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import CHILD_CWD, PACKAGE_HOME

from jax_moe_comm.launch import LaunchError, parse_args

REPO = Path(__file__).resolve().parent.parent
CHILD = str(REPO / "tests" / "launch_child.py")
TIMEOUT_S = 30


def _env() -> dict[str, str]:
    """Our environment minus anything that would leak into the workers (conftest's XLA_FLAGS, an outer launch)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_HOME), str(REPO / "tests")])
    return env


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "jax_moe_comm.launch", *args]


def _run(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_launcher(*args), env=_env(), cwd=CHILD_CWD, capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_two_cpu_processes_allgather() -> None:
    r = _run("-n", "2", "--cpu", "--", CHILD, "allgather", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    out = _lines(r.stdout)
    # A real cross-process collective (gloo on CPU): each rank sees both process indices.
    assert "[rank 0] OK process 0/2 gathered=[0, 1]" in out
    assert "[rank 1] OK process 1/2 gathered=[0, 1]" in out
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in out), out
    err = _lines(r.stderr)
    assert "[rank 0] stderr line from 0" in err
    assert "[rank 1] stderr line from 1" in err


def test_host_gather_and_from_process_0_move_values_through_the_key_value_store() -> None:
    """launch.host_gather gives every process the global value of a sharded array (no XLA collective: processes
    sharing a GPU cannot run one), and from_process_0 process 0's value."""
    r = _run("-n", "2", "--cpu", "--", CHILD, "host_gather")
    assert r.returncode == 0, r.stdout + r.stderr
    out = _lines(r.stdout)
    for rank in (0, 1):
        assert f"[rank {rank}] OK process {rank} gathered (4, 3) chosen=[0, 'from 0']" in out, r.stdout + r.stderr


@pytest.mark.parametrize("failure", [[], ["trees"]], ids=["one process's value raises", "the processes' trees differ"])
def test_host_gather_raises_on_every_process_instead_of_waiting_or_mixing_leaves(failure) -> None:
    """A value that raises on one process (a device error) raises in host_gather on every process, the failed
    process's error named, instead of leaving the others waiting for its piece; processes that pass different trees
    get a ValueError naming each one's leaf, not each other's pieces pasted into the wrong array."""
    r = _run("-n", "2", "--cpu", "--", CHILD, "host_gather_failure", *failure)
    assert r.returncode == 0, r.stdout + r.stderr
    out = _lines(r.stdout)
    for rank in (0, 1):
        assert f"[rank {rank}] OK process {rank} raised: True" in out, r.stdout + r.stderr


def test_two_nodes_one_process_each() -> None:
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            _launcher("--nnodes", "2", "--node-rank", str(node), "-n", "1", "--coordinator", coordinator, "--cpu",
                      "--", CHILD, "allgather", "2"),
            env=_env(), cwd=CHILD_CWD, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    try:
        results = [p.communicate(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for node, (p, (out, err)) in enumerate(zip(procs, results, strict=True)):
        assert p.returncode == 0, out + err
        assert f"[rank {node}] OK process {node}/2 gathered=[0, 1]" in _lines(out)


def test_fail_fast() -> None:
    start = time.monotonic()
    r = _run("-n", "2", "--cpu", "--", CHILD, "fail")
    elapsed = time.monotonic() - start
    assert r.returncode == 3, r.stdout + r.stderr
    assert elapsed < 10, elapsed
    assert "[rank 1] rank 1 failing" in _lines(r.stdout)
    assert "rank 1 exited with status 3" in r.stderr


def test_the_runtimes_exit_warning_of_a_worker_that_succeeded_is_dropped() -> None:
    """JAX's GPU client logs a cancelled task watch as a successful process leaves the job (in every shutdown order
    tried on an H200): the launcher drops that block when it is a worker's last output and the worker exits 0."""
    r = _run("-n", "2", "--", CHILD, "exit_watch", "0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[rank 0] working" in _lines(r.stdout) and "[rank 1] working" in _lines(r.stdout)
    assert r.stderr.strip() == "", r.stderr


@pytest.mark.parametrize("status, more", [(3, False), (0, True)], ids=["worker failed", "output after it"])
def test_the_runtimes_exit_warning_is_kept_when_it_may_matter(status: int, more: bool) -> None:
    """A worker that failed, or output after the block (so not an exit), keeps it whole, every line prefixed."""
    r = _run("-n", "1", "--", CHILD, "exit_watch", str(status), *(["more"] if more else []))
    assert r.returncode == status, r.stdout + r.stderr
    err = r.stderr.splitlines()
    first = next(i for i, line in enumerate(err) if "WatchTasksAsync failed for task 0" in line)
    assert err[first].startswith("[rank 0] W1204"), err
    assert err[first + 1].startswith("[rank 0] Additional GRPC error information"), err
    assert err[first + 4] == "[rank 0] external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89", err
    if more:
        assert "[rank 0] more" in err, err


def test_environment_and_arguments() -> None:
    r = _run("-n", "2", "--cpu", "--", CHILD, "env", "a", "--", "-n", "b c")
    assert r.returncode == 0, r.stdout + r.stderr
    out = _lines(r.stdout)
    for rank in (0, 1):
        got = {line.split("=", 1)[0]: line.split("=", 1)[1] for line in out if line.startswith(f"[rank {rank}] ")}
        p = f"[rank {rank}] "
        assert got[p + "JAX_NUM_PROCESSES"] == "2"
        assert got[p + "JAX_PROCESS_ID"] == str(rank)
        assert got[p + "JAX_LOCAL_RANK"] == str(rank)
        assert got[p + "JAX_LOCAL_WORLD"] == "2"
        assert got[p + "JAX_COORDINATOR_ADDRESS"].startswith("127.0.0.1:")
        assert got[p + "JAX_PLATFORMS"] == "cpu"
        assert got[p + "CUDA_VISIBLE_DEVICES"] == "<unset>"
        assert got[p + "PYTHONUNBUFFERED"] == "1"
        assert got[p + "NVSHMEM_DISABLE_NVLS"] == "1"
        assert got[p + "NCCL_NVLS_ENABLE"] == "0"
        assert got[p + "TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert got[p + "args"] == "a -- -n b c"


def test_module_mode_and_gpu_assignment() -> None:
    # Without --cpu each worker gets one GPU, taken from the launcher's CUDA_VISIBLE_DEVICES when that is set.
    env = {**_env(), "CUDA_VISIBLE_DEVICES": "5,7"}
    r = subprocess.run(_launcher("--", "-m", "launch_child", "env"), env=env, cwd=CHILD_CWD, capture_output=True,
                       text=True, timeout=TIMEOUT_S)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = _lines(r.stdout)
    assert "[rank 0] CUDA_VISIBLE_DEVICES=5" in out
    assert "[rank 1] CUDA_VISIBLE_DEVICES=7" in out
    assert "[rank 1] JAX_LOCAL_WORLD=2" in out


def _start_sleepers() -> subprocess.Popen[str]:
    proc = subprocess.Popen(_launcher("-n", "2", "--cpu", "--", CHILD, "sleep"), env=_env(), cwd=CHILD_CWD,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout is not None
    for _ in range(2):
        assert "sleeping" in proc.stdout.readline()  # both workers are up
    return proc


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_is_forwarded(sig: signal.Signals) -> None:
    proc = _start_sleepers()
    try:
        start = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert time.monotonic() - start < 10
    assert proc.returncode == 128 + sig, err  # the workers died of the forwarded signal


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "2", "--cpu"], "no program to run"),
        (["-n", "2", "--cpu", "--"], "no program to run"),
        (["-n", "0", "--cpu", "--", CHILD], "-n must be >= 1"),
        (["-n", "two", "--cpu", "--", CHILD], "invalid int value"),
        (["-n", "2", "--cpu", "--", "does_not_exist.py"], "script not found"),
        (["-n", "2", "--cpu", "--", "-m"], "'-m' needs a module name"),
        (["--cpu", "--", CHILD], "--cpu needs -n"),
        (["-n", "1", "--nnodes", "2", "--cpu", "--", CHILD], "--coordinator HOST:PORT is required"),
        (["-n", "1", "--nnodes", "2", "--node-rank", "2", "--coordinator", "127.0.0.1:1", "--cpu", "--", CHILD],
         "--node-rank must be in [0, 2)"),
        (["-n", "1", "--coordinator", "localhost", "--cpu", "--", CHILD], "--coordinator must be HOST:PORT"),
    ],
)  # fmt: skip
def test_argument_errors(args: list[str], message: str) -> None:
    r = _run(*args)
    assert r.returncode != 0
    assert message in r.stderr, r.stderr
    assert "[rank" not in r.stdout + r.stderr  # nothing was started


def test_parse_args_double_dash_belongs_to_program() -> None:
    cfg = parse_args(["-n", "2", "--cpu", CHILD, "--", "x"])
    assert cfg.command == [CHILD, "--", "x"]
    assert parse_args(["-n", "2", "--cpu", "--", "-m", "pkg.mod", "--flag"]).command == ["-m", "pkg.mod", "--flag"]
    with pytest.raises(LaunchError, match="expected a script path"):
        parse_args(["-n", "2", "--cpu", "--", "--oops"])


def test_initialize_distributed_without_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax_moe_comm import launch

    for key in (launch.ENV_COORDINATOR, launch.ENV_PROCESS_ID, launch.ENV_NUM_PROCESSES):
        monkeypatch.delenv(key, raising=False)
    assert launch.initialize_distributed() == (0, 1)
    assert launch.initialize_distributed() == (0, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_pair(argv_of, env_of) -> list[str]:
    """Two worker processes started as a cluster starts them (no launcher), each with its own environment; their
    stdout lines, rank 0's first. Output goes to files, not pipes: a worker blocked on a full pipe that nobody reads
    would leave the other waiting for it in the job's collectives."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM_", "OMPI_"))}
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(f"{logs}/{i}.out", "w+"), open(f"{logs}/{i}.err", "w+")) for i in range(2)]
        procs = [subprocess.Popen([sys.executable, CHILD, *argv_of(i)], env={**base, "JAX_PLATFORMS": "cpu",
                                  "PYTHONPATH": str(PACKAGE_HOME), **env_of(i)}, stdout=out, stderr=err, text=True)
                 for i, (out, err) in enumerate(files)]
        try:
            deadline = time.time() + 120
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
        outs = []
        for p, (out, err) in zip(procs, files, strict=True):
            out.seek(0)
            err.seek(0)
            text, errors = out.read(), err.read()
            out.close()
            err.close()
            assert p.returncode == 0, f"exit {p.returncode}: {errors[-3000:]}"
            outs.append(text)
    return outs


def _ok_lines(out: str) -> list[str]:
    """The workers' "OK ..." reports. CPU jobs log through Gloo's C++ logger, which writes to the
    same stdout unsynchronized with Python's buffer, so a report may share its line with a log record."""
    return re.findall(r"OK process \d+/\d+ gathered=\[[\d, ]*\]", out)


def _job_with_a_free_port() -> int:
    """A job id whose coordinator port is free now. JAX derives the port from the job id (SLURM's, Open MPI's / 4096)
    as job % 4096 in the ephemeral range from 61440, where the system also picks ports for outgoing connections."""
    for _ in range(100):
        job = random.randrange(1, 2**20)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", job % 2**12 + 65536 - 2**12))
            except OSError:
                continue
        return job
    raise RuntimeError("no free port in 61440..65535")


@pytest.mark.parametrize("cluster", ["slurm", "ompi"])
def test_initialize_distributed_joins_a_cluster_jax_detects(cluster: str) -> None:
    """Under srun or mpirun (their environment as SLURM and Open MPI set it, on one host), each process gets its own
    id from the cluster and the job is one jax.distributed job."""
    job = _job_with_a_free_port()

    def env_of(i: int) -> dict[str, str]:
        if cluster == "slurm":
            return {"SLURM_JOB_ID": str(job), "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": "2",
                    "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i), "SLURM_STEP_NUM_NODES": "1"}
        return {"OMPI_MCA_orte_hnp_uri": f"{job * 4096}.0;tcp://127.0.0.1:34911", "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_RANK": str(i), "OMPI_COMM_WORLD_LOCAL_RANK": str(i)}

    outs = _run_pair(lambda i: ["allgather", "2"], env_of)
    assert [ok for out in outs for ok in _ok_lines(out)] == [
        "OK process 0/2 gathered=[0, 1]", "OK process 1/2 gathered=[0, 1]"]


def test_initialize_distributed_keeps_the_users_own_jax_distributed() -> None:
    """After the user's own jax.distributed.initialize(), every process gets JAX's process index, not (0, 1)."""
    address = f"127.0.0.1:{_free_port()}"
    outs = _run_pair(lambda i: ["own_init", "2", address, str(i)], lambda i: {})
    assert [ok for out in outs for ok in _ok_lines(out)] == [
        "OK process 0/2 gathered=[0, 1]", "OK process 1/2 gathered=[0, 1]"]
