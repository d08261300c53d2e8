"""Training over the example Energon dataset (``data/example/energon``), DP 4 on spawned gloo ranks.

Each DP rank reads its own part of the shards through Energon's WorkerConfig; bad samples are skipped
(``--max-bad-examples``). One spawn trains, 3 iterations of 8 samples at dropout 0: post-balancing off and
on (losses within 1e-5: which rank computes which example changes nothing); on, stopped at iteration 2
with a checkpoint and resumed from it (mid-epoch: Energon's shuffle buffer and position in each rank's
shard come back from the loader state in the checkpoint; post-balancing has read steps ahead by then);
and over a JSONL manifest of the same examples in the order Energon yields them (the same losses).
Then, at DP 1 and 2 with dropout on, a run that saves every 2 iterations, the same run resumed from each
of its checkpoints and a run that never saves give the same losses bit for bit.
"""
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from pretrain_outcome import pretrain_outcome

pytestmark = pytest.mark.distributed
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "data" / "example"
DP, MICRO_BATCH, GLOBAL_BATCH, ITERS, SEED, MAX_BAD = 4, 1, 8, 3, 7, 64
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", str(MICRO_BATCH),
          "--global-batch-size", str(GLOBAL_BATCH), "--train-iters", str(ITERS), "--lr", "2e-3", "--log-interval", "1",
          "--seed", str(SEED), "--distributed-backend", "gloo", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--max-bad-examples", str(MAX_BAD)]
BALANCED = ["--orch-post-balancing", "--orch-gpus-per-node", "2"]
RUNS = {
    "off": [],
    "on": BALANCED,
    "first": BALANCED + ["--exit-interval", "2"],  # + --save
    "second": BALANCED,                            # + --load
    "jsonl": ["--allow-external-media"],             # --data-path: the manifest in Energon's order (example media)
}


def _energon_order() -> list:
    """The manifest line of every sample position of the runs: what Energon gives each DP rank, in
    Megatron's order (micro-batch step k, rank r, slot j: position (k * DP + r) * MICRO_BATCH + j)."""
    from megatron.energon import WorkerConfig

    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.data import checked_dataset
    from megatron_orch.mllm.data_config import DataConfig

    config = DataConfig(load_model_config("tiny"), seq_length=128, micro_batch_size=MICRO_BATCH,
                        num_samples=ITERS * GLOBAL_BATCH, seed=SEED, data_path=str(EXAMPLE / "energon"),
                        max_bad_examples=MAX_BAD)
    dataset, steps = checked_dataset(config), ITERS * GLOBAL_BATCH // (DP * MICRO_BATCH)
    lines = [None] * (ITERS * GLOBAL_BATCH)
    for rank in range(DP):
        worker_config = WorkerConfig(rank=rank, world_size=DP, num_workers=0, seed_offset=SEED)
        batches = iter(dataset.train_loader(worker_config, MICRO_BATCH, MAX_BAD))
        for step in range(steps):
            for slot, encoded in enumerate(next(batches)):
                lines[(step * DP + rank) * MICRO_BATCH + slot] = int(encoded.where.rsplit(":", 1)[1])
    return lines


