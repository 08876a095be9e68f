"""Does a send half run beside the compute placed between the split halves? One GPU, world 1, for each
MoEComm(send_stream=...): None (XLA's stream), "own" (the library's stream) and "xla_async" (XLA's stream annotation).

    python tests/gpu/overlap_probe.py [--tokens 4096] [--max-sms 24] [--steps 6] [--backward --at combine] [--out DIR]
    bash tests/gpu/run.sh with OVERLAP_PROBE="args" (see its header)

Each mode times, per step of an unrolled chain (the n-step chain minus the 1-step one, over n - 1; best of 5):
rt_us, a round trip in split halves (R1's hidden size and experts, bf16 rows); gemm_us, a shared expert (two GEMMs,
R1's width 2048) alone; both_us, the round trip with the shared expert between dispatch_send and dispatch_recv.
hidden_us = rt_us + gemm_us - both_us: what ran concurrently (about 0 where XLA ran the halves in program order).
--backward: each time is that of the chain's gradient (forward and backward), the shared expert placed by
``beside=`` beside the dispatch or the combine (--at; rt_us: beside=a trivial compute, the same split halves), so
its VJP runs between the backward round trip's halves.
Then a profiler trace of the overlapped chain: the GPU time during which a send kernel of ours and a GEMM kernel ran
at once (overlap_us), and the streams each ran on. The optimized HLO of each mode's overlapped chain goes to DIR.

A child process reruns "xla_async" with XLA_FLAGS=--xla_gpu_experimental_stream_annotation=false (the parent sets
it true): whether the annotation needs the flag in this jaxlib. Prints one line per mode and a closing verdict.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

FLAG = "--xla_gpu_experimental_stream_annotation"
MODES = {"none": None, "own": "own", "xla_async": "xla_async"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--max-sms", type=int, default=24)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--modes", default="none,own,xla_async")
    p.add_argument("--flag", choices=("true", "false"), default="true", help=f"{FLAG}'s value in this process")
    p.add_argument("--no-child", action="store_true", help="no second process with the flag false")
    p.add_argument("--backward", action="store_true", help="time the gradient of each chain (see above)")
    p.add_argument("--at", choices=("dispatch", "combine"), default="combine", help="with --backward: beside which")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/overlap_probe"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {FLAG}={args.flag}").strip()
    os.makedirs(args.out, exist_ok=True)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_moe_comm as jmc
    from jax_moe_comm.launch import initialize_distributed

    initialize_distributed()
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    T, H, E, K = args.tokens, 7168, 256, 8
    cfg = jmc.MoECommConfig(E, K, H, T, dtype=jnp.bfloat16)
    heap = jmc.MoEComm(cfg, mesh, "ep", backend="reference").symmetric_bytes
    jmc.initialize(symmetric_size=int(heap * 1.25) + (256 << 20))
    rng = np.random.default_rng(0)
    rows = P("ep")
    put = lambda a, spec=rows: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    x = put(rng.standard_normal((T, H)).astype(jnp.bfloat16))
    ids = put(np.argsort(rng.random((T, E)), 1)[:, :K].astype(np.int32))
    w = put(rng.random((T, K)).astype(np.float32) / K)
    w1 = put((rng.standard_normal((H, args.ffn)) / np.sqrt(H)).astype(jnp.bfloat16), P())
    w2 = put((rng.standard_normal((args.ffn, H)) / np.sqrt(args.ffn)).astype(jnp.bfloat16), P())

    def shared(h, w1, w2):
        return (jax.nn.silu(h @ w1) @ w2).astype(h.dtype)

    def backward_chain(comm, n, part):
        """The gradient (w.r.t. h and the shared expert) of n steps, the shared expert beside the dispatch or the
        combine (part "both"), or a trivial compute beside it (part "rt"), or the shared expert alone ("gemm")."""
        def body(h, ids, w, w1, w2):
            def loss(h, w1, w2):
                for _ in range(n):
                    if part == "gemm":
                        h = h + shared(h, w1, w2) * 1e-3
                        continue
                    beside = (shared, h, w1, w2) if part == "both" else (jnp.negative, jnp.zeros((1,), jnp.float32))
                    if args.at == "dispatch":
                        d, s = comm.dispatch(h, ids, beside=beside)
                        y = comm.combine(d.expert_x, d.handle, w)
                    else:
                        d = comm.dispatch(h, ids)
                        y, s = comm.combine(d.expert_x, d.handle, w, beside=beside)
                    h = y + (s * 1e-3 if part == "both" else s[0].astype(y.dtype))
                return jnp.sum(h.astype(jnp.float32))
            dh, dw1, dw2 = jax.grad(loss, argnums=(0, 1, 2))(h, w1, w2)
            return dh + (dw1[0, 0] + dw2[0, 0]).astype(dh.dtype)
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, P(), P()), out_specs=rows))

    def chain(comm, n, part):
        if args.backward:
            return backward_chain(comm, n, part)

        def body(h, ids, w, w1, w2):
            for _ in range(n):
                if part == "gemm":
                    h = h + shared(h, w1, w2) * 1e-3
                    continue
                p = comm.dispatch_send(h, ids)
                s = None
                if part == "both":  # between the halves, placed there by comm.between
                    s, p = comm.between(p, shared, h, w1, w2)
                d = comm.dispatch_recv(p)
                q = comm.combine_send(d.expert_x, d.handle, w)
                y = comm.combine_recv(q)
                h = y + (s * 1e-3 if s is not None else 0)
            return h
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, P(), P()), out_specs=rows))

    def best(f, reps=5):
        jax.block_until_ready(f(x, ids, w, w1, w2))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, ids, w, w1, w2))
            times.append(time.perf_counter() - t0)
        return min(times)

    def per_step(comm, part):
        one, many = chain(comm, 1, part), chain(comm, args.steps, part)
        return (best(many) - best(one)) / (args.steps - 1) * 1e6, many

    report, gemm_us, reference_y = {}, None, None
    for label in args.modes.split(","):
        mode = MODES[label]
        comm = jmc.MoEComm(cfg, mesh, "ep", backend="nvshmem", check_errors=False, max_sms=args.max_sms,
                           send_stream=mode)
        try:
            if gemm_us is None:
                gemm_us, _ = per_step(comm, "gemm")
            rt_us, _ = per_step(comm, "rt")
            both_us, both = per_step(comm, "both")
            y = np.asarray(both(x, ids, w, w1, w2).astype(jnp.float32))
            if reference_y is None:
                reference_y = y
            same = bool(np.array_equal(y.view(np.uint32), reference_y.view(np.uint32)))
            text = both.lower(x, ids, w, w1, w2).compile().as_text()
            with open(os.path.join(args.out, f"overlapped_{label}_flag_{args.flag}.hlo"), "w") as f:
                f.write(text)
            traced = trace_overlap(jax, both, (x, ids, w, w1, w2), os.path.join(args.out, f"trace_{label}_{args.flag}"))
            hidden = rt_us + gemm_us - both_us
            report[label] = dict(rt_us=round(rt_us, 1), gemm_us=round(gemm_us, 1), both_us=round(both_us, 1),
                                 hidden_us=round(hidden, 1),
                                 hidden_share=round(hidden / max(min(rt_us, gemm_us), 1e-9), 3),
                                 bits_equal_to_first_mode=same, async_ops=text.count("async-start")
                                 + text.count("call-start"), **traced)
        except Exception as exc:  # noqa: BLE001 (reported)
            report[label] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        finally:
            comm.close()
        print(f"[flag {args.flag}] {label}: {json.dumps(report[label])}", flush=True)
    kind = f"_backward_{args.at}" if args.backward else ""
    with open(os.path.join(args.out, f"overlap_probe{kind}_flag_{args.flag}.json"), "w") as f:
        json.dump(dict(tokens=T, max_sms=args.max_sms, ffn=args.ffn, flag=args.flag, modes=report,
                       backward_at=args.at if args.backward else None), f, indent=1)
    for label, r in report.items():
        if "error" not in r:
            verdict = "concurrent" if r["hidden_share"] > 0.25 or r.get("overlap_us", 0) > 0.25 * r["rt_us"] \
                else "serial"
            print(f"VERDICT [flag {args.flag}] {label}: {verdict} (hidden {r['hidden_us']} us, kernels overlapped "
                  f"{r.get('overlap_us', '?')} us, bits equal: {r['bits_equal_to_first_mode']})", flush=True)
    if not args.no_child and args.flag == "true" and "xla_async" in args.modes.split(","):
        cmd = [sys.executable, __file__, "--flag", "false", "--no-child", "--modes", "xla_async", "--tokens",
               str(T), "--max-sms", str(args.max_sms), "--ffn", str(args.ffn), "--steps", str(args.steps),
               "--out", args.out]
        env = {**os.environ, "XLA_FLAGS": os.environ["XLA_FLAGS"].replace(f"{FLAG}=true", "")}
        return subprocess.call(cmd, env=env)
    return 0


def trace_overlap(jax, f, call_args, where: str) -> dict:
    """A profiler trace of one call of f: the GPU time during which one of our send kernels and a GEMM kernel ran at
    once, and the streams (trace lines) each kind ran on."""
    try:
        jax.block_until_ready(f(*call_args))
        with jax.profiler.trace(where):
            jax.block_until_ready(f(*call_args))
        path = sorted(glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True))[-1]
        data = jax.profiler.ProfileData.from_file(path)
        sends, gemms, lines = [], [], {"send": set(), "gemm": set()}
        for plane in data.planes:
            if "GPU" not in plane.name:
                continue
            for line in plane.lines:
                for e in line.events:
                    name = e.name.lower()
                    kind = "send" if "_send" in name and "kernel" in name else \
                        "gemm" if any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas")) else None
                    if kind:
                        (sends if kind == "send" else gemms).append((e.start_ns, e.start_ns + e.duration_ns))
                        lines[kind].add(line.name)
        overlap = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in sends for b0, b1 in gemms)
        return dict(overlap_us=round(overlap / 1e3, 1), send_kernels=len(sends), gemm_kernels=len(gemms),
                    send_lines=sorted(lines["send"]), gemm_lines=sorted(lines["gemm"]))
    except Exception as exc:  # noqa: BLE001 (the timings still say it)
        return {"trace_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


if __name__ == "__main__":
    sys.exit(main())
