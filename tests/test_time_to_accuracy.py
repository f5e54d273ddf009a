"""The reporting of benchmarks/time_to_accuracy.py on rows written here: the target is DDP's loss at 80% of
its budget, time to target is the first validation at or below it, the learning rate is chosen per run by
the final loss, and the verdict compares the package's best with the best peer."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import time_to_accuracy as tta  # noqa: E402
import tta_report as report  # noqa: E402
import tta_runs  # noqa: E402
import workloads  # noqa: E402
from methods import TTA_DILOCO_H  # noqa: E402


def _run(method, losses, seconds_per_step, lr=1e-3, seed=0, rate="100mbit"):
    points = [{"step": 10 * (i + 1), "train_s": 10 * (i + 1) * seconds_per_step, "tx": 1e6 * (i + 1),
               "val_loss": v} for i, v in enumerate(losses)]
    return {"method": method, "lr": lr, "seed": seed, "rate": rate, "nodes": 2, "ranks_per_node": 1, "steps": 50,
            "points": points, "rounds_per_step": 1.0, "bytes_per_step": 1e5, "compute_alone_s": 0.1}


def test_target_time_to_target_lr_choice_and_verdict():
    ddp = _run("ddp_adamw", [2.0, 1.5, 1.2, 1.0, 0.9], 1.0)  # at 80% of 50 steps (step 40): 1.0
    assert report.target_of([ddp], "2 nodes x 1 rank, 100mbit", 0) == 1.0
    ours = _run("zero_one_adam", [1.8, 1.1, 0.95, 0.9, 0.85], 0.2)  # reaches 1.0 at step 30, 6 s
    ours_bad_lr = _run("zero_one_adam", [1.9, 1.7, 1.6, 1.5, 1.4], 0.2, lr=3e-3)
    peer = _run("powersgd_r4", [1.9, 1.4, 1.1, 1.0, 0.95], 0.5)  # step 40, 20 s
    never = _run("qadam", [2.0, 1.9, 1.8, 1.7, 1.6], 0.1)
    rows = report.best_lr([ddp, ours, ours_bad_lr, peer, never])
    assert {(r["method"], r["lr"]) for r in rows} == {("ddp_adamw", 1e-3), ("zero_one_adam", 1e-3),
                                                      ("powersgd_r4", 1e-3), ("qadam", 1e-3)}
    assert report.to_target(ours, 1.0)["train_s"] == 6.0 and report.to_target(never, 1.0) is None
    table = report.tables(rows)
    # beyond compute: 6 s less 30 steps x 0.1 s of compute alone
    assert "| zero_one_adam | 0.001 | 6 | 3 | 30 | 3 | 1/1 |" in table
    assert "| qadam | 0.001 | - | - | - | - | 0/1 |" in table
    assert "6.67x" in table  # DDP's 40 s over 6 s
    verdict = report.verdict(rows)
    assert "best of the package zero_one_adam 6.0 s, best peer powersgd_r4 20.0 s: 3.33x" in verdict
    assert "zero_one_adam 3.0 s, powersgd_r4 16.0 s: 5.33x" in verdict  # 20 - 40 x 0.1 against 6 - 30 x 0.1
    assert "cost 3.0 s in compute alone: with free communication it would be 6.67x ahead" in verdict  # 20 / 3


def test_a_link_without_ddp_takes_the_target_from_ddp_at_another_link():
    """DDP's curve does not depend on the link: a setting whose runs have no DDP of their own takes the target
    from DDP's run of the same layout, budget and seed at another link (and says so), never from another
    seed or layout; its own DDP run wins where there is one."""
    slow = "2 nodes x 1 rank, 100mbit + 50 ms RTT"
    ddp = _run("ddp_adamw", [2.0, 1.5, 1.2, 1.0, 0.9], 1.0)  # 100mbit, target 1.0
    ours = _run("zero_one_adam", [1.8, 1.1, 0.95, 0.9, 0.85], 0.3, rate="100mbit + 50 ms RTT")
    other_seed = _run("ddp_adamw", [2.0, 1.5, 1.2, 0.7, 0.6], 1.0, seed=1)
    four = {**_run("ddp_adamw", [2.0, 1.5, 1.2, 0.7, 0.6], 1.0), "nodes": 4}
    assert report.target_run([ddp, ours], slow, 0) is ddp and report.target_of([ddp, ours], slow, 0) == 1.0
    assert report.target_of([other_seed, four, ours], slow, 0) is None
    own = _run("ddp_adamw", [2.0, 1.5, 1.2, 1.1, 0.9], 3.0, rate="100mbit + 50 ms RTT")
    assert report.target_of([ddp, own, ours], slow, 0) == 1.1
    table = report.tables([ddp, ours])
    head = f"### {slow}: target val_loss 1 (DDP + AdamW at 80% of 50 steps; for seeds [0] from its run at another link"
    assert head in table
    assert "| zero_one_adam | 0.001 | 9 |" in table  # step 30 at 0.3 s a step
    peer = _run("powersgd_r4", [1.9, 1.4, 1.1, 1.0, 0.95], 0.5, rate="100mbit + 50 ms RTT")
    assert f"- {slow}: best of the package zero_one_adam 9.0 s, best peer powersgd_r4 20.0 s: 2.22x; DDP + AdamW " \
        "not run here" in report.verdict([ddp, ours, peer])


def test_the_lm_at_another_batch_is_a_setting_of_its_own_with_its_own_target():
    """``--batch`` changes the workload: its runs table apart and never take DDP's target from the default
    batch's runs (nor the default from theirs)."""
    small = "lm at 4 sequences per rank, 2 nodes x 1 rank, 100mbit"
    ddp16 = _run("ddp_adamw", [2.0, 1.5, 1.2, 1.0, 0.9], 1.0)  # target 1.0
    ours4 = {**_run("diloco_4bit", [1.8, 1.1, 0.95, 0.9, 0.85], 0.3), "batch": 4}
    assert report.setting(ours4) == small and report.setting(ddp16) == "2 nodes x 1 rank, 100mbit"
    assert report.target_of([ddp16, ours4], small, 0) is None
    ddp4 = {**_run("ddp_adamw", [2.0, 1.6, 1.3, 1.2, 1.1], 0.5, rate="1gbit"), "batch": 4}  # target 1.2
    assert report.target_of([ddp16, ddp4, ours4], small, 0) == 1.2
    assert report.target_of([ddp16, ddp4, ours4], "2 nodes x 1 rank, 100mbit", 0) == 1.0
    assert f"### {small}: target val_loss 1.2" in report.tables([ddp16, ddp4, ours4])
    with pytest.raises(SystemExit):  # the MiniLM's batch is the recipe's: --batch would be ignored
        tta.main(["--workload", "minilm", "--batch", "4"])


