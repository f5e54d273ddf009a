import contextlib
import datetime
import os
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lit_models import DigitsMLP, SaveParams

import lightning_onebit  # noqa: F401  (registers the strategy names)
from lightning_onebit import CommunicationMonitor, CompressedDDPStrategy, OnebitAdamStrategy, PhaseSwitch
from lightning_onebit.strategies.compressed import ALGORITHMS, SHARD_DIR, shard_path

from proc_utils import run as proc_run
from proc_utils import started

HERE = Path(__file__).parent


pytestmark = pytest.mark.usefixtures("fresh_process_group")


def _fit(tmp_path, strategy, model=None, devices=2, max_epochs=2, callbacks=(), ckpt_path=None, **trainer_kw):
    out = tmp_path / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    trainer_kw.setdefault("enable_checkpointing", False)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=max_epochs,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[SaveParams(str(out)), *callbacks], default_root_dir=str(tmp_path), **trainer_kw)
    trainer.fit(model or DigitsMLP(), ckpt_path=ckpt_path)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(devices)], trainer


def _bytes_by_phase(steps):
    warm = [b for _, b, c, _ in steps if not c and b > 0]
    comp = [b for _, b, c, _ in steps if c and b > 0]
    return warm, comp


@pytest.mark.parametrize("name,ratio", [("onebit_adam", 32), ("onebit_lamb", 32), ("qadam", 4), ("cd_adam", None),
                                        ("ef21", None), ("ef_amsgrad", None), ("naive_amsgrad", None)])
def test_every_strategy_fits_and_replicas_agree(tmp_path, name, ratio):
    model = DigitsMLP(optimizer="adamw" if name != "ef21" else "EF21", lr=3e-3 if name != "ef21" else 0.05)
    warmup = 4 if ALGORITHMS[name].has_warmup else None  # the others have none: warmup= would be an error
    strategy = CompressedDDPStrategy(name, warmup=warmup, start_method="forkserver")
    ranks, _ = _fit(tmp_path, strategy, model)
    for p, q in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(p, q)
    assert ranks[0]["duplex"] and all(ranks[0]["duplex"])  # attach() made the twin; the buckets' exchanges use it
    warm, comp = _bytes_by_phase(ranks[0]["steps"])
    assert comp, "no compression-phase step"
    if ratio:
        assert warm, "no warm-up step"
        measured = warm[0] / ranks[0]["payload"]
        assert 0.75 * ratio < measured <= ratio * 1.01, (warm[0], ranks[0]["payload"])
        # a step in which coordinates with no gradient during the short warm-up (pixels, dead ReLU
        # units) start to train also agrees which ones and averages their gradients (OnebitAdam)
        steps = ranks[0]["steps"]
        for (_, b, c, act), (*_, before) in zip(steps[1:], steps, strict=False):
            if c:
                assert b == ranks[0]["payload"] if act == before else b > ranks[0]["payload"]
    else:  # no warm-up: compressed from step 1, ~1 bit per parameter + scales
        assert all(c for _, b, c, _ in ranks[0]["steps"])


