"""Codec kernel throughput per backend, beside the device's copy bandwidth.

GB/s counts the bytes an op must move at the least: for encode-with-error-feedback, read
input and error, write error and codes; for the server step (n workers), read the n
workers' codes and the server error, write error and codes. Copy bandwidth is a large
``clone`` (read + write) on the same device. Run: ``python benchmarks/codecs.py [--out PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from _common import add_out_argument, header, tee_stdout

from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up (and numba compilation)
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="1M,16M,128M")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--workers", type=int, default=4, help="rows the server step averages")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=None)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    with tee_stdout(args.out, header("codecs.py", argv)):
        run(args)


def run(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    backends = ["torch", "cuda"] if device.type == "cuda" else ["torch", "numba"]
    sizes = [int(s[:-1]) * 2**20 if s.endswith("M") else int(s) for s in args.sizes.split(",")]

    print(f"# codec throughput, {datetime.date.today()}, {platform.node()}, {device}, "
          f"torch {torch.__version__}, threads {torch.get_num_threads()}, block_size {args.block_size}")
    print("| elements | codec | op | backend | ms | GB/s | % of copy | vs torch |")
    print("|---|---|---|---|---|---|---|---|")
    for n in sizes:
        x = torch.randn(n, device=device)
        # A fresh clone also pays first-touch page faults; copying into a warm buffer is the
        # stricter yardstick, so percentages are against the faster of the two.
        dst = torch.empty_like(x)
        clone_s = _time(x.clone, device, args.reps)
        copy_s = _time(functools.partial(dst.copy_, x), device, args.reps)
        copy_bw = 2 * 4 * n / min(copy_s, clone_s) / 1e9
        for what, t in (("clone", clone_s), ("copy_ (warm dst)", copy_s)):
            print(f"| {n/2**20:.0f}M | - | {what} | - | {t*1e3:.1f} | {2*4*n/t/1e9:.2f} | "
                  f"{100*2*4*n/t/1e9/copy_bw:.0f}% | - |")
        del dst
        for cname, make in (("sign-l2", lambda b: SignCodec("l2", args.block_size, backend=b)),
                            ("minmax-u8", lambda b: MinMaxUInt8Codec(args.block_size, backend=b))):
            ref_times = {}
            for backend in backends:
                codec = make(backend)
                err = torch.zeros(n, device=device)
                code_bytes = codec.encoded_nbytes(n)
                t_ef = _time(functools.partial(codec.encode_error_feedback, x, err), device, args.reps)
                seg = n // args.workers
                msgs = codec.encode(x[: seg * args.workers], nseg=args.workers)
                serr = torch.zeros(seg, device=device)
                mean = torch.empty(seg, device=device)  # persistent, as the collective keeps it
                t_srv = _time(functools.partial(codec.server_step, msgs, serr, mean=mean), device, args.reps)
                srv_bytes = msgs.nbytes + 4 * seg * 2 + code_bytes // args.workers
                ops = (("encode+EF", t_ef, 4 * n * 3 + code_bytes),
                       (f"server step x{args.workers}", t_srv, srv_bytes))
                for op, t, nbytes in ops:
                    bw = nbytes / t / 1e9
                    if backend == "torch":
                        ref_times[op] = t
                    speed = ref_times[op] / t
                    print(f"| {n/2**20:.0f}M | {cname} | {op} | {backend} | {t*1e3:.1f} | {bw:.2f} | "
                          f"{100*bw/copy_bw:.0f}% | {speed:.1f}x |", flush=True)
                del err, serr, msgs


if __name__ == "__main__":
    main()