def test_another_overlap_is_a_run_of_its_own_that_keeps_its_layouts_target():
    """``--overlap`` changes the overlapped methods only: its runs (the peers beside them) table apart, and
    take DDP's target of the same workload and layout; an overlap DiLoCo cannot run is refused."""
    ddp4 = {**_run("ddp_adamw", [2.0, 1.6, 1.3, 1.2, 1.1], 0.5, rate="1gbit"), "batch": 4}  # target 1.2
    ours = {**_run("diloco_4bit_overlap", [1.8, 1.1, 0.95, 0.9, 0.85], 0.3), "batch": 4, "overlap": 4}
    where = "lm at 4 sequences per rank, 2 nodes x 1 rank, 100mbit, overlap 4"
    assert report.setting(ours) == where and report.target_of([ddp4, ours], where, 0) == 1.2
    assert f"### {where}: target val_loss 1.2" in report.tables([ddp4, ours])
    for bad in ("0", str(TTA_DILOCO_H)):
        with pytest.raises(SystemExit):
            tta.main(["--overlap", bad])


def test_bytes_to_other_hosts_counts_writes_to_other_addresses_only():
    """What the rounds are counted from: a connection between two addresses of this host stands for one to
    another node (127.0.0.2 -> 127.0.0.1), one within an address for ranks of one node."""
    import socket

    from _common import bytes_to_other_hosts

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(2)
        same = socket.create_connection(srv.getsockname(), timeout=10)
        same_peer, _ = srv.accept()
        other = socket.socket()
        other.settimeout(10)  # a send that cannot complete fails instead of hanging
        other.bind(("127.0.0.2", 0))
        other.connect(srv.getsockname())
        other_peer, _ = srv.accept()
        with same, same_peer, other, other_peer:
            before = bytes_to_other_hosts()
            same.sendall(b"x" * 100_000)
            assert bytes_to_other_hosts() == before
            other.sendall(b"y" * 300_000)
            other_peer.sendall(b"z" * 5)
            assert bytes_to_other_hosts() - before == 300_005  # acknowledged or still queued, both counted


def test_smoothing_judges_the_mean_of_the_last_validations():
    """--smooth 2: DDP's swinging loss gives the target as the mean of its validations at steps 30 and 40, and
    a run reaches it when the mean of its last two does, not at one lucky validation."""
    ddp = _run("ddp_adamw", [2.0, 1.0, 1.4, 0.8, 1.0], 1.0)
    lucky = _run("onebit_adam", [1.9, 0.7, 1.9, 1.1, 0.9], 0.2, lr=1e-3)  # 0.7 at step 20 is below either target
    for p, acc in zip(lucky["points"], [0.5, 0.5, 0.5, 0.5, 1.0], strict=True):
        p["val_acc"] = acc
    assert report.target_of([ddp], "2 nodes x 1 rank, 100mbit", 0) == 0.8  # each validation on its own
    assert report.to_target(lucky, 0.8)["step"] == 20
    smooth = report.smoothed([ddp, lucky], 2)
    assert [p["step"] for p in smooth[0]["points"]] == [20, 30, 40, 50]  # a full window first
    assert report.target_of(smooth, "2 nodes x 1 rank, 100mbit", 0) == 1.1  # (1.4 + 0.8) / 2
    assert report.to_target(smooth[1], 1.1)["step"] == 50  # (1.1 + 0.9) / 2; 1.3 at step 20, 1.5 at step 40
    assert smooth[1]["points"][-1]["val_acc"] == 0.75 and lucky["points"][1]["val_loss"] == 0.7  # not in place
    assert report.smoothed([ddp], 1) == [ddp]
    with pytest.raises(ValueError, match="only 5 validations"):
        report.smoothed([ddp], 6)