@pytest.mark.parametrize("devices", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_exact_resume_across_the_switch(tmp_path, devices):
    """Checkpoint mid-compression, resume (from a path, and with ckpt_path="last"): the same parameters
    as the uninterrupted run. The main file holds no error state; each rank's is in its own shard, and
    ModelCheckpoint's deletions take the shards with the files."""
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)

    def strategy():
        return OnebitAdamStrategy(warmup=5, start_method="forkserver")

    full, _ = _fit(tmp_path / "a", strategy(), devices=devices, max_epochs=4, callbacks=[ck],
                   enable_checkpointing=True)
    path = sorted((tmp_path / "ck").glob("epoch=1*.ckpt"))[0]
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["onebit"]
    assert saved["compressing"] and saved["world_size"] == devices and saved["error_state"] == "shards"
    assert all(c is None for c in saved["comm"]) and "comm_per_rank" not in saved
    shards = [torch.load(shard_path(path, r, devices), weights_only=True) for r in range(devices)]
    assert [s["rank"] for s in shards] == list(range(devices))
    w0, w1 = (s["optimizers"][0][0]["worker"] for s in shards[:2])
    assert not torch.equal(w0, w1), "each rank's own error state must be saved"
    resumed, _ = _fit(tmp_path / "b", strategy(), devices=devices, max_epochs=4, ckpt_path=str(path))
    for p, q in zip(full[0]["params"], resumed[0]["params"], strict=True):
        assert torch.equal(p, q)
    if devices != 2:
        return
    # ckpt_path="last": 2 epochs with save_last and save_top_k=1, then on to 4 from "last"
    ck2 = tmp_path / "ck2"
    _fit(tmp_path / "c", strategy(), max_epochs=2, enable_checkpointing=True,
         callbacks=[ModelCheckpoint(dirpath=ck2, save_last=True, save_top_k=1, every_n_epochs=1)])
    files = sorted(p.name for p in ck2.glob("*.ckpt"))
    assert len(files) == 2 and "last.ckpt" in files  # epoch 0's file was deleted ...
    assert sorted(p.name for p in (ck2 / SHARD_DIR).iterdir()) == files  # ... and its shards with it
    last, _ = _fit(tmp_path / "d", strategy(), max_epochs=4, ckpt_path="last", enable_checkpointing=True,
                   callbacks=[ModelCheckpoint(dirpath=ck2, save_last=True, save_top_k=1, every_n_epochs=1)])
    for p, q in zip(full[0]["params"], last[0]["params"], strict=True):
        assert torch.equal(p, q)
    # another world size: moments and phase kept, per-rank error state reset, with a warning
    with pytest.warns(UserWarning, match="written on 2 ranks, resuming on 1"):
        _, trainer = _fit(tmp_path / "e", OnebitAdamStrategy(warmup=5), devices=1, max_epochs=3,
                          ckpt_path=str(path))
    assert trainer.optimizers[0].compressing


def test_missing_shard_resets_with_a_warning_or_stops_when_strict(tmp_path):
    """A shard that is missing or truncated: a warning naming it and the error state reset (or an error
    with strict_resume=True); a truncated main file: an error naming it; the main file alone loads
    into the LightningModule."""
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
    _fit(tmp_path / "a", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=2, callbacks=[ck],
         enable_checkpointing=True)
    path = sorted((tmp_path / "ck").glob("epoch=1*.ckpt"))[0]
    shard = Path(shard_path(path, 0, 1))
    assert shard.exists()
    _, trainer = _fit(tmp_path / "b", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3, ckpt_path=str(path))
    assert trainer.optimizers[0]._buckets[0].sync.comm.worker.abs().sum() > 0  # the shard came back
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    with pytest.warns(UserWarning, match=f"shard {shard} cannot be read.*error state is reset"):
        _fit(tmp_path / "c", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3, ckpt_path=str(path))
    shard.unlink()
    with pytest.warns(UserWarning, match=f"shard {shard} is missing"):
        _, trainer = _fit(tmp_path / "d", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3,
                          ckpt_path=str(path))
    assert trainer.optimizers[0].compressing  # phase kept
    with pytest.raises(RuntimeError, match="is missing.*strict_resume=True"):
        _fit(tmp_path / "e", OnebitAdamStrategy(warmup=3, strict_resume=True), devices=1, max_epochs=3,
             ckpt_path=str(path))
    model = DigitsMLP.load_from_checkpoint(path)  # the main file alone
    assert torch.equal(model.net[0].weight, torch.load(path, weights_only=False)["state_dict"]["net.0.weight"])
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(RuntimeError, match=f"cannot read the checkpoint file '{path}'"):
        _fit(tmp_path / "f", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3, ckpt_path=str(path))


