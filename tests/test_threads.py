"""Results do not depend on numba's thread count; torch's thread count is left alone; one thread
budget per rank; a torchrun-launched resume continues exactly."""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from proc_utils import run as proc_run

HERE = Path(__file__).parent
ROOT = HERE.parent

# Everything numeric the package does on CPU: codecs, the pipelined collective (simulated), and
# training steps of a transformer LM with three algorithms; then a hash of every result.
RUN = textwrap.dedent("""
    import hashlib, json, sys
    import torch, numba
    sys.path.insert(0, {root!r})
    from lightning_onebit import CDAdam, OnebitAdam, OnebitLamb
    from lightning_onebit.comm import SimulatedCluster
    from lightning_onebit.compress import MinMaxUInt8Codec, SignCodec
    from recipes.lm import MarkovSource, TinyLM, lm_loss

    h = hashlib.sha256()
    add = lambda t: h.update(t.detach().contiguous().numpy().tobytes())
    g = torch.Generator().manual_seed(0)
    n = 300_001
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    for codec in (SignCodec("l2"), SignCodec("l1", block_size=4096), MinMaxUInt8Codec()):
        err = torch.randn(n, generator=g)
        enc = codec.encode_error_feedback(x, err, groups=[0, 17, 70_000])
        add(enc.codes), add(enc.scales), add(err), add(codec.decode(enc))
        add(codec.decode_mean(codec.encode(x[:300_000], nseg=4)))
    sim = SimulatedCluster(SignCodec(), "error_feedback", 3, pieces=3, groups=[0, 5, 1000])
    for _ in range(2):
        for out in sim.allreduce([torch.randn(50_000, generator=g) for _ in range(3)]):
            add(out)
    source = MarkovSource(32, 3, seed=0)
    for cls, kw in ((OnebitAdam, dict(warmup_steps=3)), (OnebitLamb, dict(warmup_steps=3)), (CDAdam, {{}})):
        torch.manual_seed(0)
        net = TinyLM(vocab=32, d_model=32, ff=64, context=16)
        opt = cls(net.parameters(), lr=1e-2, simulate_workers=2, **kw)
        for step in range(6):
            grads = []
            for w in range(2):
                net.zero_grad()
                lm_loss(net, source.sample(8, 17, torch.Generator().manual_seed(10 * step + w))).backward()
                grads.append([p.grad.clone() for p in net.parameters()])
            opt.step_workers(grads)
        for p in net.parameters():
            add(p)
    print(json.dumps({{"hash": h.hexdigest(), "torch_threads": torch.get_num_threads(),
                       "numba_threads": numba.get_num_threads(), "layer": numba.threading_layer()}}))
""")


