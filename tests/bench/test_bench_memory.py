"""The activation-memory benchmark: its saved-bytes counter against hand-counted bytes, and a run of the
benchmark itself (tiny model, meta tensors) that writes its JSON, tells the uncapped step (every encoder
activation kept: more than upstream) from the default one, and finds the default one within 1.1x of upstream."""
import json
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.bench import memory  # noqa: E402


def test_saved_bytes_counts_each_storage_once_while_autograd_holds_it():
    encoder, backbone = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
    params = {p.untyped_storage()._cdata for m in (encoder, backbone) for p in m.parameters()}
    counter = memory.SavedBytes(params, encoders=("vision",))
    counter.booking(encoder, "vision")
    counter.booking(backbone, "llm")
    x = torch.randn(5, 8, requires_grad=True)
    with counter.saving():
        h = encoder(x)  # saves x (its weight is a parameter: left out)
        y = torch.tanh(h)  # saves its output, outside any booked module
        out = backbone(y)  # saves y again: the same storage, counted once, booked to its first saver
        assert counter.live == {"vision": 5 * 8 * 4, "other": 5 * 8 * 4}
        assert counter.total == counter.peak_total == 2 * 5 * 8 * 4 and counter.peak_encoders == 5 * 8 * 4
        out.sum().backward()
    del h, y, out
    assert counter.total == 0 and counter.live_encoders == 0  # released as autograd frees them
    assert counter.peak == {"vision": 160, "other": 160}


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "memory.json"
    result = memory.main(["--model", "tiny", "--dp", "2", "--per-rank", "16", "--gpus-per-node", "2",
                          "--json", str(path)])
    return result, json.loads(path.read_text())


@pytest.mark.distributed
def test_the_default_step_stays_within_upstreams_peak(tiny_result):
    result, written = tiny_result
    summary = result["summary"]
    assert written["summary"] == json.loads(json.dumps(summary))
    assert set(summary) == {"upstream", "balanced", "recompute", "uncapped"}
    assert written["ranks"] == [0, 1]
    up = summary["upstream"]
    assert up["peak_gb"] > 0 and up["encoder_peak_gb"] > 0
    assert summary["balanced"]["peak_vs_upstream"] <= 1.1
    assert summary["recompute"]["peak_vs_upstream"] <= 1.1
    # keeping every encoder activation through the backbone needs more: the measurement can tell
    assert summary["uncapped"]["encoder_peak_vs_upstream"] > 1.5
    assert summary["uncapped"]["peak_gb"] > summary["balanced"]["peak_gb"]
    # recompute keeps nothing through the backbone: never more than the default, which keeps what fits
    assert summary["recompute"]["peak_gb"] <= summary["balanced"]["peak_gb"]


def test_per_gpu_table_adds_up_from_the_plan(tmp_path):
    """``--per-gpu`` (tiny, DP 4 x TP 2 x PP 2): every row is its kinds' sum; the backbone's in-flight tokens are
    the busiest replica's most in any two (stage 0) or one (stage 1) consecutive micro-batches, by hand, at most
    the padded ones; the encoders' kept bytes are the plan's kept chunks (the first stage's), spread over the
    stages with the encoders on every GPU; encoder TP 1 holds the encoders whole."""
    import numpy as np
    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.workload import phase_items
    from megatron_orch.bench.common import draw_sizes
    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.orchestrator.config import OrchestratorConfig
    from megatron_orch.orchestrator.encoder_ranks import spread_over_stages
    from megatron_orch.orchestrator.gpu_memory import ParallelLayout
    from megatron_orch.orchestrator.step_plan import plan_step

    result = memory.main(["--per-gpu", "--model", "tiny", "--dp", "4", "--tensor-parallel", "2",
                          "--pipeline-stages", "2", "--per-rank", "8", "--gpus-per-node", "4", "--seq-length", "2048",
                          "--json", str(tmp_path / "per_gpu.json")])
    rows = {(r["layout"]["encoder_ranks"], r["layout"]["encoder_tensor_parallel"], r["backbone_microbatches"]): r
            for r in result["rows"]}
    assert len(rows) == 6 == len(result["rows"])
    for row in rows.values():
        assert row["total"] == pytest.approx(row["parameters"] + row["gradients"] + row["optimizer"]
                                             + row["backbone_activations"] + row["encoder_activations"])
        assert row["total"] == pytest.approx(max(row["stages_total"]))
    config, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), 4, 8, "tiny", 0, seq_length=2048)
    plan = plan_step(sizes, config.phases(), OrchestratorConfig(background=False, verify_first_step=False,
                                                                microbatching="equal_count"),
                     Topology.uniform(4, 2), micro_batch_size=1, num_microbatches=8)
    tokens = np.zeros((4, 8))
    np.add.at(tokens, (plan.examples_backbone.rank, plan.microbatch_of_example), sizes.num_tokens)
    pairs = (tokens[:, 1:] + tokens[:, :-1]).max()
    layout = ParallelLayout(4, 2, 2)
    assert memory.own_in_flight_tokens(plan, sizes.num_tokens, layout) == [pairs, tokens.max()]
    assert pairs <= 2 * 2048
    items = phase_items(sizes, config.phases())
    kept = sum(np.asarray(plan.encoders[p].chunks.kept) * items[p].memory[0] for p in ("vision", "audio"))
    assert memory.encoder_kept_bytes(plan, items, layout) == pytest.approx(kept.max())
    every = memory.encoder_kept_bytes(plan, items, ParallelLayout(4, 2, 2, "all"))
    assert 0 < every <= kept.max()
    group = spread_over_stages(plan, 2)  # encoder TP 1 under TP 2: each stage's items over its two TP ranks
    halves = sum(-(-np.asarray(group.chunks[p].kept) // 2) * items[p].memory[0] for p in ("vision", "audio"))
    assert memory.encoder_kept_bytes(plan, items, ParallelLayout(4, 2, 2, "all", 1)) == pytest.approx(halves.max())
    assert halves.max() < every
    first, all_, own_tp = (rows[(r, e, "own lengths")] for r, e in (("first-stage", None), ("all", None), ("all", 1)))
    assert first["encoder_activations"] == pytest.approx(kept.max() / 2 / 1e9)
    assert all_["parameters"] == pytest.approx(first["parameters"]) and own_tp["parameters"] > all_["parameters"]
    assert rows[("all", None, "padded")]["backbone_activations"] >= all_["backbone_activations"]