def test_save_killed_before_the_main_file_resumes_from_the_previous_shard(tmp_path, recwarn):
    """A save killed after the new shards but before the main file was replaced leaves the old main
    file next to new shards: the resume takes the shard kept from the save before (``.prev``), bit for
    bit, without a warning."""
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1, save_last=True)
    _fit(tmp_path / "a", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=2, callbacks=[ck],
         enable_checkpointing=True)
    last, first = tmp_path / "ck" / "last.ckpt", sorted((tmp_path / "ck").glob("epoch=0*.ckpt"))[0]
    shard = Path(shard_path(last, 0, 1))
    assert Path(str(shard) + ".prev").exists()  # the epoch-0 save's shard of last.ckpt
    last.write_bytes(first.read_bytes())  # the epoch-1 save of last.ckpt died before its main file
    ref, _ = _fit(tmp_path / "b", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3, ckpt_path=str(first))
    got, _ = _fit(tmp_path / "c", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3, ckpt_path=str(last))
    assert not [w for w in recwarn if "shard" in str(w.message)]
    for p, q in zip(ref[0]["params"], got[0]["params"], strict=True):
        assert torch.equal(p, q)
    shard.unlink()  # and without the new shard too (the kill came before it was complete)
    got, _ = _fit(tmp_path / "d", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=3, ckpt_path=str(last))
    for p, q in zip(ref[0]["params"], got[0]["params"], strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("rank_kwargs,needle", [
    ({"warmup_steps": [5, 7]}, "warmup_steps: rank 0 5, rank 1 7"),
    ({"warmup_comm_dtype": ["bf16", None]}, "warmup_comm_dtype: rank 0 torch.bfloat16, rank 1 torch.float32"),
    ({"block_size": [None, 16]}, "param group 0: block_size: rank 0 None, rank 1 16"),
])
def test_ranks_that_disagree_fail_at_setup_on_every_rank(tmp_path, rank_kwargs, needle):
    """Settings that differ between ranks fail before the first collective, on every rank, naming them."""
    model = DigitsMLP(optimizer="OnebitAdam", rank_kwargs=rank_kwargs)
    with pytest.raises(Exception, match="disagree on the training setup") as info:
        _fit(tmp_path, OnebitAdamStrategy(warmup=None, start_method="forkserver"), model=model, max_epochs=1)
    assert needle in str(info.value)


def test_nonfinite_step_is_skipped_on_every_rank(tmp_path):
    """The strategies' default: a NaN gradient on one rank (DDP, compression phase) skips that step on
    both ranks; the fit goes on and the replicas stay identical. on_nonfinite="raise" stops instead."""
    model = DigitsMLP(nan_at=[[1, 10]])
    ranks, trainer = _fit(tmp_path / "a", OnebitAdamStrategy(warmup=5, start_method="forkserver"), model=model,
                          max_epochs=2)
    for p, q in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(p, q)
    assert ranks[0]["skipped_steps"] == ranks[1]["skipped_steps"] == 1
    with pytest.raises(Exception, match="NaN or inf"):
        _fit(tmp_path / "b", OnebitAdamStrategy(warmup=5, on_nonfinite="raise", start_method="forkserver"),
             model=DigitsMLP(nan_at=[[1, 10]]), max_epochs=2)


def test_resume_with_other_algorithm_fails(tmp_path):
    ck = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=-1, every_n_epochs=1)
    _fit(tmp_path / "a", OnebitAdamStrategy(warmup=3), devices=1, max_epochs=1, callbacks=[ck],
         enable_checkpointing=True)
    path = next((tmp_path / "ck").glob("*.ckpt"))
    with pytest.raises(ValueError, match="written with OnebitAdam"):
        _fit(tmp_path / "b", CompressedDDPStrategy("cd_adam"), devices=1, max_epochs=2, ckpt_path=str(path))


def test_gradient_accumulation_communicates_once_per_step(tmp_path):
    ranks, trainer = _fit(tmp_path, OnebitAdamStrategy(warmup=2, start_method="forkserver"), max_epochs=1,
                          accumulate_grad_batches=2)
    r0 = ranks[0]
    assert r0["global_step"] == 4 and r0["comm_steps"] == 4  # 8 batches per rank / 2: one sync per step
    per_step = {s: b for s, b, _, _ in r0["steps"] if s}  # recorded after every micro-batch
    # 2 warm-up + 2 compressed steps, nothing more (a compressed step may add coordinates that start
    # to train, see test_every_strategy_fits_and_replicas_agree)
    assert sorted(per_step) == [1, 2, 3, 4] and r0["bytes_total"] == sum(per_step.values())
    assert per_step[1] == per_step[2] and min(per_step[3], per_step[4]) >= r0["payload"]
    for p, q in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("precision", ["bf16-mixed"])  # on CPU Lightning turns 16-mixed into bf16-mixed