def _run(env: dict[str, str]) -> dict:
    proc = proc_run([sys.executable, "-c", RUN.format(root=str(ROOT))], timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.budget(50)  # one interpreter per thread count
def test_same_bits_with_1_2_and_3_numba_threads():
    """Codecs, the collective and training steps give the same bits whatever numba's thread count,
    and numba never changes torch's (OMP_NUM_THREADS=1 stays 1: numba's OpenMP layer used to raise
    it to numba's count on its first kernel, so the model's own math depended on numba's threads)."""
    runs = {t: _run({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": str(t)}) for t in (1, 2, 3)}
    assert {r["hash"] for r in runs.values()} == {runs[1]["hash"]}, runs
    assert all(r["torch_threads"] == 1 for r in runs.values()), runs
    assert all(runs[t]["numba_threads"] == t for t in runs), runs
    assert runs[1]["layer"] != "omp"


def test_thread_budget_rule(monkeypatch):
    import numba

    from lightning_onebit.compress.kernels import threads

    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_logged", set())
    monkeypatch.setattr(threads, "available_cores", lambda: 16)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 16)
    monkeypatch.setattr(numba, "get_num_threads", lambda: 16)
    try:
        msg = threads.apply_thread_budget(4)
        assert threads.thread_budget() == 4 and "16 cores / 4 ranks" in msg
        assert threads.apply_thread_budget(4) is None  # logged once
        threads.apply_thread_budget(64)
        assert threads.thread_budget() == 1
        monkeypatch.setenv("NUMBA_NUM_THREADS", "3")
        msg = threads.apply_thread_budget(4)
        assert threads.thread_budget() is None and "NUMBA_NUM_THREADS=3" in msg  # the user's choice wins
    finally:
        threads.set_thread_budget(None)


def test_the_budget_outlives_the_thread_count_its_own_kernels_set(monkeypatch):
    """A kernel launch sets numba's count to the budget; applying the budget again afterwards (the
    optimizer under torchrun, after the strategy compiled the kernels) keeps it, where it used to
    take that count for the user's choice and drop the budget. A count the user sets still wins."""
    import numba

    from lightning_onebit.compress.kernels import threads

    count = {"n": 16}
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "_logged", set())
    monkeypatch.setattr(threads, "_applied", None)
    monkeypatch.setattr(threads, "available_cores", lambda: 16)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 16)
    monkeypatch.setattr(numba, "get_num_threads", lambda: count["n"])
    monkeypatch.setattr(numba, "set_num_threads", lambda n: count.update(n=n))
    try:
        threads.apply_thread_budget(4)
        threads.parallel_kernel(lambda: None)()  # a launch: numba's count becomes the budget
        assert count["n"] == 4
        threads.apply_thread_budget(4)
        assert threads.thread_budget() == 4
        numba.set_num_threads(3)  # the user's
        msg = threads.apply_thread_budget(4)
        assert threads.thread_budget() is None and "numba.set_num_threads(3)" in msg
    finally:
        threads.set_thread_budget(None)


FIT = textwrap.dedent("""
    import json, os, sys
    import lightning as L
    import numba, torch
    sys.path.insert(0, {tests!r})
    import lightning_onebit
    from lightning_onebit.compress.kernels import thread_budget
    from lit_models import DigitsMLP

    class Probe(L.Callback):
        threads = {{}}  # torch's thread count at the start of each step

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.threads[trainer.global_step] = torch.get_num_threads()

        def on_train_end(self, trainer, pl_module):
            out = {{"budget": thread_budget(), "numba": numba.get_num_threads(), "torch": self.threads,
                   "step": trainer.global_step}}
            name = os.path.join({out!r}, f"{{sys.argv[1]}}_rank{{trainer.global_rank}}")
            with open(name + ".json", "w") as f:
                json.dump(out, f)
            torch.save([p.detach().clone() for p in pl_module.parameters()], name + ".pt")

    if __name__ == "__main__":
        mode = sys.argv[1]
        trainer = L.Trainer(strategy=lightning_onebit.OnebitAdamStrategy(warmup=5), accelerator="cpu", devices=2,
                            max_epochs=1 if mode == "first" else 2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()])
        trainer.fit(DigitsMLP(), ckpt_path=os.path.join({out!r}, "epoch1.ckpt") if mode == "resume" else None)
        if mode == "first":
            trainer.save_checkpoint(os.path.join({out!r}, "epoch1.ckpt"))
""")


def _torchrun(script: Path, mode: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), mode]
    # a rank that dies of a signal prints its Python and C++ stacks (faulthandler, c10's handler)
    env = {**env, "PYTHONFAULTHANDLER": "1", "TORCH_SHOW_CPP_STACKTRACES": "1"}
    proc = proc_run(cmd, timeout=600, env=env, cwd=script.parent)
    if proc.returncode != 0:  # pytest.fail: the whole report, where an assert message would be cut
        pytest.fail(f"torchrun {mode}: exit code {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n"
                    f"{proc.stderr[-12000:]}", pytrace=False)


@pytest.mark.slow
@pytest.mark.budget(70)  # torchrun jobs
def test_torchrun_resume_is_exact_with_numba_at_its_default(tmp_path):
    """torchrun, 2 processes, numba left at its default: 1 epoch + save_checkpoint, then fit(ckpt_path)
    for the second epoch ends with the parameters of the uninterrupted 2-epoch run (it did not: the
    resumed process's first step ran with torch's own thread count, the uninterrupted one with the
    thread count numba had set; with this small MLP the bits happen to agree, the thread counts do
    not). Each rank runs the kernels with cores / 2 threads."""
    script = tmp_path / "fit.py"
    script.write_text(FIT.format(tests=str(HERE), out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_NUM_THREADS", "OMP_NUM_THREADS"))}
    env["PYTHONPATH"] = str(ROOT)
    for mode in ("full", "first", "resume"):
        _torchrun(script, mode, env)
    import torch

    full, resumed = (json.loads((tmp_path / f"{m}_rank0.json").read_text()) for m in ("full", "resume"))
    assert full["step"] == resumed["step"] == 16  # 8 steps an epoch; compression from step 6
    # torch computed every step with torchrun's OMP_NUM_THREADS=1 in both runs (numba's OpenMP layer
    # used to raise it to numba's count at the first kernel: not yet at the resumed process's first step)
    assert set(full["torch"].values()) == {1} and resumed["torch"] == {k: 1 for k in full["torch"] if int(k) >= 8}
    for rank in (0, 1):
        a, b = (torch.load(tmp_path / f"{m}_rank{rank}.pt") for m in ("full", "resume"))
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), f"rank {rank} differs after the resume"
    from lightning_onebit.compress.kernels.threads import available_cores

    assert full["budget"] == max(1, available_cores() // 2) and full["numba"] == full["budget"]
