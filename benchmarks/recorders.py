"""What the emulated-cluster benchmarks record on each rank while Lightning trains: Lightning callbacks
(lightning is imported inside the factories, so the drivers start fast) and e2e.py's profiler.

:func:`step_timer` (e2e.py): per training step its end time, the node's link counters, the loss, and the
optimizer's phase and byte counters. :func:`recorder` (time_to_accuracy.py): training time with validation
left out, link bytes and bytes written to other nodes per step, and a point per validation. :class:`Profiler`:
cProfile + torch.profiler over a window of steps.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from _common import bytes_to_other_hosts, read_link_counter

__all__ = ["Profiler", "recorder", "step_timer"]


def step_timer(iface: str | None, profile_window: tuple[int, int] | None = None) -> Any:
    """A callback that records, per training step: end time, link counters, loss, compression state."""
    import lightning as L

    class StepTimer(L.Callback):
        def __init__(self) -> None:
            self.t_start = 0.0
            self.ends: list[float] = []
            self.tx: list[int] = []
            self.rx: list[int] = []
            self.loss: list[float] = []
            self.compressing: list[bool] = []
            self.counted: list[int] = []
            self.intra: list[int] = []
            self.profiler: Any = None
            self.profile_text = ""

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.t_start = time.perf_counter()
            self.tx0, self.rx0 = read_link_counter(iface, "tx_bytes"), read_link_counter(iface, "rx_bytes")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if profile_window is not None and batch_idx == profile_window[0]:
                self.profiler = Profiler()
                self.profiler.start()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if self.profiler is not None and batch_idx == profile_window[1] - 1:  # type: ignore[index]
                self.profile_text = self.profiler.stop(profile_window[1] - profile_window[0])  # type: ignore
                self.profiler = None
            self.ends.append(time.perf_counter())
            self.tx.append(read_link_counter(iface, "tx_bytes"))
            self.rx.append(read_link_counter(iface, "rx_bytes"))
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.loss.append(float(loss))
            opt = trainer.strategy.optimizers[0]
            opt = getattr(opt, "_optimizer", opt)
            self.compressing.append(bool(getattr(opt, "compressing", False)))
            counter = getattr(opt, "comm_counter", None)
            self.counted.append(int(counter.total.bytes_sent) if counter is not None else 0)
            intra = getattr(opt, "intra_node_counter", None)
            self.intra.append(int(intra.total.bytes_sent) if intra is not None else 0)

        def step_times(self) -> list[float]:
            prev = [self.t_start, *self.ends[:-1]]
            return [e - s for s, e in zip(prev, self.ends, strict=True)]

    return StepTimer()


class Profiler:
    """cProfile (Python-level attribution, numba kernels included in their callers) + torch.profiler (aten ops
    and gloo collectives) over a window of steps of one rank."""

    def __init__(self) -> None:
        import cProfile

        import torch

        self.cprof = cProfile.Profile()
        self.tprof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def start(self) -> None:
        self.t0 = time.perf_counter()
        self.tprof.start()
        self.cprof.enable()

    def stop(self, steps: int) -> str:
        import io
        import pstats

        self.cprof.disable()
        self.tprof.stop()
        wall = time.perf_counter() - self.t0
        s = io.StringIO()
        s.write(f"profiled {steps} steps, {wall:.3f} s wall, {wall / steps * 1e3:.1f} ms/step (with profiler "
                "overhead)\n\n=== cProfile, sorted by cumulative time (ms per step = cumtime / steps) ===\n")
        st = pstats.Stats(self.cprof, stream=s)
        rows = []
        for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
            rows.append((ct, tt, nc, f"{Path(file).name}:{line}({func})" if line else func, file))
        rows.sort(reverse=True)
        s.write(f"{'cum ms/step':>11} {'self ms/step':>12} {'calls/step':>10}  function\n")
        shown = 0
        for ct, tt, nc, name, file in rows:
            interesting = ("lightning_onebit" in file or "distributed" in file or "ddp_comm_hooks" in file
                           or "optim" in file or name.startswith("<built-in method torch")
                           or "{method" in name or "autograd" in file)
            if not interesting or ct / steps < 0.5e-3:
                continue
            s.write(f"{ct / steps * 1e3:11.1f} {tt / steps * 1e3:12.1f} {nc / steps:10.1f}  {name}\n")
            shown += 1
            if shown >= 40:
                break
        s.write("\n=== cProfile, sorted by self time ===\n")
        rows.sort(key=lambda r: -r[1])
        for ct, tt, nc, name, _file in rows[:15]:
            s.write(f"{ct / steps * 1e3:11.1f} {tt / steps * 1e3:12.1f} {nc / steps:10.1f}  {name}\n")
        s.write("\n=== torch.profiler, sorted by self CPU time (totals over the window) ===\n")
        s.write(self.tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return s.getvalue()


def recorder(iface: str | None) -> Any:
    """A callback that records training time, link bytes and bytes written to other nodes per step, and a point
    (step, training time, link bytes, validation metrics) at every validation."""
    import lightning as L

    class Recorder(L.Callback):
        """Training time (validation excluded), link bytes and validation loss at every validation."""

        def __init__(self) -> None:
            self.train_s, self.t0 = 0.0, 0.0
            self.points: list[dict[str, float]] = []  # step, train_s, tx, val_loss
            self.step_tx: list[int] = []  # bytes on the link per step
            # bytes this rank wrote to other nodes per step (the rounds): the veth counts a step's tail later,
            # when the shaper or a delay line lets it out, and so in the next step
            self.step_sent: list[int] = []

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.tx0 = read_link_counter(iface, "tx_bytes")
            self.last_tx = self.tx0
            self.last_sent = bytes_to_other_hosts()

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            self.train_s += time.perf_counter() - self.t0
            tx = read_link_counter(iface, "tx_bytes")
            self.step_tx.append(tx - self.last_tx)
            self.last_tx = tx
            sent = bytes_to_other_hosts()
            self.step_sent.append(max(0, sent - self.last_sent))  # a closed connection drops out
            self.last_sent = sent

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:
                return
            metrics = trainer.callback_metrics
            self.points.append({"step": trainer.global_step, "train_s": self.train_s,
                                "tx": self.last_tx - self.tx0, "val_loss": float(metrics["val_loss"]),
                                **({"val_acc": float(metrics["val_acc"])} if "val_acc" in metrics else {})})

    return Recorder()


