"""The host work of a compression-phase step on the CUDA path, held to budgets.

``benchmarks/gpu_host_path.py`` counts it on the CPU, under numba's CUDA simulator with the kernels
stubbed (in a child process: the simulator must be on before numba is imported), for 1-bit Adam on an
MLP of 6 tensors in 3 buckets and a GPT-like model of 100 tensors in 13, on 1 rank and on 2 gloo ranks
with DDP's comm hook, the sync in the hook (policy "raise") or in ``step()`` (policy "skip", the strategies'
default), the exchanges on gloo's path for CPU tensors or on the one a GPU's NCCL group takes. A change
that adds a launch, a copy, a host read, a torch op or an allocation per step fails here, long before a GPU
shows it in a profile.

The budgets are ceilings per step: today's counts. The targets of the CUDA host path stand beside each
as ``per_bucket(n)``: when a change brings a count down, lower its ceiling with it (to the target once
it is met), so that the gain cannot be lost unnoticed.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from proc_utils import run as proc_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_host_path.py"
sys.path.insert(0, str(SCRIPT.parent))
from host_counters import HostPathCounter  # noqa: E402

BUCKETS = {"mlp": 3, "gpt": 13}
# (model, world size, where the compressed sync runs: DDP's hook or step(), the exchanges' path)
CASES = (("mlp", 1, "step", "gloo"), ("gpt", 1, "step", "gloo"),
         *((m, 2, sync, exchange) for exchange in ("gloo", "nccl") for sync in ("hook", "step")
           for m in ("mlp", "gpt")))


def per_bucket(n: int) -> dict[tuple, int]:
    """A budget of ``n`` per bucket, for every case."""
    return {case: n * BUCKETS[case[0]] for case in CASES}


# Ceilings per compression-phase step (after the first), by (model, world size): what is counted today
# (the table in benchmarks/GPU.md), the target beside each.
LAUNCHES = per_bucket(5)  # the target
CONVERSIONS = per_bucket(0)  # the target: kernel arrays made once per memory and geometry
# blocking: none (at 2 ranks the agreement's signature is staged in a buffer of its own, pinned on a GPU)
H2D_COPIES = per_bucket(0)  # the target
# none: the step is decided on the device (at 2 ranks from the gathered signatures; in DDP's hook bucket by
# bucket) and its flags go to the host without a wait (a non-blocking copy a step or a bucket, counted apart)
D2H_READS = per_bucket(0)  # the target
# the flags' non-blocking copy: one a step, DDP's hook's buckets' verdicts included (sent together in step())
D2H_ASYNC = dict.fromkeys(CASES, 1)
# at 1 rank nothing a bucket (the update is the decode kernel's): the gradients of every bucket in one foreach
# copy, and the step's flags (stacked, ANDed, copied to the host); at 2 ranks on gloo's path mostly its exchange of
# CPU tensors, on NCCL's three collectives a bucket, the gathered server scales' check (2) and the flags (the
# agreement's one copy of its two, the verdict; in DDP's hook the buckets' verdicts go to the host in one copy a
# step, and each DDP bucket's gradients are copied in one op)
TORCH_OPS = {("mlp", 1, "step", "gloo"): 4, ("gpt", 1, "step", "gloo"): 4,
             ("mlp", 2, "hook", "gloo"): 82, ("gpt", 2, "hook", "gloo"): 351,
             ("mlp", 2, "step", "gloo"): 81, ("gpt", 2, "step", "gloo"): 341,
             ("mlp", 2, "hook", "nccl"): 25, ("gpt", 2, "hook", "nccl"): 104,
             ("mlp", 2, "step", "nccl"): 24, ("gpt", 2, "step", "nccl"): 94}  # target: per_bucket(3)
ALLOCATIONS = per_bucket(0)  # the target

BUDGETS = {"launches": LAUNCHES, "conversions": CONVERSIONS, "h2d": H2D_COPIES, "d2h": D2H_READS,
           "d2h_async": D2H_ASYNC, "torch_ops": TORCH_OPS, "allocations": ALLOCATIONS}

#: the counters whose count per bucket is already the same with 6 tensors a bucket as with 100 (at one
#: world size); the target: every counter of BUDGETS
SAME_PER_BUCKET = {"launches", "conversions", "h2d", "d2h", "allocations"}
#: what a step counts once whatever its buckets, by (counter, world size): none
PER_STEP: dict[tuple[str, int], int] = {}


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> dict[tuple, dict[str, list[int]]]:
    """{case: {counter: its count in each counted step}}, from one run of the benchmark."""
    out = tmp_path_factory.mktemp("host_path") / "counts.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", LIGHTNING_ONEBIT_BACKEND="cuda")
    proc = proc_run([sys.executable, str(SCRIPT), "--steps", "4", "--timed", "0", "--timeout", "120",
                     "--sync", "hook", "step", "--exchange", "gloo", "nccl", "--json", str(out)], env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {(r["model"], r["world"], r["sync"], r["exchange"]) for r in results} == set(CASES)
    for r in results:
        assert r["buckets"] == BUCKETS[r["model"]], r
        assert not r.get("ranks_differ"), f"the ranks counted {r['ranks_differ']} otherwise"
        assert list(r["kinds"]) == ["compression"], r["kinds"].keys()
    return {(r["model"], r["world"], r["sync"], r["exchange"]): r["kinds"]["compression"] for r in results}


@pytest.mark.cudasim
@pytest.mark.budget(60)  # the benchmark in a child process (about 15 s): 2 ranks forked from it, then 1
@pytest.mark.parametrize("counter", list(BUDGETS))
def test_host_work_per_step_within_budget(counted, counter):
    over = {case: (max(counted[case][counter]), budget) for case, budget in BUDGETS[counter].items()
            if max(counted[case][counter]) > budget}
    assert not over, f"{counter} per step (counted, budget) over budget: {over}"


@pytest.mark.cudasim
@pytest.mark.budget(60)  # the benchmark's run, when this test runs first
def test_host_work_is_the_same_every_step(counted):
    """A count that changes from one compression-phase step to the next (a cache that never hits, a
    buffer made anew) fails, and so would the ceilings' meaning."""
    changing = {(case, c): v for case, kinds in counted.items() for c, v in kinds.items()
                if c in BUDGETS and len(set(v)) != 1}
    assert not changing, changing