def _train(rank, world_size, out_dir, manifest):
    warnings.filterwarnings("ignore")
    out = Path(out_dir)
    for name, flags in RUNS.items():
        flags = COMMON + flags + ["--data-path", manifest if name == "jsonl" else str(EXAMPLE / "energon")]
        if name == "first":
            flags += ["--save", str(out / "checkpoint")]
        if name == "second":
            flags += ["--load", str(out / "checkpoint")]
        outcome = pretrain_outcome(flags, world_size, losses="lm_loss", skipped="bad_examples")
        torch.save(outcome, out / f"{name}_rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("energon_training")
    entries = (EXAMPLE / "manifest.jsonl").read_text().splitlines()
    order = _energon_order()
    manifest = out / "energon_order.jsonl"
    with open(manifest, "w") as f:
        for line in order:
            entry = json.loads(entries[line - 1])
            for key in ("images", "audio"):
                entry[key] = [str(EXAMPLE / p) for p in entry.get(key, [])]
            f.write(json.dumps(entry) + "\n")
    run_distributed(_train, DP, str(out), str(manifest), timeout_s=600.0)
    return order, {name: torch.load(out / f"{name}_rank{DP - 1}.pt") for name in RUNS}


def test_every_rank_reads_its_own_part_and_skips_the_bad_samples(runs):
    order, _ = runs
    good = {n for n, line in enumerate((EXAMPLE / "manifest.jsonl").read_text().splitlines(), start=1)
            if n % 7 not in (3, 5, 0)}
    assert set(order) <= good, sorted(set(order) - good)
    by_rank = [{order[(step * DP + rank) * MICRO_BATCH + j] for step in range(len(order) // (DP * MICRO_BATCH))
                for j in range(MICRO_BATCH)} for rank in range(DP)]
    for a in range(DP):
        for b in range(a + 1, DP):
            assert not by_rank[a] & by_rank[b], (a, b, by_rank)  # disjoint parts of the shards


def test_balancing_off_and_on_give_the_same_losses(runs):
    _, results = runs
    off, on = results["off"], results["on"]
    assert "error" not in off and "error" not in on, (off, on)
    assert sorted(off["losses"]) == list(range(1, ITERS + 1)) and off["losses"].keys() == on["losses"].keys()
    for it in off["losses"]:
        assert np.isfinite(off["losses"][it])
        assert abs(off["losses"][it] - on["losses"][it]) <= 1e-5 * abs(off["losses"][it]), (it, off, on)
    assert sum(off["skipped"].values()) > 0 and off["skipped"] == on["skipped"]
    assert any("bad example skipped" in line and "shard_" in line for line in off["lines"]), off["lines"]


def test_a_run_stopped_and_resumed_mid_epoch_gives_the_uninterrupted_losses(runs):
    _, results = runs
    first, second, whole = results["first"], results["second"], results["on"]
    assert "error" not in first and "error" not in second, (first, second)
    assert sorted(first["losses"]) == [1, 2] and sorted(second["losses"]) == [3], (first, second)
    assert {**first["losses"], **second["losses"]} == whole["losses"]
    assert {**first["skipped"], **second["skipped"]} == whole["skipped"]


def test_the_same_examples_as_jsonl_and_as_energon_give_the_same_losses(runs):
    _, results = runs
    jsonl, energon = results["jsonl"], results["off"]
    assert "error" not in jsonl, jsonl
    assert sum(jsonl["skipped"].values()) == 0  # the manifest holds the good samples Energon yielded
    for it in energon["losses"]:
        assert abs(jsonl["losses"][it] - energon["losses"][it]) <= 1e-5 * abs(energon["losses"][it]), (it, jsonl)


# ------------------------------------------------------------------- resume exact, bit for bit, dropout on

RESUME_ITERS = 6
RESUME_COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
                 "--train-iters", str(RESUME_ITERS), "--lr", "2e-3", "--log-interval", "1", "--seed", str(SEED),
                 "--distributed-backend", "gloo", "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                 "--max-bad-examples", str(MAX_BAD), "--data-path", str(EXAMPLE / "energon")]
RESUMES = {"never": [], "every2": ["--save", "{out}", "--save-interval", "2"],
           "from2": ["--load", "{out}", "--ckpt-step", "2"], "from4": ["--load", "{out}", "--ckpt-step", "4"]}


def _save_and_resume(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    for name, flags in RESUMES.items():
        flags = RESUME_COMMON + [flag.format(out=str(Path(out_dir) / "checkpoint")) for flag in flags]
        outcome = pretrain_outcome(flags, world_size, losses="lm_loss", skipped="bad_examples")
        torch.save(outcome, Path(out_dir) / f"{name}_rank{rank}.pt")


@pytest.mark.parametrize("dp", [1, 2])
def test_saving_and_resuming_from_every_checkpoint_changes_no_loss_bit(tmp_path, dp):
    """The cause this guards: torch's DataLoader drew its workers' seed from the global torch RNG at the first
    read, which a resumed run makes after restoring the RNG streams: dropout then differed from iteration 3."""
    run_distributed(_save_and_resume, dp, str(tmp_path), timeout_s=600.0)
    results = {name: torch.load(tmp_path / f"{name}_rank{dp - 1}.pt") for name in RESUMES}
    for name, outcome in results.items():
        assert "error" not in outcome, (name, outcome)
    never = results["never"]
    assert sorted(never["losses"]) == list(range(1, RESUME_ITERS + 1)) and sum(never["skipped"].values()) > 0
    assert results["every2"]["losses"] == never["losses"] and results["every2"]["skipped"] == never["skipped"]
    for name, start in (("from2", 2), ("from4", 4)):
        later = {it: loss for it, loss in never["losses"].items() if it > start}
        assert results[name]["losses"] == later, (name, results[name]["losses"], later)