def test_mixed_precision(tmp_path, precision):
    ranks, _ = _fit(tmp_path, OnebitAdamStrategy(warmup=4, start_method="forkserver"), precision=precision)
    for p, q in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(p, q)
    _, comp = _bytes_by_phase(ranks[0]["steps"])
    assert comp


def _scaler_rank(rank, world_size):
    from lightning_onebit.strategies.compressed import _AgreeingGradScaler

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = _AgreeingGradScaler(device="cpu", init_scale=2.0**4)
    (scaler.scale(p.sum())).backward()  # grads = 16 (the scale)
    if rank == 1:
        p.grad[0] = float("inf")  # only rank 1 overflows
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    return p.detach().clone(), scaler.get_scale()


def test_fp16_overflow_skip_is_agreed_across_ranks():
    """The 16-mixed path (used on GPUs): one rank's overflow makes every rank skip the step."""
    from dist_utils import run_ranks, values

    (p0, s0), (p1, s1) = values(run_ranks(_scaler_rank, 2))
    assert torch.equal(p0, torch.ones(4)) and torch.equal(p1, torch.ones(4))  # both skipped
    assert s0 == s1 == 8.0  # both backed off the scale


def test_lr_scheduler_follows_converted_optimizer(tmp_path, recwarn):
    ranks, trainer = _fit(tmp_path, OnebitAdamStrategy(warmup=4), model=DigitsMLP(scheduler=True), devices=1,
                          max_epochs=2)
    # the re-pointed scheduler sees the new optimizer's step() calls, like the one it was built with
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "optimizer.step()" in str(w.message)]
    opt = trainer.optimizers[0]
    assert type(opt).__name__ == "OnebitAdam"
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is opt
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5**2)  # StepLR(1, 0.5), stepped after each of 2 epochs


@pytest.mark.parametrize("model,match", [
    (DigitsMLP(optimizer="sgd"), "needs an Adam-family optimizer"),
    (DigitsMLP(optimizer="CDAdam"), "returned CDAdam"),
    (DigitsMLP(optimizer="adam", weight_decay=0.1), "use torch.optim.AdamW"),
])
def test_setup_errors(tmp_path, model, match):
    with pytest.raises(ValueError, match=match):
        _fit(tmp_path, OnebitAdamStrategy(), model=model, devices=1, max_epochs=1)


def test_package_optimizer_used_as_is(tmp_path):
    model = DigitsMLP(optimizer="OnebitAdam", opt_kwargs={"warmup_steps": 3})
    _, trainer = _fit(tmp_path, OnebitAdamStrategy(), model=model, devices=1, max_epochs=1,
                      callbacks=[CommunicationMonitor()])
    opt = trainer.optimizers[0]
    assert opt.warmup_steps == 3 and opt.compressing
    assert not any(isinstance(cb, PhaseSwitch) for cb in trainer.callbacks)
    assert trainer.callback_metrics["comm/compressing"] == 1.0
    # counted again at the switch: moments, the bucket's gradient, the error state and buffers (one device: the
    # server's cover every element), 16 B a parameter and more
    n = sum(p.numel() for p in model.parameters())
    assert 16 * n <= trainer.callback_metrics["mem/optimizer_state_bytes"] <= 64 * n


def test_auto_phase_switch_picks_a_sensible_point(tmp_path):
    switch = PhaseSwitch("auto", tol=0.1, check_every=4, patience=2, min_steps=8)
    _, trainer = _fit(tmp_path, OnebitAdamStrategy(), devices=1, max_epochs=8, callbacks=[switch])
    total = trainer.global_step
    assert switch.switch_step is not None and 8 <= switch.switch_step <= total // 2, (switch.switch_step, total)
    changes = [c for _, c in switch.history]
    assert changes[0] > switch.tol  # v was still moving early on
    assert trainer.callback_metrics["train_loss"] < 0.5