@pytest.mark.cudasim
@pytest.mark.budget(60)  # the benchmark's run, when this test runs first
def test_host_work_per_bucket_does_not_grow_with_its_tensors(counted):
    for c in SAME_PER_BUCKET:
        for rest in {case[1:] for case in CASES}:
            once = PER_STEP.get((c, rest[0]), 0)
            mlp, gpt = counted[("mlp", *rest)][c][0] - once, counted[("gpt", *rest)][c][0] - once
            assert mlp / BUCKETS["mlp"] == gpt / BUCKETS["gpt"], (c, rest, mlp, gpt)
    # at 1 rank the torch ops are the step's alone: none a bucket, none a tensor
    ops = {m: counted[(m, 1, "step", "gloo")]["torch_ops"][0] for m in BUCKETS}
    assert len(set(ops.values())) == 1, ops


def test_counter_tells_host_from_device_data():
    """The counter alone, on plain CPU tensors: what it calls a copy, a read and an allocation."""
    c = HostPathCounter()
    dev = torch.arange(4.0)  # made before it tracks: a device tensor
    with c.tracking():
        table = torch.from_numpy(np.arange(4))  # host data
        host = torch.tensor([1.0, 2.0])
        with c.window():
            moved = table.to(dev.device)  # 1 copy, the table stays a host tensor
            dev.copy_(host.repeat(2))  # 1 copy (and a host tensor made)
            made = torch.tensor([3.0], device=dev.device)  # 1 copy, 1 allocation
            picked = dev[table]  # 1 copy (the index), 1 allocation
            moved.add_(1)  # in place: no allocation
            assert bool(dev.sum() > 0) and len(dev.tolist()) == 4  # 2 reads
            host.copy_(dev[:2])  # 1 read
            host.copy_(dev[2:], non_blocking=True)  # into pinned memory on a GPU: waits for nothing
            _ = dev.shape, dev.numel(), dev.dtype  # metadata: nothing
        counts = c.take()
    assert c.is_host(table) and c.is_host(host)
    assert not (c.is_host(moved) or c.is_host(made) or c.is_host(picked) or c.is_host(dev))
    # allocations: made, picked, dev.sum() and its comparison; on the host: host.repeat(2)
    assert (counts["h2d"], counts["d2h"], counts["allocations"], counts["host_allocations"]) == (4, 3, 4, 1), counts
    assert counts["d2h_async"] == 1, counts
    assert counts["launches"] == counts["conversions"] == 0
    assert counts["ops"]["copy_"] == 3 and "numel" not in counts["ops"], counts["ops"]