def test_minilm_validates_on_both_classes_and_the_same_sentences_for_every_seed():
    """The dev split lists its positive reviews first: its first 512 sentences were all positive, so the
    validation loss measured the model's bias more than its quality."""
    pytest.importorskip("transformers")
    import torch

    def dev(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, val = workloads.tta_data("minilm", seed, 0, 2, 1)
        return torch.cat([b["input_ids"][:, :8].flatten() for b in val]), torch.cat([b["labels"] for b in val])

    (ids, labels), (ids_1, labels_1) = dev(0), dev(1)
    assert len(labels) == workloads.MINILM_VAL and 0.45 < labels.float().mean().item() < 0.55
    assert torch.equal(ids, ids_1) and torch.equal(labels, labels_1)


def test_an_accuracy_target_counts_from_below():
    """--metric val_acc: the target is DDP's accuracy at 80% of its budget, reached at the first validation
    at or above it; the tables and the verdict rank by that time."""
    accs = {"ddp_adamw": [0.5, 0.6, 0.7, 0.8, 0.85], "diloco": [0.6, 0.7, 0.75, 0.78, 0.79],
            "diloco_4bit": [0.6, 0.7, 0.8, 0.8, 0.81]}
    rows = [_run(m, [1.0] * 5, 0.5 if m == "ddp_adamw" else 0.2) for m in accs]
    for r in rows:
        for p, a in zip(r["points"], accs[r["method"]], strict=True):
            p["val_acc"] = a
    assert report.target_of(rows, "2 nodes x 1 rank, 100mbit", 0, "val_acc") == 0.8
    assert report.to_target(rows[1], 0.8, "val_acc") is None and report.to_target(rows[2], 0.8, "val_acc")["step"] == 30
    table = report.tables(rows, "val_acc")
    assert "target val_acc 0.8 " in table and "| diloco | 0.001 | - | - | - | - | 0/1 |" in table
    assert "| diloco_4bit | 0.001 | 6 |" in table and "3.33x |" in table  # DDP's 20 s over 6 s
    # fp32 DiLoCo never gets there, so the best peer is DDP itself
    assert "diloco_4bit 6.0 s, best peer ddp_adamw 20.0 s: 3.33x" in report.verdict(rows, "val_acc")


def test_panels_plot_only_the_named_settings_and_keep_the_others_targets(tmp_path, capsys):
    """``--panels`` draws a column for each named setting only; a setting left out still gives its target
    (here DDP's at 100 Mbit/s for the run with round trips), and a name with no runs is an error."""
    import json

    from matplotlib.image import imread

    slow = "2 nodes x 1 rank, 100mbit + 50 ms RTT"
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps([_run("ddp_adamw", [2.0, 1.5, 1.2, 1.0, 0.9], 1.0),
                               _run("zero_one_adam", [1.8, 1.1, 0.95, 0.9, 0.85], 0.3, rate="100mbit + 50 ms RTT")]))
    for panels, columns in (([slow], 1), ([], 2)):
        out = tmp_path / f"tta{columns}.md"
        assert tta.main(["--report", str(raw), "--out", str(out), *(["--panels", *panels] if panels else [])]) == 0
        assert imread(out.with_suffix(".png")).shape[1] == 650 * columns  # 6.5 in a column at 100 dpi
    assert f"### {slow}: target val_loss 1 (DDP" in out.read_text()
    with pytest.raises(SystemExit):
        tta.main(["--report", str(raw), "--panels", "4 nodes x 1 rank, 100mbit"])
    assert "--panels: no runs of ['4 nodes x 1 rank, 100mbit']" in capsys.readouterr().err


def test_a_node_of_two_ranks_counts_its_link_once_and_its_ranks_sockets_together():
    """Two ranks of one node read the node's one veth counter: its bytes are the counter's, not twice them;
    each rank's sockets count its own writes, so the node's writes in a step are the two ranks' together."""
    def rank(train_s, sent):
        return {"points": [{"step": 10, "train_s": train_s, "tx": 5e6, "val_loss": 1.0}],
                "step_tx": [2e6, 3e6], "step_sent": sent}

    run = tta_runs.merge_ranks([rank(4.0, [3000, 0]), rank(5.0, [3000, 100])], local=2)
    assert run["points"] == [{"step": 10, "train_s": 5.0, "tx": 5e6, "val_loss": 1.0}]  # the slowest rank's clock
    assert run["bytes_per_step"] == 2.5e6
    assert run["rounds_per_step"] == 0.5  # 6000 bytes written in step 1 (over 4 KiB), 100 in step 2