SCRIPT = textwrap.dedent("""
    import sys
    import lightning as L
    import torch
    sys.path.insert(0, {tests!r})
    import lightning_onebit  # registers the names
    from lit_models import DigitsMLP, SaveParams

    if __name__ == "__main__":
        trainer = L.Trainer(strategy="onebit_adam", accelerator="cpu", devices=2, max_epochs=2, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            callbacks=[SaveParams({out!r})])
        trainer.fit(DigitsMLP())
""")


@pytest.mark.budget(40)  # the popen launcher re-runs the script per rank
def test_strategy_string_with_the_default_launcher(tmp_path):
    """strategy="onebit_adam" re-launches the script per rank (Lightning's popen launcher), like ddp."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(HERE), out=str(tmp_path)))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    proc = proc_run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "converted AdamW to OnebitAdam" in proc.stdout + proc.stderr
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for p, q in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p, q)
    assert any(c for _, _, c, _ in r0["steps"])  # 15% of 16 steps of warm-up, then compression


def test_monitor_without_a_compressed_optimizer_fails_before_the_first_step(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[CommunicationMonitor()],
                        default_root_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"CommunicationMonitor needs a lightning_onebit optimizer.*AdamW"):
        trainer.fit(DigitsMLP(optimizer="adamw"))
    assert trainer.global_step == 0


def test_adam_converted_to_onebit_lamb_warns_about_the_learning_rate():
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.warns(UserWarning, match=r"AdamW to OnebitLamb with the same lr \(0.001\).*lr \* \|\|w\|\|"):
        new = CompressedDDPStrategy("onebit_lamb")._convert(torch.optim.AdamW(params, lr=1e-3))
    assert type(new).__name__ == "OnebitLamb" and new.defaults["lr"] == 1e-3


@pytest.mark.budget(40)
def test_forkserver_launch_gives_what_spawn_gives(tmp_path, monkeypatch):
    """Lightning's own forkserver launch hands CPU ranks the model in shared memory (every rank then
    steps the same parameters) and the forkserver's environment and RNG; ours gives each rank its own
    copy, the launching process's environment (set here after the forkserver started) and its seed,
    so the fit equals a spawned one bit for bit. Its DataLoader workers fork, as a torchrun rank's do,
    instead of starting a forkserver of their own."""
    monkeypatch.setenv("LIGHTNING_ONEBIT_PROBE", "set by the test")
    spawned, _ = _fit(tmp_path / "s", OnebitAdamStrategy(warmup=4, start_method="spawn"), max_epochs=1)
    forked, _ = _fit(tmp_path / "f", OnebitAdamStrategy(warmup=4, start_method="forkserver"), max_epochs=1)
    for a, b in zip(spawned, forked, strict=True):
        # DigitsMLP() seeds 0 in the launching process; the forkserver's own generator has torch's default seed
        assert (a["probe"], a["rng"]) == (b["probe"], b["rng"]) == ("set by the test", 0)
        for p, q in zip(a["params"], b["params"], strict=True):
            assert torch.equal(p, q)
        assert b["start_method"] == ("fork" if sys.platform.startswith("linux") else b["start_method"])


def test_process_group_keys_are_those_of_the_torchrun_attempt(monkeypatch):
    """torchrun keeps its store across restarts; a restarted rank must not see the keys (gloo's
    listening addresses) the ranks of the attempt before it wrote."""
    from lightning_onebit.comm.process_group import attempt_store

    timeout = datetime.timedelta(seconds=10)
    server = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert attempt_store(timeout) is None  # not under torchrun: env:// as usual
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    attempt_store(timeout).set("default_pg/0//cpu//0/rank_1", "the killed rank's address")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not attempt_store(timeout).check(["default_pg/0//cpu//0/rank_1"])
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt_store(timeout).check(["default_pg/0//cpu//0/rank_1"])


_EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys, time
    import torch, torch.distributed as dist
    from lightning_onebit.strategies import destroy_process_group_at_exit
    # atexit runs handlers last-in first-out: this one runs after ours
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    dist.init_process_group("gloo")
    held = dist.group.WORLD  # as a DDP model or an optimizer in a global holds it: it outlives the destroy
    destroy_process_group_at_exit()
    destroy_process_group_at_exit()  # idempotent

    class SlowToFinalize:  # releases the GIL while the interpreter finalises, as closing a file does
        def __del__(self):
            time.sleep(2.0)

    if dist.get_rank() == 0:
        time.sleep(1.0)  # joins late: rank 1's worker completes the collective after rank 1 began to exit
        dist.all_reduce(torch.ones(8))
    else:
        slow = SlowToFinalize()
        slow.cycle = slow  # collected by the interpreter's last garbage collection, in finalisation
        del slow
        t = torch.ones(8)
        work = dist.all_reduce(t, async_op=True)
        # a callback needs the GIL in the worker thread once the work completes, as releasing a
        # work whose tensor has its Python object does
        work.get_future().then(lambda fut: None)
        time.sleep(0.3)  # the worker has taken the work and waits for rank 0 inside the collective
""")


