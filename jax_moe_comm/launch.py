"""Start one process per local GPU with ``jax.distributed`` wired up.

The NVSHMEM backend of jax_moe_comm needs exactly ONE GPU PER PROCESS. This module is the
launcher that gives you that layout, plus the one call a worker script makes to join the job.

Usage::

    python -m jax_moe_comm.launch [-n N] [--nnodes M --node-rank R --coordinator HOST:PORT] [--cpu] \\
        -- script.py args...
    python -m jax_moe_comm.launch -n 4 -- -m my_package.train --steps 10

Options:

``-n N``
    Processes on this node. Default: the number of local GPUs (the entries of ``CUDA_VISIBLE_DEVICES`` if it
    is set, else the lines of ``nvidia-smi -L``). Required with ``--cpu``.
``--nnodes M`` / ``--node-rank R``
    Multi-node jobs: run one launcher per node, each with the same ``N``, ``M`` and ``--coordinator``.
    Global process id = ``R * N + local_rank``; number of processes = ``M * N``.
``--coordinator HOST:PORT``
    Address of the ``jax.distributed`` coordinator (it runs inside global process 0, i.e. on node rank 0).
    Default with one node: ``127.0.0.1:<free port>``. Required with ``--nnodes > 1``.
``--cpu``
    Run the workers on the CPU platform (``JAX_PLATFORMS=cpu``) instead of one GPU each (tests, CI).
``--grace S``
    Seconds between SIGTERM and SIGKILL when the workers are torn down (default 5).

Every worker gets ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``, ``JAX_LOCAL_RANK``,
``JAX_LOCAL_WORLD``, ``PYTHONUNBUFFERED=1``, ``CUDA_VISIBLE_DEVICES=<its GPU>`` (not with ``--cpu``) and, unless
already set, ``NVSHMEM_DISABLE_NVLS=1``, ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``.
Its stdout and stderr lines come out of the launcher's stdout and stderr prefixed with ``[rank <process id>] ``,
but for one block: the warning JAX's GPU client logs as a process leaves the job (a cancelled watch of the job's
tasks), dropped when it is the last output of a worker that succeeded.

The worker script joins the job before touching any JAX device::

    from jax_moe_comm.launch import initialize_distributed

    process_id, num_processes = initialize_distributed()   # also under SLURM / Open MPI; (0, 1) alone

Checking results on the host without an XLA collective (which processes sharing one GPU cannot run):
``host_gather(tree)`` gives every process the global values, ``from_process_0(key, make)`` process 0's value.

Lifetime: SIGINT/SIGTERM sent to the launcher are forwarded to every worker. As soon as one worker exits with a
non-zero status the others get SIGTERM, then SIGKILL after the grace period, and the launcher exits with the
status of that first failure (128 + signal number for a worker killed by a signal). It exits 0 only if every
worker exited 0 (an interrupted launcher whose workers all exited 0 still exits 128 + the signal number).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import pickle
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["LaunchConfig", "LaunchError", "initialize_distributed", "launch", "main", "parse_args"]

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_RANK = "JAX_LOCAL_RANK"
ENV_LOCAL_WORLD = "JAX_LOCAL_WORLD"

# NVLink multicast (NVLS) must stay off on the machines we run on; these keep it off unless the user set them.
_SAFE_ENV_DEFAULTS = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
}

_POLL_S = 0.05
_PIPE_DRAIN_S = 2.0  # how long to wait for workers' output after they exited
_KILL_WAIT_S = 5.0  # how long to wait for workers to vanish after SIGKILL


class LaunchError(Exception):
    """Bad launcher arguments or environment; the message is meant for the user."""


# --------------------------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------------------------

_distributed: tuple[int, int] | None = None


def initialize_distributed() -> tuple[int, int]:
    """Joins the job this process belongs to; returns ``(process_id, num_processes)``. Call it before using any JAX
    device. Idempotent.

    In order: a ``jax.distributed`` the caller already initialized gives its own answer; the environment of
    ``python -m jax_moe_comm.launch`` (coordinator, process count and id) initializes it; a cluster that JAX detects
    (SLURM, Open MPI, Kubernetes, ...: ``jax.distributed.initialize()`` without arguments) initializes it. Otherwise
    (or once JAX's backends are in use: too late to join a job) this is a single-process job, ``(0, 1)``, and a
    warning says so when the process sees more than one GPU (the NVSHMEM backend needs one process per GPU).
    """
    global _distributed
    if _distributed is not None:
        return _distributed
    import jax

    if jax.distributed.is_initialized():
        _distributed = (jax.process_index(), jax.process_count())
        return _distributed
    env = os.environ
    if ENV_COORDINATOR in env and ENV_PROCESS_ID in env and ENV_NUM_PROCESSES in env:
        try:
            process_id, num_processes = int(env[ENV_PROCESS_ID]), int(env[ENV_NUM_PROCESSES])
        except ValueError as e:
            raise RuntimeError(f"malformed {ENV_PROCESS_ID}/{ENV_NUM_PROCESSES} in the environment: {e}") from None
        # cluster_detection_method="deactivate": everything is given explicitly, so SLURM/MPI variables inherited
        # from an outer job must not override it (e.g. local_device_ids, which CUDA_VISIBLE_DEVICES already fixes).
        jax.distributed.initialize(coordinator_address=env[ENV_COORDINATOR], num_processes=num_processes,
                                   process_id=process_id, cluster_detection_method="deactivate")
    else:
        try:
            jax.distributed.initialize()  # JAX's own cluster detection
        except (ValueError, RuntimeError) as e:
            # "no cluster found" (no coordinator), or JAX's backends already in use: a process alone.
            if "coordinator_address" not in str(e) and "must be called before" not in str(e):
                raise
            _distributed = (jax.process_index(), jax.process_count())
            _warn_if_one_process_drives_gpus()
            return _distributed
    _distributed = (jax.process_index(), jax.process_count())
    return _distributed


_KEY_VALUE_TIMEOUT_MS = 300_000
_host_gathers = itertools.count()  # the same sequence on every process


def host_gather(tree):
    """``tree`` with every array leaf as a NumPy array of its global value, on every process, moved through the
    jax.distributed key-value store instead of an XLA collective: processes that share one GPU cannot run one (NCCL
    refuses two ranks on one device), and results are checked on the host anyway. Every process calls it with the
    same trees in the same order. A leaf whose value raises on one process (a device error) raises on every process
    (the others: a JaxRuntimeError naming that process and its error), so none waits for the failed one. For checking
    and reporting, not for a training loop's data path."""
    import jax
    import numpy as np

    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [a for _, a in with_paths]
    if jax.process_count() == 1:
        return treedef.unflatten([np.asarray(a) for a in leaves])
    from jax._src import distributed  # the client of jax.distributed's key-value store; no public handle to it

    client = distributed.global_state.client
    call, me = next(_host_gathers), jax.process_index()
    out = []
    for i, a in enumerate(leaves):
        if not isinstance(a, jax.Array) or a.is_fully_addressable:
            out.append(np.asarray(a))
            continue
        key = f"jax_moe_comm/host_gather/{call}/{i}"
        try:
            pieces = [(shard.index, np.asarray(shard.data)) for shard in a.addressable_shards if shard.replica_id == 0]
        except Exception as exc:  # this process's value failed (a device error): every process raises, not waits
            client.key_value_set_bytes(f"{key}/{me}", pickle.dumps(f"{type(exc).__name__}: {exc}"))
            raise
        leaf = (jax.tree_util.keystr(with_paths[i][0]), a.shape, str(a.dtype))
        client.key_value_set_bytes(f"{key}/{me}", pickle.dumps((leaf, pieces)))
        full = np.zeros(a.shape, a.dtype)
        for process in range(jax.process_count()):
            got = pickle.loads(client.blocking_key_value_get_bytes(f"{key}/{process}", _KEY_VALUE_TIMEOUT_MS))
            if isinstance(got, str):
                raise jax.errors.JaxRuntimeError(f"host_gather: process {process}'s value raised {got}")
            theirs, pieces_there = got
            if theirs != leaf:  # the processes passed different trees (or leaves out of step): name both
                raise ValueError(f"host_gather: leaf {i} is {leaf} on process {me} but {theirs} on process {process}")
            for index, data in pieces_there:
                full[index] = data
        client.wait_at_barrier(f"{key}/read", _KEY_VALUE_TIMEOUT_MS)  # every process has read every piece
        client.key_value_delete(f"{key}/{me}")
        out.append(full)
    return treedef.unflatten(out)


def from_process_0(key: str, make: Callable[[], object]) -> object:
    """``make()`` as process 0 computed it, on every process (a JSON value, through the key-value store): the same seed
    or the same test cases everywhere without an XLA collective. ``key`` names this value in the job."""
    import jax

    if jax.process_count() == 1:
        return make()
    from jax._src import distributed

    client = distributed.global_state.client
    if jax.process_index() == 0:
        client.key_value_set(f"jax_moe_comm/from_process_0/{key}", json.dumps(make()))
    return json.loads(client.blocking_key_value_get(f"jax_moe_comm/from_process_0/{key}", _KEY_VALUE_TIMEOUT_MS))


def from_every_process(key: str, value: object) -> list:
    """Every process's ``value`` (a JSON value), in process order, on every process, through the key-value store: what
    each process saw (an error's text, a count) compared without an XLA collective. ``key`` names it in the job."""
    import jax

    if jax.process_count() == 1:
        return [value]
    from jax._src import distributed

    client = distributed.global_state.client
    client.key_value_set(f"jax_moe_comm/from_every_process/{key}/{jax.process_index()}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"jax_moe_comm/from_every_process/{key}/{process}",
                                                     _KEY_VALUE_TIMEOUT_MS))
            for process in range(jax.process_count())]


