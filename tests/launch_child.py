"""Worker script for tests/test_launch.py, started through ``python -m jax_moe_comm.launch``.

Modes (argv[1]):
  allgather  join the job, check process_count == argv[2], all-gather the process indices across processes
  own_init   jax.distributed.initialize(argv[3], argv[2], argv[4]) first (the user's own), then allgather
  fail       rank 1 exits with status 3 at once; every other rank sleeps 60 s
  sleep      every rank sleeps 60 s
  env        print the launcher's environment variables (no JAX)
  host_gather  a global array from each process's rows, gathered by host_gather; process 0's value everywhere;
               every process's value everywhere (from_every_process)
  host_gather_failure  host_gather of a value that raises on rank 1 only: "OK ... raised: True" on every rank;
               with argv[2] "trees", of trees that differ between the ranks (each names the other's leaf)
  exit_watch   write to stderr what JAX's GPU client logs as a process leaves the job (its task watch cancelled, as
               an H200 job printed it), then a line "more" when argv[3] is "more", then exit with status argv[2]
"""

import os
import sys
import time


def allgather(expected: int) -> None:
    from jax_moe_comm.launch import initialize_distributed

    process_id, num_processes = initialize_distributed()
    assert initialize_distributed() == (process_id, num_processes)  # idempotent

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    assert jax.process_count() == num_processes == expected, (jax.process_count(), num_processes, expected)
    assert jax.process_index() == process_id
    assert all(d.platform == "cpu" for d in jax.devices())
    gathered = multihost_utils.process_allgather(np.array([process_id], np.int32))
    assert sorted(np.asarray(gathered).ravel().tolist()) == list(range(expected)), gathered
    print(f"OK process {process_id}/{num_processes} gathered={np.asarray(gathered).ravel().tolist()}", flush=True)
    print(f"stderr line from {process_id}", file=sys.stderr)
    # The job is done: leave it, then skip the interpreter's teardown, where XLA's CPU client (Gloo) now and then
    # hangs after a finished job with no Python frame left (about one process in 30 here).
    jax.distributed.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def gather_without_collectives() -> None:
    from jax_moe_comm.launch import from_every_process, from_process_0, host_gather, initialize_distributed

    process_id, num_processes = initialize_distributed()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("p",))
    rows = np.arange(num_processes * 6, dtype=np.float32).reshape(num_processes * 2, 3)
    a = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("p")), lambda index: rows[index])
    got = host_gather({"a": a, "twice": a * 2, "none": None})
    assert np.array_equal(got["a"], rows) and np.array_equal(got["twice"], 2 * rows) and got["none"] is None, got
    chosen = from_process_0("child_value", lambda: [process_id, "from " + str(process_id)])
    everyone = from_every_process("child_each", f"from {process_id}")
    assert everyone == [f"from {p}" for p in range(num_processes)], everyone
    print(f"OK process {process_id} gathered {got['a'].shape} chosen={chosen}", flush=True)
    jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


def gather_a_failure() -> None:
    """host_gather of a value that raises on process 1 only (there deleted, so reading it raises, as a device error
    does): every process raises (none waits for the failed one), the others naming process 1's error."""
    from jax_moe_comm.launch import host_gather, initialize_distributed

    process_id, num_processes = initialize_distributed()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("p",))
    rows = np.arange(num_processes * 6, dtype=np.float32).reshape(num_processes * 2, 3)
    a, b = (jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("p")), lambda index: rows[index])
            for _ in range(2))
    if sys.argv[2:] == ["trees"]:  # process 1 names its leaf otherwise: the trees differ
        try:
            host_gather({"a": a} if process_id == 0 else {"other": a})
        except ValueError as exc:
            print(f"OK process {process_id} raised: {'leaf 0' in str(exc) and 'other' in str(exc)}", flush=True)
        jax.distributed.shutdown()
        sys.stdout.flush()
        os._exit(0)
    if process_id == 1:
        b.delete()
    try:
        host_gather({"a": a, "b": b})
    except Exception as exc:
        named = process_id == 1 or (isinstance(exc, jax.errors.JaxRuntimeError) and "process 1's value" in str(exc))
        print(f"OK process {process_id} raised: {named and 'deleted' in str(exc)}", flush=True)
    else:
        print(f"process {process_id} did not raise", flush=True)
    jax.distributed.shutdown()
    sys.stdout.flush()
    os._exit(0)


def fail() -> None:
    if os.environ["JAX_PROCESS_ID"] == "1":
        print("rank 1 failing", flush=True)
        sys.exit(3)
    print("sleeping", flush=True)
    time.sleep(60)


def sleep() -> None:
    print("sleeping", flush=True)
    time.sleep(60)


def env() -> None:
    keys = ["JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_RANK", "JAX_LOCAL_WORLD"]
    keys += ["CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS", "PYTHONUNBUFFERED", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE"]
    keys += ["TORCH_SYMM_MEM_DISABLE_MULTICAST"]
    for key in keys:
        print(f"{key}={os.environ.get(key, '<unset>')}")
    print("args=" + " ".join(sys.argv[2:]))


# As one process of a job on an H200 (jax 0.11.2) wrote it at its exit, after it had succeeded.
EXIT_WATCH = """W1204 16:54:02.076033    4108 pjrt_client.cc:1605] WatchTasksAsync failed for task 0: \
CANCELLED: CANCELLED
Additional GRPC error information from remote target coordination_service while calling \
/xla.coordination.CoordinationService/WatchTasks:
:CANCELLED:CANCELLED [type.googleapis.com/tensorflow.DerivedStatus='']
=== Source Location Trace: ===\x20
external/xla+/xla/tsl/distributed_runtime/rpc/grpc_util.h:89

"""


def exit_watch(status: int, more: bool) -> None:
    print("working", flush=True)
    sys.stderr.write(EXIT_WATCH)
    if more:
        sys.stderr.write("more\n")
    sys.stderr.flush()
    sys.exit(status)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "allgather":
        allgather(int(sys.argv[2]))
    elif mode == "own_init":
        import jax

        jax.distributed.initialize(coordinator_address=sys.argv[3], num_processes=int(sys.argv[2]),
                                   process_id=int(sys.argv[4]))
        allgather(int(sys.argv[2]))
    elif mode == "fail":
        fail()
    elif mode == "sleep":
        sleep()
    elif mode == "env":
        env()
    elif mode == "host_gather":
        gather_without_collectives()
    elif mode == "host_gather_failure":
        gather_a_failure()
    elif mode == "exit_watch":
        exit_watch(int(sys.argv[2]), sys.argv[3:] == ["more"])
    else:
        sys.exit(f"unknown mode {mode!r}")