def test_gloo_exit_waits_for_the_workers_and_destroys_the_group(tmp_path):
    """A gloo worker that needs the GIL after the interpreter began to finalise ends its thread
    inside a destructor: "terminate called without an active exception", SIGABRT, after a run that
    completed. Here rank 1's worker completes a collective (and runs a callback) one second into
    rank 1's exit, as a worker the OS had not scheduled yet does; the exit hook must wait for it
    (without the wait rank 1 aborts every time) and destroy the group."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(started([sys.executable, "-c", _EXIT_SCRIPT], tmp_path / f"rank{r}.log",
                                             env={**env, "RANK": str(r)})) for r in (0, 1)]
        codes = [p.wait(timeout=120) for p in procs]
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert codes == [0, 0], logs
    assert all("initialized at exit: False" in log for log in logs), logs


def _schedulers():
    S = torch.optim.lr_scheduler
    return {
        "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
        "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
        "ConstantLR": lambda o: S.ConstantLR(o, factor=0.5, total_iters=4),
        "LinearLR": lambda o: S.LinearLR(o, start_factor=0.1, total_iters=6),
        "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
        "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=8, power=2.0),
        "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=7),
        "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4),
        "CyclicLR": lambda o: S.CyclicLR(o, base_lr=1e-4, max_lr=1e-2, step_size_up=3),
        "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=20),
        "LambdaLR": lambda o: S.LambdaLR(o, lambda s: 1 / (1 + s)),
        "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda s: 0.8),
        "SequentialLR": lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=4),
                                                     S.CosineAnnealingLR(o, T_max=8)], milestones=[4]),
        "ChainedScheduler": lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=3),
                                                          S.ExponentialLR(o, gamma=0.9)]),
        "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, patience=1, factor=0.5),
    }


@pytest.mark.parametrize("name", list(_schedulers()))
def test_every_lr_scheduler_drives_the_converted_optimizer_as_it_drove_adamw(name):
    """The strategy converts the AdamW a scheduler was built on: every torch scheduler then gives the
    converted optimizer the lr (and Adam beta1, which CyclicLR and OneCycleLR cycle) it gives AdamW,
    step for step, also after its state_dict is loaded into a new pair (a resume)."""
    import warnings

    from lightning_onebit.strategies.compressed import repoint_scheduler

    def pair(convert):
        torch.manual_seed(0)
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))], lr=1e-3)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "lr": 5e-3})
        sched = _schedulers()[name](opt)
        if convert:
            new = CompressedDDPStrategy("onebit_adam")._convert(opt)
            repoint_scheduler(sched, opt, new)
            opt = new
        return opt, sched

    def run(opt, sched, steps):
        seen = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scheduler.step() before optimizer.step()
            for _ in range(steps):
                sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
                seen.append([(g["lr"], g["betas"][0]) for g in opt.param_groups])
        return seen

    ref, got = pair(False), pair(True)
    assert run(*ref, 8) == run(*got, 8)
    resumed_ref, resumed_got = pair(False), pair(True)
    resumed_ref[1].load_state_dict(ref[1].state_dict())
    resumed_got[1].load_state_dict(got[1].state_dict())
    for (a, _), state in ((resumed_ref, ref), (resumed_got, got)):
        for g, h in zip(a.param_groups, state[0].param_groups, strict=True):
            g.update({k: v for k, v in h.items() if k != "params"})  # the optimizer's own state_dict
    assert run(*resumed_ref, 8) == run(*resumed_got, 8)