# 0/1 Adam's local steps, as a GPU takes them (its flags kept on the device, the torch ops of its updates):
# nothing per bucket, whatever its tensors; per step, for all buckets at once, the gradients' foreach copy, the
# workers' finiteness check, written into buffers made once, a flagged worker's gradients zeroed (the buckets'
# gradients are slices of one buffer: one op), the moments' two foreach ops and the parameters' two, and the flags
# added to the interval's counts
LOCAL_PER_BUCKET, LOCAL_PER_STEP, LOCAL_ALLOCATIONS = 0, 10, 0
# and what a synchronising step adds to them (its parameters are not moved: -2 a step): per bucket the new factors,
# made on the host and copied without a wait (the anchor's update is the decode kernel's, predicated on the calls'
# flags) and, with several ranks, the gathered server scales' flag, which rides in the next call's agreement; per
# step the parameters rebuilt from the anchors and u zeroed (one foreach op each), the interval's dropped-gradient
# counts sent to the host without a wait and zeroed, and the agreements' flags stacked, ANDed and sent to the host
# without a wait: nothing is read
SYNC_PER_BUCKET, SYNC_PER_STEP = 2, 5


@pytest.fixture(scope="module")
def one_rank_counted(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """{(algorithm, model): {kind of step: {counter: its count in each counted step}}} of ``ZeroOneAdam`` and
    ``OnebitLamb`` on 1 rank, from one run of the benchmark."""
    out = tmp_path_factory.mktemp("host_path_one_rank") / "counts.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", LIGHTNING_ONEBIT_BACKEND="cuda")
    proc = proc_run([sys.executable, str(SCRIPT), "--algorithm", "ZeroOneAdam", "OnebitLamb", "--world", "1",
                     "--timed", "0", "--json", str(out)], env=env, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {(r["algorithm"], r["model"]): r["kinds"] for r in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def local_counted(one_rank_counted) -> dict[str, dict[str, list[int]]]:
    """{model: {counter: its count in each counted local step}} of ``ZeroOneAdam`` on 1 rank."""
    return {m: kinds["local"] for (a, m), kinds in one_rank_counted.items() if a == "ZeroOneAdam"}


# 1-bit LAMB's compressed step as a GPU takes it: ceilings, today's counts. The update decodes the synced momentum
# and one launch a bucket shifts it in and writes its moments, u and its layer statistics (maxima and dot products,
# in the group's buffer), its layer factors are one launch a step for all buckets, its scaled step one launch a
# bucket: 7 launches a bucket, not 5, and one a step; no torch op a bucket and a few a step (the gradients' copy for
# all buckets, the flags, the buckets' flags gathered for the factors), nothing per tensor, nothing allocated.
# Every write is predicated on the calls' flags: no read
LAMB_TORCH_OPS = {"mlp": 5, "gpt": 5}
LAMB_ALLOCATIONS = {"mlp": 0, "gpt": 0}
LAMB_READS = {"mlp": 0, "gpt": 0}
LAMB_LAUNCHES_PER_BUCKET = 7
LAMB_LAUNCHES_PER_STEP = 1


@pytest.mark.cudasim
@pytest.mark.budget(60)  # the benchmark in a child process, 1 rank (about 20 s), when this test runs first
def test_onebit_lamb_step_within_budget(one_rank_counted):
    for model in BUCKETS:
        counts = one_rank_counted[("OnebitLamb", model)]["compression"]
        assert {c: max(counts[c]) for c in ("conversions", "h2d")} == {"conversions": 0, "h2d": 0}, (model, counts)
        launches = LAMB_LAUNCHES_PER_BUCKET * BUCKETS[model] + LAMB_LAUNCHES_PER_STEP
        assert max(counts["launches"]) <= launches, (model, counts["launches"])
        assert max(counts["torch_ops"]) <= LAMB_TORCH_OPS[model], (model, counts["torch_ops"])
        assert max(counts["allocations"]) <= LAMB_ALLOCATIONS[model], (model, counts["allocations"])
        assert max(counts["d2h"]) <= LAMB_READS[model], (model, counts["d2h"])


@pytest.mark.cudasim
@pytest.mark.budget(40)  # the benchmark in a child process, 1 rank (about 10 s)
def test_a_local_step_reads_nothing_and_its_work_per_bucket_does_not_grow_with_its_tensors(local_counted):
    for model, counts in local_counted.items():
        assert {c: max(counts[c]) for c in ("launches", "conversions", "h2d", "d2h")} == dict.fromkeys(
            ("launches", "conversions", "h2d", "d2h"), 0), (model, counts)
        ops = max(counts["torch_ops"])
        assert ops <= LOCAL_PER_STEP + LOCAL_PER_BUCKET * BUCKETS[model], (model, ops)
        assert max(counts["allocations"]) <= LOCAL_ALLOCATIONS, (model, counts["allocations"])
    assert len({(max(c["torch_ops"]) - LOCAL_PER_STEP) / BUCKETS[m] for m, c in local_counted.items()}) == 1


@pytest.mark.cudasim
@pytest.mark.budget(60)  # the benchmark in a child process, 1 rank (about 20 s), when this test runs first
def test_a_synchronisation_makes_no_kernel_array_and_copies_without_waiting(one_rank_counted):
    """0/1 Adam's interval synchronisation sends ``u / sums`` with new sums each time: they go into its
    expression's own factor buffer by a copy that does not wait (one a bucket), not into a new tensor that each
    launch would describe to numba again. Its buckets' calls run together and are decided on the device: the
    dropped-gradient counts and the calls' flags reach the host by copies that do not wait, read at the next step,
    so nothing is read and nothing allocated; the anchor's update is applied by the decode kernel, predicated on the
    flags, so its torch ops do not grow with the tensors."""
    for model in BUCKETS:
        counts = one_rank_counted[("ZeroOneAdam", model)]["sync"]
        assert max(counts["conversions"]) == max(counts["h2d"]) == max(counts["allocations"]) == 0, (model, counts)
        assert max(counts["d2h"]) == 0 and max(counts["d2h_async"]) <= 2, (model, counts)
        per_bucket = LOCAL_PER_BUCKET + SYNC_PER_BUCKET
        assert max(counts["torch_ops"]) <= LOCAL_PER_STEP + SYNC_PER_STEP + per_bucket * BUCKETS[model], (
            model, counts["torch_ops"])
        assert max(counts["h2d_async"]) <= BUCKETS[model], (model, counts["h2d_async"])
        assert max(counts["launches"]) <= 5 * BUCKETS[model], (model, counts["launches"])


@pytest.mark.cudasim
@pytest.mark.budget(40)  # the benchmark in a child process, 2 ranks forked from it (about 8 s)
def test_a_synchronisation_of_two_ranks_reads_its_agreements_once(tmp_path):
    """0/1 Adam's synchronisation on 2 ranks (NCCL's path): its buckets' calls run together and are decided on
    the device (the dropped-gradient count riding in the first call's gathered signatures), so the host reads
    nothing, launches 5 kernels a bucket and allocates nothing, as at 1 rank."""
    out = tmp_path / "counts.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", LIGHTNING_ONEBIT_BACKEND="cuda")
    proc = proc_run([sys.executable, str(SCRIPT), "--algorithm", "ZeroOneAdam", "--world", "2", "--sync", "hook",
                     "--exchange", "nccl", "--timed", "0", "--timeout", "120", "--json", str(out)], env=env,
                    timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in json.loads(out.read_text()):
        counts, n = r["kinds"]["sync"], BUCKETS[r["model"]]
        assert max(counts["d2h"]) == 0 and max(counts["allocations"]) == 0, (r["model"], counts)
        assert max(counts["launches"]) <= 5 * n and max(counts["h2d"]) == 0, (r["model"], counts)