def _warn_if_one_process_drives_gpus() -> None:
    import jax

    if jax.default_backend() == "gpu" and jax.local_device_count() > 1:
        warnings.warn(f"jax_moe_comm: one process drives {jax.local_device_count()} GPUs and no multi-process job was "
                      "found (neither python -m jax_moe_comm.launch nor a cluster JAX detects: SLURM, Open MPI, "
                      "Kubernetes); the NVSHMEM backend needs one process per GPU, so backend='auto' will use the "
                      "reference backend", stacklevel=3)


# --------------------------------------------------------------------------------------------------------------
# Launcher side
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    command: list[str]  # argv after the interpreter: ["script.py", ...] or ["-m", "module", ...]
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    cpu: bool = False
    grace_s: float = 5.0
    devices: list[str] | None = None  # GPU id per local rank; None: str(local_rank)


def _visible_gpus() -> list[str] | None:
    """GPU ids this launcher may hand out: CUDA_VISIBLE_DEVICES entries if set, else ``nvidia-smi -L``."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return [d.strip() for d in cvd.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    count = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return [str(i) for i in range(count)]


def _free_port() -> int:
    """A port the coordinator can bind on every address. Drawn below Linux's ephemeral range (32768-60999): a
    port the kernel hands out with bind(0) can be taken again by an outgoing connection before the coordinator
    binds it (seen as "Address already in use" right after another job)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _check_coordinator(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"--coordinator must be HOST:PORT, got {address!r}")
    return address


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jax_moe_comm.launch",
        description="Start one process per local GPU (or N CPU processes) with jax.distributed wired up.",
        usage="%(prog)s [-n N] [--nnodes M --node-rank R --coordinator HOST:PORT] [--cpu] "
        "-- (script.py | -m module) [args...]",
    )
    p.add_argument(
        "-n",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=None,
        help="processes on this node (default: number of local GPUs)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (one launcher per node; default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="rank of this node, 0 <= R < nnodes (default 0)")
    p.add_argument(
        "--coordinator",
        default=None,
        help="HOST:PORT of the jax.distributed coordinator (default 127.0.0.1:<free port> on one node)",
    )
    p.add_argument("--cpu", action="store_true", help="run the workers on the CPU platform, no GPU assignment")
    p.add_argument("--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)")
    return p


def parse_args(argv: Sequence[str]) -> LaunchConfig:
    """Turn launcher argv into a validated :class:`LaunchConfig`; raises :class:`LaunchError` on bad input."""
    argv = list(argv)
    parser = _build_parser()
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    # The first "--" ends the launcher's options unless the program already started before it (then it is one of
    # the program's arguments). Splitting by hand keeps "--" handling independent of the Python version.
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    command = [*args.command, *argv[split:]] if args.command else argv[split + 1 :]

    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]  # "-- python -m mod" and "-- python3 script.py": workers use this interpreter
    if not command:
        raise LaunchError("no program to run; usage: ... -- script.py [args...]  or  ... -- -m module [args...]")
    if command[0] == "-m":
        if len(command) < 2 or not command[1] or command[1].startswith("-"):
            raise LaunchError("'-m' needs a module name: ... -- -m module [args...]")
    elif command[0].startswith("-"):
        raise LaunchError(f"expected a script path or '-m module' after '--', got {command[0]!r}")
    elif not os.path.isfile(command[0]):
        raise LaunchError(f"script not found: {command[0]}")

    if args.nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank must be in [0, {args.nnodes}), got {args.node_rank}")
    if args.grace < 0:
        raise LaunchError(f"--grace must be >= 0, got {args.grace}")
    coordinator = None if args.coordinator is None else _check_coordinator(args.coordinator)
    if coordinator is None and args.nnodes > 1:
        raise LaunchError("--coordinator HOST:PORT is required with --nnodes > 1 (use node rank 0's address)")

    devices: list[str] | None = None
    nproc = args.nproc
    if nproc is not None and nproc < 1:
        raise LaunchError(f"-n must be >= 1, got {nproc}")
    if args.cpu:
        if nproc is None:
            raise LaunchError("--cpu needs -n N (the number of processes to start)")
    else:
        gpus = _visible_gpus()
        if nproc is None:
            if not gpus:
                raise LaunchError("found no local GPU (CUDA_VISIBLE_DEVICES / nvidia-smi -L); pass -n N, or --cpu")
            nproc = len(gpus)
        if gpus:
            if nproc > len(gpus):
                raise LaunchError(
                    f"-n {nproc} but only {len(gpus)} GPU(s) visible ({','.join(gpus)}); "
                    "one GPU per process is required"
                )
            devices = gpus[:nproc]

    return LaunchConfig(
        command=command,
        nproc=nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        coordinator=coordinator,
        cpu=args.cpu,
        grace_s=args.grace,
        devices=devices,
    )


