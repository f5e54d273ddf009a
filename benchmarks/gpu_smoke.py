"""One-command GPU smoke test of the CUDA path: run it first on any machine with a GPU.

    python benchmarks/gpu_smoke.py                  # full: sizes up to 2^24 + 1000, timings, profile
    python benchmarks/gpu_smoke.py --quick          # sizes up to 2^20 + 3, fewer timings
    python benchmarks/gpu_smoke.py --out gpu_smoke.md --trace trace.json   # also keep the output, the trace
    python benchmarks/gpu_smoke.py --only throughput step   # some groups: parity, device, throughput, step,
                                                            # profile, capture
    NUMBA_ENABLE_CUDASIM=1 python benchmarks/gpu_smoke.py --cudasim   # the checks on CPU, under numba's
                                                                      # simulator (tiny sizes; CI runs it)

Checks, each a row of the table it prints:

* environment: torch / CUDA / driver / device / numba-cuda versions, whether NVVM loads;
* parity: codes and scales of the ``cuda`` backend equal the numba CPU backend's bit for bit, and the
  decoded floats too, for every codec (sign-l2, sign-l1, min-max u8), modes (plain, error feedback,
  markov), block sizes and tensor groups, sizes 0 .. 2^24 + 1000, one and several rows;
* the update a compression-phase step makes (a ``Sink``), applied by the decode kernel, predicated and not
  (0/1 Adam's synchronisation): the CPU's bits, with tensors without a target and masked coordinates (and
  whether torch's own foreach update on the device gives them too, reported); 1-bit LAMB's moments on a
  bucket's whole buffers: the bits of the same torch ops per tensor;
* stream ordering: input written on a side stream after a long ``torch.cuda._sleep`` is encoded on
  that stream correctly (the kernels run on torch's current stream);
* host syncs: one error-feedback encode + decode under ``torch.cuda.set_sync_debug_mode("warn")``
  (reported, not failed: a codec op checks finiteness on the host by design; the collective
  instead folds the workers' check into its agreement round);
* ``SimulatedCluster`` on CUDA tensors with 1 and 3 pieces gives the same result;
* resume: a compression-phase ``OnebitAdam`` state saved and loaded on the GPU continues bit for bit;
* a NaN gradient in a compression-phase ``OnebitAdam`` step (and on a GPU ``OnebitLamb``'s) at world size 1,
  decided on the device (no host read): parameters and state afterwards bit for bit those of the run without
  that step, and the skip counted at the next step; and the same with 2 gloo ranks sharing the GPU, the NaN on
  one of them (the decision from the gathered signatures; the ranks alike afterwards);
* 0/1 Adam's local steps: a NaN gradient of one of 2 simulated workers dropped on the device (its flag
  zeroes its gradients, no host wait under ``set_sync_debug_mode("error")``) equals the run where that
  gradient was zeros, bit for bit, through the next synchronisation;
* ``DiLoCo(offload=True)``: the outer state in pinned CPU memory, the same parameters as without offload
  after 2 outer steps, fp32 and 4-bit;
* throughput: encode + error feedback and decode against the device copy bandwidth, 1M-128M, and at
  64M each kernel's own time (the profiler) against the bytes it must move;
* the optimizer step alone: the compression-phase steps of ``OnebitAdam`` (world size 1 and 2 simulated
  workers), ``QAdam``, ``OnebitLamb`` and ``ZeroOneAdam`` (local and sync) and the warm-up of
  ``OnebitAdam(fused=True)`` over ``AdamW(fused=True)``'s on the same MLP, at 17M and 100M parameters
  (the CPU's ``benchmarks/optimizer_step.py`` on the device), each against its target (3x at 17M, 2x
  from 100M: reported, not failed);
* the compression-phase ``OnebitAdam`` and ``OnebitLamb`` steps and a ``ZeroOneAdam`` synchronisation at world
  size 1 under ``torch.cuda.set_sync_debug_mode("error")``: where it first waits for the device, if it does (the
  target is nowhere, as the step is decided on the device; reported, not failed);
* a compression-phase ``OnebitAdam`` step captured with ``torch.cuda.graph`` and replayed 3 times
  against the same steps run eagerly on a copy, bit for bit (reported, not failed: the step is not
  capturable yet, and the line says why);
* a ``torch.profiler`` profile of one compression-phase ``OnebitAdam`` step at 17M: host time by op,
  the device's busy time, launches, copies and synchronizations;
* a ``torch.profiler`` profile of one 8-worker 25M simulated call (with ``--trace PATH``, its chrome trace).

Exits 1 if any parity, ordering, cluster or resume check fails, 2 if there is no GPU (and no
``--cudasim``).
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
from _common import add_out_argument, header, repo_on_path, tee_stdout

repo_on_path()
from lightning_onebit import DiLoCo, OnebitAdam, OnebitLamb, QAdam, ZeroOneAdam  # noqa: E402
from lightning_onebit.comm import SimulatedCluster  # noqa: E402
from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec  # noqa: E402
from lightning_onebit.compress.kernels import cuda_compiler_available  # noqa: E402
from lightning_onebit.compress.source import Sink  # noqa: E402

ROWS: list[tuple[str, str, str]] = []
FAILED: list[str] = []


def row(check: str, ok: bool | None, detail: str) -> None:
    status = "ok" if ok else ("info" if ok is None else "FAIL")
    ROWS.append((check, status, detail))
    if ok is False:
        FAILED.append(check)
    print(f"  {status:4s} {check}: {detail}", flush=True)


def codecs(backend: str) -> dict[str, object]:
    return {
        "sign-l2": SignCodec("l2", backend=backend),
        "sign-l1": SignCodec("l1", backend=backend),
        "sign-l2-b256": SignCodec("l2", block_size=256, backend=backend),
        "sign-l2-b4096": SignCodec("l2", block_size=4096, backend=backend),
        "minmax": MinMaxUInt8Codec(backend=backend),
        "minmax-b256": MinMaxUInt8Codec(block_size=256, backend=backend),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


def check_parity(device: torch.device, sizes: list[int]) -> None:
    """cuda backend on ``device`` vs numba on CPU: codes, scales, state and decoded values."""
    gpu, cpu = codecs("cuda"), codecs("numba")
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        bad, cases = [], 0
        for nseg in (1, 3):
            m = n - n % nseg  # rows are equal segments
            if nseg > 1 and m == 0:
                continue
            x = torch.randn(m, generator=g) * torch.logspace(-3, 3, m) if m else torch.zeros(0)
            cuts = sorted({0, m // 7, m // 2, max(m - 1, 0)}) if m else None
            for name, mode, groups in itertools.product(gpu, ("plain", "error_feedback", "markov"), (None, cuts)):
                cases += 1
                state = torch.randn(m, generator=g)
                xs, ss = x.clone().to(device), state.clone().to(device)  # distinct even on CPU
                try:
                    if mode == "plain":
                        eg = gpu[name].encode(xs, nseg=nseg, groups=groups)
                        ec = cpu[name].encode(x, nseg=nseg, groups=groups)
                    elif mode == "error_feedback":
                        eg = gpu[name].encode_error_feedback(xs, ss, nseg=nseg, groups=groups)
                        ec = cpu[name].encode_error_feedback(x, state, nseg=nseg, groups=groups)
                    else:
                        eg = gpu[name].encode_markov(xs, ss, nseg=nseg, groups=groups)
                        ec = cpu[name].encode_markov(x, state, nseg=nseg, groups=groups)
                    same = (_same(eg.codes, ec.codes) and _same(eg.scales, ec.scales) and _same(ss, state)
                            and _same(gpu[name].decode(eg), cpu[name].decode(ec)))
                    if nseg > 1 and groups is None:  # a message's rows: one layout per row
                        same = same and _same(gpu[name].decode_mean(eg), cpu[name].decode_mean(ec))
                    why = ""
                except Exception as exc:  # a crash is a parity failure with its reason
                    same, why = False, f" ({type(exc).__name__}: {exc})"
                if not same:
                    bad.append(f"{name}/{mode}/nseg={nseg}/groups={groups}{why}")
        row(f"parity n={n}", not bad, "codes, scales, state, decode equal to numba CPU" if not bad
            else f"differs in {len(bad)} of {cases} cases: " + ", ".join(bad[:6]))


def check_stream_order(device: torch.device) -> None:
    n = 1 << 22
    src = torch.randn(n, device=device)
    codec, ref = SignCodec(backend="cuda"), SignCodec(backend="numba")
    side = torch.cuda.Stream(device)
    x = torch.zeros(n, device=device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before x gets its values
        x.copy_(src)
        enc = codec.encode(x)
    torch.cuda.current_stream(device).wait_stream(side)
    expected = ref.encode(src.cpu())
    row("stream ordering", _same(enc.codes, expected.codes) and _same(enc.scales, expected.scales),
        "encode queued on a side stream behind a 0.1 s sleep sees the copied input")


def check_sync_debug(device: torch.device) -> None:
    codec = SignCodec(backend="cuda")
    x, err = torch.randn(1 << 20, device=device), torch.zeros(1 << 20, device=device)
    codec.decode(codec.encode_error_feedback(x, err))  # compile outside the window
    torch.cuda.synchronize(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            codec.decode(codec.encode_error_feedback(x, err))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    row("host syncs (encode+EF, decode)", None, f"{len(syncs)} sync(s)" + (f": {syncs[0]}" if syncs else ""))


def _skip_run(device: torch.device, at_nan: str, rank: int = 0, nan_at: int = 3, steps: int = 6,
              cls: type = OnebitAdam) -> tuple:
    """(params, ``cls``, steps decided on the device) of compression-phase steps, at step ``nan_at`` (``at_nan``)
    one with a NaN gradient (``"nan"``), an ordinary one (``"step"``: another rank's NaN skips it) or none
    (``"omit"``); the gradients differ by ``rank``, the parameters do not."""
    g, gg = torch.Generator().manual_seed(3), torch.Generator().manual_seed(10 + rank)
    params = [torch.nn.Parameter(torch.randn(40, 7, generator=g).to(device)),
              torch.nn.Parameter(torch.randn(13, generator=g).to(device))]
    opt = cls(params, lr=1e-2, weight_decay=0.01, warmup_steps=2)
    opt.set_nonfinite_policy("skip")
    decided = 0
    for t in range(steps):
        grads = [torch.randn(p.shape, generator=gg).to(device) for p in params]
        if t == nan_at and at_nan == "nan":
            grads[1][5] = float("nan")
        elif t == nan_at and at_nan == "omit":
            continue
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        opt.step()
        decided += bool(opt._device_steps)
    opt.settle_device_skips()
    return params, opt, decided


def _skip_verdict(device: torch.device, rank: int = 0, nan_rank: int = 0,
                  cls: type = OnebitAdam) -> tuple[bool, int, int, list]:
    """(parameters and momentum equal the run without the NaN step, skipped steps, steps decided on the
    device, the parameters on the CPU)."""
    params, opt, decided = _skip_run(device, "nan" if rank == nan_rank else "step", rank, cls=cls)
    ref, ref_opt, _ = _skip_run(device, "omit", rank, cls=cls)
    same = all(_same(a, b) for a, b in zip(params, ref, strict=True))
    state = [opt.state[p]["exp_avg"] for p in params], [ref_opt.state[p]["exp_avg"] for p in ref]
    same = same and all(_same(a, b) for a, b in zip(*state, strict=True))
    return same, opt.skipped_steps, decided, [p.detach().cpu() for p in params]


def _local_run(device: torch.device, worker1_at_21: str) -> tuple[list[torch.Tensor], ZeroOneAdam]:
    """(both workers' parameters, the optimizer) of 24 steps of ``ZeroOneAdam`` with 2 simulated workers (local
    steps from 13 on, a sync at 24), worker 1's gradients at local step 21 NaN (``"nan"``) or zeros (``"zeros"``);
    on a GPU its local steps after the first under ``set_sync_debug_mode("error")`` (a host wait raises)."""
    g = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(40, 7, generator=g).to(device)),
              torch.nn.Parameter(torch.randn(13, generator=g).to(device))]
    opt = ZeroOneAdam(params, lr=1e-2, weight_decay=0.01, simulate_workers=2, var_freeze_step=12,
                      var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)
    opt.set_nonfinite_policy("skip")
    kinds = opt.schedule().kinds(24)
    for t in range(1, 25):
        grads = [[torch.randn(p.shape, generator=g).to(device) for p in params] for _ in range(2)]
        if t == 21:
            grads[1] = [x * float("nan") if worker1_at_21 == "nan" else torch.zeros_like(x) for x in grads[1]]
        strict = device.type == "cuda" and kinds[t - 1] == kinds[t - 2] == "local"
        if strict:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step_workers(grads)
        finally:
            if strict:
                torch.cuda.set_sync_debug_mode("default")
    replicas = []
    for w in range(2):
        with opt.worker_parameters(w):
            replicas += [p.detach().clone() for p in params]
    return replicas, opt


def check_local_step_drop(device: torch.device) -> None:
    """0/1 Adam's local steps on the device: a worker's NaN gradients dropped by its flag, with no host wait,
    are the run where they were zeros, bit for bit, through the next synchronisation."""
    what = "0/1 Adam local step drops a NaN gradient on the device"
    try:
        nan, opt = _local_run(device, "nan")
        zeros, _ = _local_run(device, "zeros")
    except RuntimeError as e:  # under the sync debug mode: the first host wait
        e, where = _origin(e)
        row(what, False, f"a local step waits for the device{where}: {str(e).splitlines()[0]}")
        return
    same = all(_same(a, b) for a, b in zip(nan, zeros, strict=True))
    row(what, same and opt.dropped_gradients == 1,
        f"{opt.dropped_gradients} dropped; both workers' parameters after the sync {'equal' if same else 'differ from'}"
        " the run with zeros there" + ("; no host wait in its local steps" if device.type == "cuda" else ""))


def _forcing_cuda_backend(device: torch.device):
    """The simulator: CPU tensors run the cuda backend only when it is forced (a context manager)."""
    import contextlib

    @contextlib.contextmanager
    def forced():
        backend = os.environ.get("LIGHTNING_ONEBIT_BACKEND")
        if device.type == "cpu":
            os.environ["LIGHTNING_ONEBIT_BACKEND"] = "cuda"
        try:
            yield
        finally:
            if backend is None:
                os.environ.pop("LIGHTNING_ONEBIT_BACKEND", None)
            else:
                os.environ["LIGHTNING_ONEBIT_BACKEND"] = backend
    return forced()


def check_device_skip(device: torch.device) -> None:
    """A NaN step of ``OnebitAdam`` (and on a GPU ``OnebitLamb``, whose kernels run where torch's ops would) at
    world size 1, decided on the device, against the run without it."""
    for cls in (OnebitAdam, OnebitLamb) if device.type == "cuda" else (OnebitAdam,):
        with _forcing_cuda_backend(device):
            same, skipped, decided, _ = _skip_verdict(device, cls=cls)
        row("NaN step decided on the device" + ("" if cls is OnebitAdam else f" ({cls.__name__})"),
            same and skipped == 1 and decided > 0, f"{decided} steps decided on the device, {skipped} skipped; "
            f"parameters and momentum {'equal' if same else 'differ from'} the run without that step")


def _skip_rank(rank: int, world: int, port: int, device_type: str, results) -> None:
    """A rank of :func:`check_device_skip_ranks` (spawned: CUDA does not survive a fork)."""
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        device = torch.device(device_type)
        with _forcing_cuda_backend(device):
            results.put((rank, _skip_verdict(device, rank, nan_rank=1)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        results.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def check_device_skip_ranks(device: torch.device, world: int = 2, timeout_s: float = 240.0) -> None:
    """A NaN on rank 1 of ``world`` gloo ranks sharing the device, the step decided on the device from the
    gathered signatures: every rank as if the step never came, and the ranks alike."""
    import queue
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_skip_rank, args=(r, world, port, device.type, results)) for r in range(world)]
    got: dict[int, object] = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, res = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
                got[rank] = res
            except queue.Empty:
                if any(proc.exitcode not in (None, 0) for proc in procs):
                    break
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    failed = {r: res for r, res in got.items() if isinstance(res, str)}
    if len(got) < world or failed:
        row(f"NaN step decided on the device, {world} ranks", False,
            f"ranks {sorted(set(range(world)) - set(got))} gave no result" if len(got) < world else
            "; ".join(f"rank {r}: {msg}" for r, msg in failed.items()))
        return
    verdicts = [got[r] for r in range(world)]
    alike = all(all(_same(a, b) for a, b in zip(verdicts[0][3], v[3], strict=True)) for v in verdicts[1:])
    ok = all(same and skipped == 1 and decided > 0 for same, skipped, decided, _ in verdicts) and alike
    row(f"NaN step decided on the device, {world} ranks", ok,
        f"gloo; steps decided on the device {[v[2] for v in verdicts]}, skipped {[v[1] for v in verdicts]}; "
        f"every rank {'as' if all(v[0] for v in verdicts) else 'not as'} without that step, the ranks "
        f"{'alike' if alike else 'apart'}")


def check_diloco_offload(device: torch.device) -> None:
    """``DiLoCo(offload=True)`` against ``offload=False``: the outer state in pinned CPU memory, the outer steps
    on the CPU (the compressed mode by the numba kernels, which the cuda backend's match bit for bit), the same
    parameters after 2 outer steps."""
    def run(offload: bool, compression: str):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 8))
        model = model.to(device)
        opt = DiLoCo(model.parameters(), lr=1e-2, sync_every=2, compression=compression, offload=offload)
        g = torch.Generator().manual_seed(5)
        for _ in range(4):
            loss = model(torch.randint(0, 32, (4, 6), generator=g).to(device)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()], opt._outer["anchor"]

    out = []
    for compression in ("fp32", "4bit"):
        (mine, anchor), (ref, _) = run(True, compression), run(False, compression)
        same = all(_same(a, b) for a, b in zip(mine, ref, strict=True))
        out.append((compression, same, anchor.device.type == "cpu" and anchor.is_pinned()))
    row("DiLoCo offload (outer state in pinned CPU memory)", all(s and p for _, s, p in out),
        "; ".join(f"{c}: parameters {'equal' if s else 'differ'}, anchor {'pinned on the CPU' if p else 'elsewhere'}"
                  for c, s, p in out) + " (against offload=False, 2 outer steps)")


def check_cluster_pieces(device: torch.device, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(n, generator=g).to(device) for _ in range(4)]
    outs = {}
    for pieces in (1, 3):
        sim = SimulatedCluster(SignCodec(backend="cuda"), "error_feedback", 4, pieces=pieces, groups=[0, n // 3])
        outs[pieces] = [sim.allreduce([t.clone() for t in inputs]) for _ in range(2)]
    same = all(_same(a, b) for s1, s3 in zip(outs[1], outs[3], strict=True) for a, b in zip(s1, s3, strict=True))
    row("SimulatedCluster pieces 1 vs 3", same, f"4 workers, {n} values, 2 calls")


def check_resume(device: torch.device) -> None:
    def model():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 50))
        return net.to(device)

    def grads(net, step):
        out = []
        for w in range(2):
            net.zero_grad()
            tok = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(10 * step + w)).to(device)
            torch.nn.functional.cross_entropy(net(tok), tok.roll(1)).backward()
            out.append([p.grad.clone() for p in net.parameters()])
        return out

    full = model()
    opt = OnebitAdam(full.parameters(), lr=1e-2, warmup_steps=2, simulate_workers=2)
    for s in range(8):
        opt.step_workers(grads(full, s))
    part = model()
    opt = OnebitAdam(part.parameters(), lr=1e-2, warmup_steps=2, simulate_workers=2)
    for s in range(5):
        opt.step_workers(grads(part, s))
    saved = {"model": part.state_dict(), "opt": opt.state_dict()}
    resumed = model()
    resumed.load_state_dict(saved["model"])
    opt = OnebitAdam(resumed.parameters(), lr=1e-2, warmup_steps=2, simulate_workers=2)
    opt.load_state_dict(saved["opt"])
    on_device = all(t.device == torch.device(device) for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    for s in range(5, 8):
        opt.step_workers(grads(resumed, s))
    same = all(_same(a, b) for a, b in zip(full.parameters(), resumed.parameters(), strict=True))
    row("resume in the compression phase", same and on_device,
        f"5 + 3 steps == 8 steps bit for bit; state on {device}: {on_device}")


def _time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def check_throughput(device: torch.device, sizes: list[int]) -> None:
    codec = SignCodec(backend="cuda")
    for n in sizes:
        x, err = torch.randn(n, device=device), torch.zeros(n, device=device)
        enc, out = codec.encode_error_feedback(x, err), torch.empty_like(x)
        copy_s = _time(x.clone, 10)
        enc_s = _time(lambda x=x, err=err, enc=enc: codec.encode_error_feedback(x, err, out=enc), 10)
        dec_s = _time(lambda enc=enc, out=out: codec.decode(enc, out=out), 10)
        bw = 8 * n / copy_s / 1e9  # read + write of fp32
        # bytes each pass must move: encode+EF reads x, err (twice: scales, then codes) and writes err + codes
        enc_bw, dec_bw = (16 * n + n / 8) / enc_s / 1e9, (4 * n + n / 8) / dec_s / 1e9
        row(f"throughput n={n >> 20}M", None, f"copy {bw:.0f} GB/s; encode+EF {enc_s * 1e3:.2f} ms "
            f"({enc_bw / bw:.0%} of copy); decode {dec_s * 1e3:.2f} ms ({dec_bw / bw:.0%} of copy)")


def profile_kernels(device: torch.device, n: int = 1 << 26) -> None:
    """Each kernel of one encode + error feedback and one decode of ``n`` values, timed alone by the
    profiler, with the bytes it must move over the device's copy bandwidth; and the torch ops between."""
    from torch.profiler import ProfilerActivity, profile

    codec = SignCodec(backend="cuda")
    x, err = torch.randn(n, device=device), torch.zeros(n, device=device)
    enc, out = codec.encode_error_feedback(x, err), torch.empty_like(x)
    codec.decode(enc, out=out)
    bw = 8 * n / _time(x.clone, 10)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            codec.encode_error_feedback(x, err, out=enc)
            codec.decode(enc, out=out)
        torch.cuda.synchronize(device)
    # the fewest bytes each kernel must move: the reduction reads x and err, the encode reads them again
    # and writes err and the codes, the decode reads the codes and writes the values
    floor = {"_reduce_scales_kernel": 8 * n, "_encode_kernel": 12 * n + n / 8, "_decode_kernel": 4 * n + n / 8}
    parts = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / max(e.count, 1)
        name = next((k for k in floor if k in e.key), None)
        if name is not None and dev_us > 0:
            parts.append(f"{name.strip('_')} {dev_us:.0f} us ({floor[name] / (dev_us * 1e-6) / bw:.0%} of copy)")
        elif "numba_cuda" not in e.key and dev_us > 0 and not e.key.startswith(("cuda", "cu", "Memcpy")):
            parts.append(f"{e.key[:40]} {dev_us:.0f} us x{e.count // 3}")
    row(f"kernels n={n >> 20}M", None, f"copy {bw / 1e9:.0f} GB/s; " + "; ".join(parts))


#: the step's target over AdamW(fused=True)'s, by model size
STEP_TARGET = {"17M": 3.0, "100M": 2.0}


def check_step(device: torch.device, size: str = "17M") -> None:
    """Each optimizer's step over ``AdamW(fused=True)``'s, with ``optimizer_step.py``'s MLP and fixed
    gradients on ``device``, after the steps that must come first (warm-up, 0/1 Adam's freeze)."""
    from optimizer_step import _grads, mlp

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def setup(make, workers: int, before: int):
        params = [torch.nn.Parameter(p.detach().to(device)) for p in mlp(size)]
        grads = [[g.to(device) for g in w] for w in _grads(params, workers)]
        for p, g in zip(params, grads[0], strict=True):
            p.grad = g
        opt = make(params)
        step = (lambda: opt.step_workers(grads)) if workers > 1 else opt.step
        for _ in range(before):
            step()
        return opt, step

    sim2 = {"simulate_workers": 2}
    z1 = {"lr": 1e-3, "var_freeze_step": 2, "var_update_scaler": 1, "local_step_scaler": 1, "local_step_clipper": 4}
    cases = {  # name: (optimizer, simulated workers, steps before the timed ones)
        "AdamW(fused=True)": (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01, fused=True), 1, 1),
        "OnebitAdam(fused=True)": (lambda p: OnebitAdam(p, lr=1e-3, warmup_steps=1000, fused=True), 1, 1),
        "OnebitAdam": (lambda p: OnebitAdam(p, lr=1e-3, warmup_steps=1), 1, 2),
        "OnebitAdam, 2 workers": (lambda p: OnebitAdam(p, lr=1e-3, warmup_steps=1, **sim2), 2, 2),
        "QAdam": (lambda p: QAdam(p, lr=1e-3, warmup_steps=1), 1, 2),
        "OnebitLamb": (lambda p: OnebitLamb(p, lr=1e-3, warmup_steps=1), 1, 2),
        "ZeroOneAdam": (lambda p: ZeroOneAdam(p, **z1), 1, 4),  # from step 9 on: 3 local steps, 1 sync
    }
    base = None
    for name, (make, workers, before) in cases.items():
        try:
            opt, step = setup(make, workers, before)
            times: dict[str, list[float]] = {}
            for _ in range(16):
                kind = _kind(opt)
                sync()
                t = time.perf_counter()
                step()
                sync()
                times.setdefault(kind, []).append(time.perf_counter() - t)
        except Exception as e:  # report and go on: one optimizer's failure should not hide the others'
            row(f"step {name}", False, f"{type(e).__name__}: {e}")
            continue
        for kind, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            base = t if base is None else base
            target = "" if name.startswith("AdamW") or kind == "warm-up" else (
                f"; target <= {STEP_TARGET[size]:g}x: {'met' if t / base <= STEP_TARGET[size] else 'missed'}")
            row(f"step {name} ({kind}), {size}", None, f"{t * 1e3:.2f} ms = {t / base:.2f}x AdamW(fused=True); "
                f"median of {len(ts)}{target}")
        del opt, step
        torch.cuda.empty_cache()


def _origin(e: BaseException) -> tuple[BaseException, str]:
    """The first error of ``e``'s chain (the package wraps a collective's; a failed capture's exit raises
    over the first) and " at file:line" of its last frame in the package ("" if none)."""
    import traceback

    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "lightning_onebit" in f.filename]
    return e, f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def _compressing_adam(device: torch.device, n: int = 1 << 20, seed: int = 0, cls: type = OnebitAdam):
    """(params, ``cls`` (OnebitAdam)) at world size 1 past its warm-up, with fixed gradients on ``device``."""
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(device)),
              torch.nn.Parameter(torch.randn(n // 4, 3, generator=g).to(device))]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    opt = cls(params, lr=1e-3, warmup_steps=1)
    for _ in range(3):  # the warm-up step, the first compressed one (binds its buffers), one more
        opt.step()
    return params, opt


def _zero_one_before_a_sync(device: torch.device, n: int = 1 << 20) -> ZeroOneAdam:
    """``ZeroOneAdam`` at world size 1 with fixed gradients on ``device``, its next step a synchronisation that
    follows two others (its collectives bound and verified)."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=g).to(device)),
              torch.nn.Parameter(torch.randn(n // 4, 3, generator=g).to(device))]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device)
    opt = ZeroOneAdam(params, lr=1e-3, var_freeze_step=2, var_update_scaler=1, local_step_scaler=1,
                      local_step_clipper=2)
    while opt.step_counts["sync"] < 2 or _kind(opt) != "sync":
        opt.step()
    return opt


def check_step_sync_free(device: torch.device) -> None:
    """The compression-phase steps of 1-bit Adam and 1-bit LAMB, and 0/1 Adam's synchronisation, under
    ``set_sync_debug_mode("error")``: the first host wait raises."""
    for cls in (OnebitAdam, OnebitLamb, ZeroOneAdam):
        opt = _zero_one_before_a_sync(device) if cls is ZeroOneAdam else _compressing_adam(device, cls=cls)[1]
        torch.cuda.synchronize(device)
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
            detail, ok = "no host wait in the step", True
        except RuntimeError as e:
            e, at = _origin(e)
            detail, ok = f"waits for the device{at}: {str(e).splitlines()[0]}", False
        finally:
            torch.cuda.set_sync_debug_mode("default")
        what = "synchronisation" if cls is ZeroOneAdam else "step"
        row(f"{cls.__name__} {what} under sync debug 'error'", None, detail + ("" if ok else " (target: no wait)"))


def check_graph_replay(device: torch.device, replays: int = 3) -> None:
    """A captured compression-phase step replayed against eager steps on a copy, bit for bit."""
    eager_params, eager = _compressing_adam(device)
    params, opt = _compressing_adam(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):  # torch's recipe: warm the step up on a side stream before capture
            opt.step()
        torch.cuda.current_stream(device).wait_stream(side)
        eager.step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
    except Exception as e:  # noqa: BLE001 - reported: what stops the capture is the finding
        first, at = _origin(e)  # capture_end's error hides the first one
        row("graph-captured OnebitAdam step", None, f"not capturable{at}: {type(first).__name__}: "
            f"{str(first).splitlines()[0][:160]}")
        return
    same = True
    for _ in range(replays):
        graph.replay()
        eager.step()
        torch.cuda.synchronize(device)
        same = same and all(torch.equal(a, b) for a, b in zip(params, eager_params, strict=True))
    row("graph-captured OnebitAdam step", None, f"{replays} replays {'equal' if same else 'differ from'} "
        "the eager steps bit for bit")


def _kind(opt: torch.optim.Optimizer) -> str:
    """The kind of ``opt``'s coming step: what the timing of :func:`check_step` groups by."""
    if isinstance(opt, ZeroOneAdam):
        return opt.schedule().kind(opt.optimizer_steps + 1)
    if isinstance(opt, torch.optim.AdamW):
        return "step"
    return "compression" if opt.optimizer_steps >= opt.warmup_steps else "warm-up"


def profile_step(device: torch.device, size: str = "17M", rows: int = 12) -> None:
    """A ``torch.profiler`` profile of one compression-phase ``OnebitAdam`` step at world size 1:
    where its host time goes (ops by self CPU time) against the device's busy time."""
    from optimizer_step import _grads, mlp
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    params = [torch.nn.Parameter(p.detach().to(device)) for p in mlp(size)]
    for p, g in zip(params, _grads(params, 1)[0], strict=True):
        p.grad = g.to(device)
    opt = OnebitAdam(params, lr=1e-3, warmup_steps=1)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize(device)
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    # as the table's totals: host time of the CPU events, device time of the kernels and copies
    cpu_us = sum(e.self_cpu_time_total for e in events if e.device_type == DeviceType.CPU)
    dev_us = sum(getattr(e, "self_device_time_total", 0) for e in events if e.device_type != DeviceType.CPU)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    copies = sum(e.count for e in events if e.key.startswith("cudaMemcpy"))
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaEventSynchronize"))
    row(f"profile of one OnebitAdam compression step, {size}", None,
        f"host {cpu_us / 1e3:.2f} ms in profiled ops (the profiler's own included), device {dev_us / 1e3:.2f} "
        f"ms; {launches} kernel launches, {copies} copies, {syncs} stream/event synchronizations")


def profile_call(device: torch.device, path: Path | None) -> None:
    from torch.profiler import ProfilerActivity, profile

    n = 25 * 1024 * 1024 // 4
    inputs = [torch.randn(n, device=device) for _ in range(8)]
    sim = SimulatedCluster(SignCodec(backend="cuda"), "error_feedback", 8, pieces=3)
    sim.allreduce(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sim.allreduce(inputs)
        torch.cuda.synchronize()
    if path is not None:
        prof.export_chrome_trace(str(path))
    top = prof.key_averages().table(sort_by="cuda_time_total", row_limit=8)
    print(top)
    row("profile of one call", None, "8 workers x 25 MB, 3 pieces" + (f" -> {path}" if path is not None else ""))


def environment(device: torch.device) -> None:
    import numba

    try:
        import numba_cuda

        nc = getattr(numba_cuda, "__version__", "?")
    except ImportError:
        nc = "not installed"
    why = cuda_compiler_available()
    desc = f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), " \
           f"numba {numba.__version__}, numba-cuda {nc}, NVVM {'ok' if why is None else why}"
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        desc += (f"; {p.name}, sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
                 f"{torch.cuda.device_count()} GPU(s)")
    row("environment", why is None, desc)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="sizes up to 2^20 + 3, two timing sizes")
    ap.add_argument("--cudasim", action="store_true", help="run the checks on CPU under numba's CUDA simulator")
    ap.add_argument("--sizes", type=int, nargs="+", help="parity sizes (default 0 .. 2^24+1000)")
    ap.add_argument("--trace", type=Path, metavar="PATH",
                    help="write the chrome trace of one 8-worker 25M call to PATH (default: not written)")
    ap.add_argument("--only", nargs="+", choices=GROUPS, metavar="GROUP",
                    help=f"run only these groups of checks (default all: {', '.join(GROUPS)})")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.cudasim:
        if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
            ap.error("--cudasim needs NUMBA_ENABLE_CUDASIM=1 in the environment (set before numba is imported)")
        device = torch.device("cpu")
        sizes = [0, 1, 7, 8, 77, 1000]
    elif not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device (use --cudasim under NUMBA_ENABLE_CUDASIM=1 to run the checks on CPU)")
        return 2
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        sizes = [0, 1, 7, 8, 1000, 4097, (1 << 20) + 3] + ([] if args.quick else [(1 << 24) + 1000])
    sizes = args.sizes if args.sizes is not None else sizes
    with tee_stdout(args.out, header("gpu_smoke.py", argv)):
        run_checks(device, sizes, args)
    return 1 if FAILED else 0


GROUPS = ("parity", "device", "throughput", "step", "profile", "capture")


def _random_layers(n: int, draws: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """(offsets, sizes) of up to ``draws`` + 1 layers of random sizes that cover ``n`` elements."""
    cuts = sorted({0, *torch.randint(1, max(n, 2), (draws,), generator=g).tolist()}) if n > 1 else [0]
    return cuts, [b - a for a, b in zip(cuts, (*cuts[1:], n), strict=True)]


def check_sink_parity(device: torch.device, n: int) -> None:
    """The update a predicated decode applies in its kernel (a Sink: a compression-phase step's last line) against
    the CPU's bits (the numba CPU backend's decode with the Sink fused), and, reported, torch's own on the device."""
    g = torch.Generator().manual_seed(7)
    cuts, sizes = _random_layers(n, 40, g)
    codec_g, codec_c = SignCodec(backend="cuda"), SignCodec(backend="numba")
    x = torch.randn(n, generator=g)
    denom, mask = torch.rand(n, generator=g) + 1e-3, torch.randperm(n, generator=g)[: n // 50].sort().values
    targets = [torch.randn(k, generator=g) if i % 7 != 3 else None for i, k in enumerate(sizes)]

    def sink(ts, dev):
        return Sink(numel=n, groups=cuts, targets=ts, denom=denom.to(dev), values=[-1e-3] * len(cuts), decay=0.99,
                    mask=mask.to(dev))

    def on(dev):
        return [None if t is None else t.clone().to(dev) for t in targets]

    cpu = on("cpu")
    enc_c = codec_c.encode_error_feedback(x, torch.zeros(n))
    codec_c.decode(enc_c, out=torch.empty(n), sink=sink(cpu, "cpu"))
    gpu, by_torch = on(device), on(device)
    enc_g = codec_g.encode_error_feedback(x.to(device), torch.zeros(n, device=device))
    go = torch.ones(1, dtype=torch.bool, device=device)
    fused = codec_g.fuses_predicated_sink(sink(gpu, device))
    codec_g.decode_predicated(enc_g, torch.empty(n, device=device), None, go=go, sink=sink(gpu, device))
    sink(by_torch, device).apply(codec_g.decode(enc_g))
    plain = on(device)  # a decode the host decided (0/1 Adam's synchronisation) fuses the sink alike
    codec_g.decode(enc_g, out=torch.empty(n, device=device), sink=sink(plain, device))
    same = fused and all(t is None or _same(a, t) for a, t in zip(gpu, cpu, strict=True))
    plain_same = all(t is None or _same(a, t) for a, t in zip(plain, cpu, strict=True))
    torch_same = all(t is None or _same(a, t) for a, t in zip(by_torch, cpu, strict=True))
    row(f"update in the decode kernel, n={n}", same and plain_same,
        f"{len(cuts)} tensors, {mask.numel()} masked: predicated {'equal to' if same else 'differs from'}, "
        f"not predicated {'equal to' if plain_same else 'differs from'} the CPU's bits (torch's foreach update "
        f"on {device.type}: {'the same' if torch_same else 'other'} bits)")


def check_lamb_scaled_step(device: torch.device, n: int) -> None:
    """1-bit LAMB's scaled step by the cuda backend's kernel (one launch a bucket, step sizes read on the device)
    against the CPU kernel's bits, and, reported, torch's ops per tensor on the device."""
    from lightning_onebit.compress.kernels import numba_cuda as kc
    from lightning_onebit.optim import functional_lamb as FL

    g = torch.Generator().manual_seed(11)
    cuts, sizes = _random_layers(n, 30, g)
    u, steps = torch.randn(n, generator=g), torch.rand(len(cuts), generator=g) * 0.1
    decays = (1 - steps * 0.01).float()
    params = [torch.randn(k, generator=g) for k in sizes]
    cpu = [p.clone() for p in params]
    FL.scaled_step_(cpu, list(u.split(sizes)), steps.tolist(), decays.tolist())
    on_device = [p.clone().to(device) for p in params]  # copies on a CPU too (the simulator's)
    kc.scaled_step(on_device, u.to(device), cuts, steps.to(device), decays.to(device))
    by_torch = [p.clone().to(device) for p in params]
    for p, v, st, d in zip(by_torch, u.to(device).split(sizes), steps.tolist(), decays.tolist(), strict=True):
        p.mul_(d).add_(v, alpha=-st)
    same = all(_same(a, b) for a, b in zip(on_device, cpu, strict=True))
    torch_same = all(_same(a, b) for a, b in zip(by_torch, cpu, strict=True))
    row(f"1-bit LAMB's scaled step in one kernel, n={n}", same,
        f"{len(cuts)} tensors: {'equal to' if same else 'differs from'} the CPU's bits (torch's ops per tensor on "
        f"{device.type}: {'the same' if torch_same else 'other'} bits)")


def _layout_sum(v) -> float:
    """fp64 ``v`` (numpy) summed in the layout's order: tiles of REDUCE_TILE, REDUCE_LANES lanes each in order,
    the halving tree, the tiles in order."""
    import numpy as np

    from lightning_onebit.compress.kernels.layout import REDUCE_LANES, REDUCE_TILE

    total = 0.0
    for lo in range(0, v.size, REDUCE_TILE):
        tile = v[lo:lo + REDUCE_TILE]
        padded = np.zeros(-(-tile.size // REDUCE_LANES) * REDUCE_LANES)  # + 0.0 changes no sum
        padded[:tile.size] = tile
        lanes = np.cumsum(padded.reshape(-1, REDUCE_LANES), axis=0)[-1]  # each lane in order
        h = REDUCE_LANES // 2
        while h:
            lanes = lanes[:h] + lanes[h:2 * h]
            h //= 2
        total += float(lanes[0])
    return total


def check_lamb_stats(device: torch.device, n: int) -> None:
    """1-bit LAMB's layer statistics by the cuda backend's kernel (one launch a bucket) against their definition:
    the maxima of d / d_fresh in IEEE's fp32 roundings (a GPU's torch ops', reported), the dot products summed in
    fp64 in the layout's order; and with the synced momentum shifted in and the moments written in the same pass,
    the bits of the CPU's shift and moments kernels."""
    import numpy as np

    from lightning_onebit.compress.kernels import numba_cuda as kc

    g = torch.Generator().manual_seed(12)
    cuts, sizes = _random_layers(n, 30, g)
    u, d, f = torch.randn(n, generator=g), torch.rand(n, generator=g) + 0.5, torch.rand(n, generator=g)
    params = [torch.randn(k, generator=g) for k in sizes]
    out = torch.empty(4, len(sizes), device=device)
    kc.lamb_stats([p.to(device) for p in params], u.to(device), d.to(device), f.to(device), cuts, out, eps=1e-8,
                  eps_inside_sqrt=True)
    ratio = torch.from_numpy(d.numpy() / np.sqrt(f.numpy() + np.float32(1e-8)))  # IEEE's fp32 roundings
    by_torch = (d.to(device) / (f.to(device) + 1e-8).sqrt()).cpu()  # torch's ops where the kernel ran
    want = torch.empty(4, len(sizes))
    for k, (lo, size) in enumerate(zip(cuts, sizes, strict=True)):
        x, q = u[lo:lo + size].double().numpy(), params[k].double().numpy()
        want[0, k] = ratio[lo:lo + size].max() if size else -float("inf")
        for r, (a, b) in enumerate(((x, x), (x, q), (q, q)), 1):
            want[r, k] = float(np.float32(_layout_sum(a * b)))
    # with the moments written in the same pass: the CPU kernel's fresh variance, u and maxima, bit for bit
    from lightning_onebit.optim import functional_lamb as FL

    old, synced, mask = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.arange(0, n, 7)
    divisors = (torch.rand(len(sizes), generator=g) + 0.3).tolist()  # the layers' scaling coefficients
    m, prev, f_cpu, u_cpu = old.clone(), torch.empty(n), f.clone(), torch.empty(n)
    FL.shift_in_(list(prev.split(sizes)), list(m.split(sizes)), list(synced.split(sizes)), divisors)
    m[mask] = 0.0
    maxima = FL.lamb_moments_(*(list(t.split(sizes)) for t in (m, prev, f_cpu, d, u_cpu)), [0.7] * len(sizes),
                              beta1=0.9, beta2=0.999, eps=1e-8, eps_inside_sqrt=True)
    u_cpu[mask] = 0.0
    f_dev, u_dev, both = f.to(device), torch.empty(n, device=device), torch.empty(4, len(sizes), device=device)
    m_dev, prev_dev = old.to(device), torch.empty(n, device=device)
    kc.lamb_stats([p.to(device) for p in params], u_dev, d.to(device), f_dev, cuts, both, eps=1e-8,
                  eps_inside_sqrt=True, exp_avg=m_dev, prev=prev_dev, mask=mask.to(device), beta1=0.9,
                  beta2=0.999, bias_correction=0.7, synced=synced.to(device),
                  divisors=torch.tensor(divisors, device=device))
    moments = (_same(m_dev.cpu(), m) and _same(prev_dev.cpu(), prev) and _same(f_dev.cpu(), f_cpu)
               and _same(u_dev.cpu(), u_cpu) and _same(both[0].cpu(), maxima))
    same = _same(out.cpu(), want) and moments
    row(f"1-bit LAMB's layer statistics in one kernel, n={n}", same,
        f"the shift and the moments in the same pass: {'equal to' if moments else 'differ from'} the CPU kernels' "
        "bits; "
        f"{len(cuts)} tensors: the maxima and dot products {'equal to' if same else 'differ from'} IEEE's ratios' "
        f"maxima and fp64 sums in the layout's order (torch's ratios on {device.type}: "
        f"{'the same' if torch.equal(by_torch, ratio) else 'other'} bits)")


def check_lamb_factors(device: torch.device) -> None:
    """1-bit LAMB's layer factors by the cuda backend's kernel (one launch for a param group's layers) against the
    fp64 torch ops it replaces, on the device: the same bits (NaN and an undefined share among the layers)."""
    from lightning_onebit.optim import functional as F
    from lightning_onebit.optim import functional_lamb as FL

    g = torch.Generator().manual_seed(13)
    n = 300
    stats = torch.rand(4, n, generator=g) * 3
    stats[2] -= 1.5
    stats[0, :3] = torch.tensor([9.0, 0.1, float("nan")])
    stats[1:, 3] = 0.0
    last = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    freeze = torch.rand(n, generator=g, dtype=torch.float64) * 2
    kw = dict(weight_decay=0.05, lr=3e-3, factor_threshold=0.1, factor_min=0.5, factor_max=4.0)
    runs = []
    for kernel in (True, False):
        ls, out = last.to(device, copy=True), (torch.empty(n, device=device), torch.empty(n, device=device))
        steps = FL.layer_factors_(stats.to(device), ls, freeze.to(device), **kw, out=out if kernel else None,
                                  work=torch.empty(5, n, dtype=torch.float64, device=device),
                                  undefined=torch.empty(n, dtype=torch.bool, device=device))
        if not kernel:  # the torch ops' own fp32 step sizes and decays
            out[0].copy_(steps)
            out[1].copy_(steps.mul_(kw["weight_decay"]).neg_().add_(1.0))
        runs.append([t.cpu().nan_to_num(7.0) for t in (ls, *out)])
    same = all(_same(a, b) for a, b in zip(*runs, strict=True))
    ran = getattr(F.get_backend(device), "lamb_factors", None) is not None
    row("1-bit LAMB's layer factors in one kernel", same,
        f"{n} layers: {'equal to' if same else 'differ from'} the fp64 torch ops on {device.type}"
        + ("" if ran else f" (the {device.type} backend has no kernel: the torch ops both times)"))


def check_lamb_flat(device: torch.device) -> None:
    """1-bit LAMB's moments and momentum shift on a bucket's whole buffers against the same torch ops per tensor,
    on the device: the same bits (elementwise ops; a maximum is exact; a GPU's square root is IEEE's)."""
    from lightning_onebit.optim import functional_lamb as FL

    sizes = [300, 0, 7, 4099, 1 << 16]
    runs = []
    for whole in (True, False):
        g = torch.Generator().manual_seed(5)
        m, prev, f, d, u, new = (torch.randn(sum(sizes), generator=g).to(device) for _ in range(6))
        f.abs_()
        d.abs_().add_(0.1)
        views = [list(t.split(sizes)) for t in (m, prev, f, d, u, new)]
        flat = FL.Flat(m, prev, f, d, u, torch.tensor(sizes, device=device), torch.empty_like(m)) if whole else None
        mx = FL.lamb_moments_(*views[:5], [0.25] * len(sizes), beta1=0.9, beta2=0.999, eps=1e-8,
                             eps_inside_sqrt=True, flat=flat)
        FL.shift_in_(views[1], views[0], views[5], [0.5, 1.0, 3.0, 1.7, 0.3], flat=(prev, m) if whole else None)
        runs.append((mx, m, prev, f, u))
    same = all(_same(a, b) for a, b in zip(*runs, strict=True))
    row("1-bit LAMB's moments on whole buffers", same,
        f"{len(sizes)} tensors: {'the same bits as' if same else 'other bits than'} the ops per tensor")


def run_checks(device: torch.device, sizes: list[int], args: argparse.Namespace) -> None:
    """Every check of the module docstring that ``device`` and ``--only`` allow, then the table of their rows."""
    t0 = time.time()
    gpu = device.type == "cuda"
    want = set(args.only or GROUPS)
    environment(device)
    if "parity" in want:
        check_parity(device, sizes)
        check_sink_parity(device, 100 if args.cudasim else (1 << 20) + 3)
        check_lamb_scaled_step(device, 100 if args.cudasim else (1 << 20) + 3)
        check_lamb_stats(device, 100 if args.cudasim else (1 << 20) + 3)
        check_lamb_factors(device)
        if gpu:  # on a CPU the numba kernels run instead (tests/test_fused.py compares the torch ops there)
            check_lamb_flat(device)
    if "device" in want:
        if gpu:
            check_stream_order(device)
            check_sync_debug(device)
        check_cluster_pieces(device, 120 if args.cudasim else 1 << 20)  # the simulator pays per launch
        check_resume(device)
        check_device_skip(device)
        check_local_step_drop(device)
        if gpu:  # two processes on one device; the simulator's run is the cudasim suite's two-rank test
            check_device_skip_ranks(device)
            check_diloco_offload(device)  # (on CPU tensors offload changes nothing)
    if gpu and "throughput" in want:
        check_throughput(device, [1 << 20, 1 << 26] if args.quick else [1 << 20, 1 << 24, 1 << 26, 1 << 27])
        profile_kernels(device)
    if gpu and "step" in want:
        check_step(device, "17M")
        profile_step(device, "17M")
        if not args.quick:
            check_step(device, "100M")
    if gpu and "profile" in want:
        profile_call(device, args.trace)
    if gpu and "capture" in want:
        check_step_sync_free(device)
        check_graph_replay(device)  # last: a capture that fails can leave the device's RNG unusable
    print("\n| check | status | detail |\n|---|---|---|")
    for check, status, detail in ROWS:
        print(f"| {check} | {status} | {detail} |")
    print(f"\n{len(FAILED)} failed check(s) in {time.time() - t0:.0f} s" + (f": {', '.join(FAILED)}" if FAILED else ""))


if __name__ == "__main__":
    sys.exit(main())