def child_env(cfg: LaunchConfig, coordinator: str, local_rank: int) -> dict[str, str]:
    """Environment of the worker with ``local_rank`` on this node: ours plus the job's wiring."""
    env = dict(os.environ)
    env.update(
        {
            ENV_COORDINATOR: coordinator,
            ENV_NUM_PROCESSES: str(cfg.nnodes * cfg.nproc),
            ENV_PROCESS_ID: str(cfg.node_rank * cfg.nproc + local_rank),
            ENV_LOCAL_RANK: str(local_rank),
            ENV_LOCAL_WORLD: str(cfg.nproc),
            "PYTHONUNBUFFERED": "1",
        }
    )
    for key, value in _SAFE_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if cfg.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = cfg.devices[local_rank] if cfg.devices else str(local_rank)
    return env


def _parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` (Linux) making the worker get SIGTERM if the launcher dies, e.g. from SIGKILL.

    ``prctl`` is looked up here, in the launcher, so the forked child only makes the call.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


# What JAX's GPU client logs when a process that succeeded leaves the job: its watch of the job's tasks is cancelled
# by the distributed runtime's shutdown (in every shutdown order), a warning and its gRPC details:
#   W... pjrt_client.cc:...] WatchTasksAsync failed for task 0: CANCELLED: CANCELLED  (or UNAVAILABLE: Cancelling ...)
#   Additional GRPC error information from remote target coordination_service while calling .../WatchTasks:
#   :CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']
#   === Source Location Trace: ===
#   external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89
# and a blank line. A worker's stderr holds such a block back; it is dropped when it is the last output of a worker
# that exits 0, and printed in any other case (more output after it, or a worker that failed).
_EXIT_WATCH_WARNING = b"WatchTasksAsync failed for task"
_EXIT_WATCH_DETAILS = (b"Additional GRPC error information", b":CANCELLED", b":UNAVAILABLE", b"=== Source Location",
                       b"external/")
_EXIT_WATCH_LINES = 8  # a longer block is something else


def _is_exit_watch_detail(line: bytes) -> bool:
    text = line.strip()
    return not text or text.startswith(_EXIT_WATCH_DETAILS)


def _pump(src: BinaryIO, dst: BinaryIO, prefix: bytes, lock: threading.Lock,
          exit_status: Callable[[], int] | None = None) -> None:
    """Copy ``src`` to ``dst`` line by line with ``prefix``, flushing each line. With ``exit_status`` (a worker's
    stderr; called once its output has ended), the runtime's warning at a clean exit is held back and dropped when
    the worker ends with it and succeeds (see _EXIT_WATCH_WARNING)."""
    held: list[bytes] = []

    def write(lines: list[bytes]) -> None:
        with lock:
            try:
                for line in lines:
                    dst.write(prefix + line)
                dst.flush()
            except (OSError, ValueError):
                pass  # our own stdout/stderr went away; keep draining so the worker never blocks on a full pipe

    try:
        for line in iter(src.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if exit_status is not None:
                if held and len(held) < _EXIT_WATCH_LINES and _is_exit_watch_detail(line):
                    held.append(line)
                    continue
                if held:
                    write(held)
                    held = []
                if _EXIT_WATCH_WARNING in line:
                    held = [line]
                    continue
            write([line])
        if held and exit_status() != 0:
            write(held)
    finally:
        src.close()


class _Workers:
    """The local worker processes: start, signal, poll, collect output."""

    def __init__(self, cfg: LaunchConfig, coordinator: str) -> None:
        self.cfg = cfg
        self.coordinator = coordinator
        self.procs: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []
        self._out_lock = threading.Lock()
        self._err_lock = threading.Lock()

    def rank(self, proc: subprocess.Popen[bytes]) -> int:
        return self.cfg.node_rank * self.cfg.nproc + self.procs.index(proc)

    def start(self) -> None:
        preexec = _parent_death_signal()
        for local_rank in range(self.cfg.nproc):
            # Own session: a terminal's Ctrl-C reaches the launcher only, which forwards it exactly once, and our
            # signals reach each worker's whole process group (its own subprocesses included).
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, *self.cfg.command],
                    env=child_env(self.cfg, self.coordinator, local_rank),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
            )
        # Reader threads only after every fork: preexec_fn is not safe while other threads run.
        for proc in self.procs:
            prefix = f"[rank {self.rank(proc)}] ".encode()
            for src, dst, lock, exit_status in (
                (proc.stdout, sys.stdout.buffer, self._out_lock, None),
                (proc.stderr, sys.stderr.buffer, self._err_lock, proc.wait),
            ):
                thread = threading.Thread(target=_pump, args=(src, dst, prefix, lock, exit_status), daemon=True)
                thread.start()
                self._threads.append(thread)

    def log(self, message: str) -> None:
        with self._err_lock:
            print(f"[launch] {message}", file=sys.stderr, flush=True)

    def signal_all(self, sig: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def running(self) -> list[subprocess.Popen[bytes]]:
        return [proc for proc in self.procs if proc.poll() is None]

    def failed(self) -> list[subprocess.Popen[bytes]]:
        return [proc for proc in self.procs if proc.poll() not in (None, 0)]

    def drain_output(self) -> None:
        deadline = time.monotonic() + _PIPE_DRAIN_S  # a leftover grandchild may hold a pipe open: bounded wait
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _exit_status(returncode: int) -> int:
    """Shell convention: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else min(returncode, 255)


def launch(cfg: LaunchConfig) -> int:
    """Run the workers described by ``cfg`` to completion; returns the launcher's exit status.

    Never blocks on a worker: it polls, tears everything down (SIGTERM, SIGKILL after ``cfg.grace_s``) on the
    first failure or forwarded signal, and gives up on workers that survive even SIGKILL for ``_KILL_WAIT_S``.
    """
    coordinator = cfg.coordinator or f"127.0.0.1:{_free_port()}"
    workers = _Workers(cfg, coordinator)
    received: list[int] = []  # signals the launcher got, in order
    teardown_at: float | None = None  # when teardown began; SIGKILL after the grace period
    killed_at: float | None = None
    failure: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal teardown_at
        received.append(signum)
        workers.signal_all(signum)
        teardown_at = teardown_at or time.monotonic()

    old_handlers = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        workers.start()
        if received:  # a signal that arrived while the workers were being started missed the later ones
            workers.signal_all(received[0])
        while running := workers.running():
            now = time.monotonic()
            if failure is None and (failed := workers.failed()):
                failure = failed[0]
                workers.log(
                    f"rank {workers.rank(failure)} {_describe(failure.returncode)}; "
                    f"stopping the other {len(running)} worker(s)"
                )
                workers.signal_all(signal.SIGTERM)
                teardown_at = teardown_at or now
            if teardown_at is not None and killed_at is None and now - teardown_at > cfg.grace_s:
                workers.log(
                    f"rank(s) {[workers.rank(p) for p in running]} still running after "
                    f"{cfg.grace_s:g} s; sending SIGKILL"
                )
                workers.signal_all(signal.SIGKILL)
                killed_at = now
            if killed_at is not None and now - killed_at > _KILL_WAIT_S:
                workers.log(f"rank(s) {[workers.rank(p) for p in running]} survived SIGKILL; giving up on them")
                break
            time.sleep(_POLL_S)
    finally:
        if workers.running():  # leaving abnormally, e.g. an exception in the launcher itself
            workers.signal_all(signal.SIGKILL)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        workers.drain_output()

    if failure is None and (failed := workers.failed()):
        failure = failed[0]
    if failure is not None:
        return _exit_status(failure.returncode)
    if workers.running():
        return 1
    return 128 + received[0] if received else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
    except LaunchError as e:
        print(f"jax_moe_comm.launch: error: {e}", file=sys.stderr)
        return 2
    return launch(cfg)


if __name__ == "__main__":
    sys.exit(main())
