"""The cluster simulator: its link model against a hand count, its bytes equal to the plan's report and
the balancing benchmark's (one accountant), and a small run whose JSON is consistent with itself."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from megatron_orch.balance.cost_profile import PhaseFit, profile_dict
from megatron_orch.balance.plan import Placement, Transfer
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import DEFAULT_MIXTURE
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench import balance as bench_balance
from megatron_orch.bench.balance import backbone_only_plan
from megatron_orch.bench.common import PLAN_METHODS, draw_sizes, upstream_plan
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import plan_step
from megatron_orch.sim import __main__ as sim_main
from megatron_orch.sim.cluster import SIM_METHODS, LinkModel, model_state_bytes, simulate_step

TINY = load_model_config("tiny")
PHASES = ("vision", "audio", "llm")  # tiny's phases


def test_alltoall_time_is_the_busiest_ranks_slowest_link():
    link = LinkModel(gpus_per_node=2, nvlink_gbytes_per_s=100.0, nic_gbits_per_s=80.0, nvlink_latency_us=1.0,
                     nic_latency_us=10.0)
    node_of_rank = Topology.uniform(4, 2).node_of_rank
    # items: 0 -> 1 (same node, 4 GB), 0 -> 2 (other node, 1 GB), 3 -> 2 (same node, 1 GB), 2 -> 2 (stays)
    src, dst = Placement.from_ranks([0, 0, 3, 2], 4), Placement.from_ranks([1, 2, 2, 2], 4)
    moved = Transfer(src, dst).moved_bytes(np.array([4e9, 1e9, 1e9, 7e9]), node_of_rank)
    # NVLink: rank 0 sends 4 GB -> 0.04 s; NIC (10 GB/s): rank 0 sends, rank 2 receives 1 GB -> 0.1 s
    assert link.alltoall_seconds(moved) == pytest.approx(0.1 + 10e-6)
    assert (moved.total, moved.intra_node, moved.inter_node) == (13e9, 5e9, 1e9)
    local = Transfer(src, Placement.from_ranks([1, 0, 2, 2], 4)).moved_bytes(np.full(4, 1e9), node_of_rank)
    assert link.alltoall_seconds(local) == pytest.approx(1e9 / 100e9 + 1e-6) and local.inter_node == 0
    with pytest.raises(ValueError, match="nic_gbits_per_s must be > 0"):
        LinkModel(nic_gbits_per_s=0)


def test_bytes_are_one_count_in_report_bench_and_sim():
    """The same batch and flags: plan_step's report (the trainer's log), bench.balance and the simulator
    count the same bytes, every transfer of the step (raw inputs, text, embeddings forward and back), and
    those equal a count by hand from the plan's placements."""
    dp, per_rank, gpus = 16, 4, 4
    specs = list(DEFAULT_MIXTURE)
    _, _, sizes = draw_sizes(specs, dp, per_rank, "tiny", 1)
    items, link = phase_items(sizes, TINY.phases()), LinkModel(gpus_per_node=gpus)
    simulated = simulate_step(sizes, TINY, link)
    bench = bench_balance.run(specs, dp, per_rank, gpus, "tiny", 1, repeats=1, peer_steps=1)
    for sim_method, bench_method in (("orch", "orch"), ("equal_count", "orch_equal_count"),
                                     ("locality", "orch_locality"), ("equal_locality", "orch_equal_locality")):
        plan = plan_step(sizes, TINY.phases(), PLAN_METHODS[sim_method], Topology.uniform(dp, gpus), 1, per_rank)
        node = np.arange(dp) // gpus
        by_hand = {"intra": 0.0, "inter": 0.0}
        for phase, enc in plan.encoders.items():
            flows = [(enc.home.rank, enc.encode.rank, items[phase].nbytes, 1),
                     (enc.encode.rank, plan.examples_backbone.rank[enc.example], items[phase].output_nbytes, 2)]
            for src, dst, nbytes, times in flows:
                by_hand["inter"] += times * nbytes[node[src] != node[dst]].sum()
                by_hand["intra"] += times * nbytes[(node[src] == node[dst]) & (src != dst)].sum()
        src, dst = plan.examples_home.rank, plan.examples_backbone.rank
        by_hand["inter"] += items["llm"].nbytes[node[src] != node[dst]].sum()
        by_hand["intra"] += items["llm"].nbytes[(node[src] == node[dst]) & (src != dst)].sum()
        assert by_hand["inter"] > 0 and by_hand["intra"] > 0, sim_method
        report = plan.report()
        assert report["inter-node MB"] * 1e6 == pytest.approx(by_hand["inter"], rel=1e-12)
        assert report["intra-node MB"] * 1e6 == pytest.approx(by_hand["intra"], rel=1e-12)
        assert simulated[sim_method]["inter_node_bytes"] == pytest.approx(by_hand["inter"], rel=1e-12)
        assert simulated[sim_method]["intra_node_bytes"] == pytest.approx(by_hand["intra"], rel=1e-12)
        bench_inter = sum(bench[phase][bench_method]["inter_node_bytes"] for phase in TINY.phases().names)
        bench_off_gpu = sum(bench[phase][bench_method]["moved_bytes"] for phase in TINY.phases().names)
        assert bench_inter == pytest.approx(by_hand["inter"], rel=1e-12)
        assert bench_off_gpu == pytest.approx(by_hand["inter"] + by_hand["intra"], rel=1e-12)
    verl = backbone_only_plan(sizes, upstream_plan(sizes, TINY.phases().backbone.name))
    for phase in ("vision", "audio"):  # encoder items run on their example's rank: no embeddings move
        np.testing.assert_array_equal(verl.encoders[phase].encode.rank,
                                      verl.examples_backbone.rank[verl.encoders[phase].example])
        assert verl.output_transfer(phase).moved_bytes(items[phase].output_nbytes, node).off_gpu == 0


def test_small_run_gives_consistent_json(tmp_path):
    out, png, profile = tmp_path / "sim.json", tmp_path / "sim.png", tmp_path / "profile.yaml"
    encoder = PhaseFit(c0=3e-4, c1=0.0, c2=0.0, call_overhead=5e-3, residual_rms=0.0, residual_max=0.0, num_points=3)
    llm = PhaseFit(c0=5e-3, c1=2e-5, c2=2e-8, call_overhead=0.0, residual_rms=0.0, residual_max=0.0, num_points=3)
    profile.write_text(yaml.safe_dump(profile_dict("test", "fp32", TINY.name, TINY.phases(),
                                                   {"vision": encoder, "audio": encoder, "llm": llm}, {})))
    returned = sim_main.main(["--model", "tiny", "--dp", "8,16", "--per-rank", "4", "--seeds", "0,1",
                              "--gpus-per-node", "4", "--nic-sweep", "400,0.01", "--profile", str(profile),
                              "--json", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned)) and png.stat().st_size > 10_000
    assert set(result["dp"]) == {"8", "16"} and len(result["per_seed"]["16"]) == 2
    assert result["params"]["costs"].startswith(f"profile {profile}")
    for dp, runs in result["per_seed"].items():
        for method in SIM_METHODS:  # the table shows the mean over seeds
            assert result["dp"][dp][method]["speedup"] == pytest.approx(np.mean([r[method]["speedup"] for r in runs]))
        for figures in runs:
            check_run(figures)
            upstream = figures["none"]  # the profile's seconds: the busiest rank's items plus one call
            assert upstream["compute_seconds"] > llm.c0 * 4 and upstream["phase_seconds"]["vision"] >= 5e-3
    assert result["checks"]["locality_never_slower"]["nic_gbits_per_s"] == 0.01
    assert set(result["checks"]) == {"per_phase_at_least_backbone_only", "speedup_grows_with_dp",
                                     "locality_never_slower", "pipeline_aware_never_slower"}
    assert not result["checks"]["pipeline_aware_never_slower"]["pipelined"]  # one stage: nothing to compare


def check_run(figures):
    """One simulated batch: every figure adds up (DP only: the step is its compute, the transfers the schedule
    leaves exposed and the gradient reduction)."""
    assert set(figures) == set(SIM_METHODS) | {"nic_sweep"}
    none = figures["none"]
    assert none["comm_seconds"] == 0 and none["speedup"] == 1
    for method in SIM_METHODS:
        f = figures[method]
        assert f["speedup"] == pytest.approx(none["step_seconds"] / f["step_seconds"])
        assert f["step_seconds"] == f["parts"]["step"] and 0 < f["mfu"] < 1
        assert f["mfu"] * f["step_seconds"] == pytest.approx(none["mfu"] * none["step_seconds"])  # the same FLOPs
        assert f["parts"]["step"] == pytest.approx(f["compute_seconds"] + f["exposed_comm_seconds"]
                                                   + f["grad_reduce_seconds"])
        assert f["comm_seconds"] == pytest.approx(sum(m["times"] * m["seconds"] for m in f["comm"].values()))
        assert -1e-12 <= f["exposed_comm_seconds"] <= f["comm_seconds"] + 1e-12
        phases = sum(f["phase_seconds"][p] for p in PHASES)
        if method in ("none", "backbone_only"):  # end to end: between the slowest phase and the phase sum
            assert max(f["phase_seconds"].values()) <= f["compute_seconds"] <= phases * (1 + 1e-12)
        else:
            assert f["compute_seconds"] == pytest.approx(phases)
    for gbits, steps in figures["nic_sweep"].items():
        if gbits == "400.0":
            assert steps["orch"] == pytest.approx(figures["orch"]["step_seconds"])


def test_the_same_command_gives_the_same_json(tmp_path):
    """Nothing measured on this machine enters a figure: two runs write the same bytes."""
    argv = ["--model", "tiny", "--dp", "8", "--per-rank", "4", "--seeds", "0,1", "--gpus-per-node", "4",
            "--nic-sweep", "400", "--pipeline-stages", "2", "--encoder-gpus", "auto", "--peer-steps", "2"]
    sim_main.main(argv + ["--json", str(tmp_path / "a.json")])
    sim_main.main(argv + ["--json", str(tmp_path / "b.json")])
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_pipelined_layouts_run_every_plan_through_the_exact_schedule():
    """PP 4: upstream's encoders inside its micro-batches on the first stage, every plan's own micro-batches
    through 1F1B: its bubble is what the schedule leaves idle, and the pipeline-aware defaults are never slower
    than the same defaults planned by sums."""
    specs = list(DEFAULT_MIXTURE)
    _, _, sizes = draw_sizes(specs, 8, 8, "tiny", 3)
    pp4 = sim_main.StepModel(pipeline_stages=4)
    result = simulate_step(sizes, TINY, LinkModel(gpus_per_node=4), step_model=pp4)
    one = simulate_step(sizes, TINY, LinkModel(gpus_per_node=4))
    for method in SIM_METHODS:
        f = result[method]  # (end to end: the first stage, paced by its encoders, waits for nothing)
        assert f["pipeline_bubble_seconds"] > (-1e-12 if method in ("none", "backbone_only") else 0), method
        # four stages share the backbone: faster than one stage, but not four times (the bubble)
        assert one[method]["parts"]["backbone"] / 4 < f["parts"]["backbone"] < one[method]["parts"]["backbone"]
    upstream = result["none"]  # the first stage runs every encoder inside its micro-batches: it paces the pipeline
    assert upstream["parts"]["backbone"] >= (upstream["phase_seconds"]["vision"] + upstream["phase_seconds"]["audio"])
    assert result["orch"]["step_seconds"] <= result["orch"]["sum_balanced_step_seconds"] * (1 + 1e-9)


def test_encoders_on_every_gpu_spread_each_phase_over_the_whole_job():
    """PP 4 with the encoders on every GPU: each encoder phase's busiest group holds ceil(n / (dp x 4)) items
    (the tiny model's items are of one cost per phase), about a quarter of the first stage's share; upstream
    keeps Megatron's layout; no per-phase plan runs below the step's lower bound."""
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), 8, 8, "tiny", 3)
    first = simulate_step(sizes, TINY, LinkModel(gpus_per_node=4), step_model=sim_main.StepModel(pipeline_stages=4))
    every = simulate_step(sizes, TINY, LinkModel(gpus_per_node=4), step_model=sim_main.StepModel(
        pipeline_stages=4, encoder_ranks="all"))
    items = phase_items(sizes, TINY.phases())
    for phase in ("vision", "audio"):
        per_group = -(-len(items[phase]) // 32)
        assert every["orch"]["phase_seconds"][phase] == pytest.approx(per_group * items[phase].cost[0] / 400e12)
        assert every["orch"]["phase_seconds"][phase] < first["orch"]["phase_seconds"][phase] / 2
    assert every["none"]["step_seconds"] == first["none"]["step_seconds"]
    for result in (first, every):
        for method in ("orch", "equal_count", "locality", "equal_locality"):
            assert result[method]["step_over_bound"] >= 1.0 - 1e-12, method
    with pytest.raises(ValueError, match="encoder_ranks must be one of"):
        sim_main.StepModel(encoder_ranks="everywhere")
    with pytest.raises(ValueError, match="encoder_tensor_parallel 3 must divide"):
        sim_main.StepModel(tensor_parallel=8, encoder_ranks="all", encoder_tensor_parallel=3)


def test_model_state_per_gpu_by_hand():
    """mllm_84b, TP 8 x PP 4, DP 80: the backbone's parameters over 32 GPUs at 2 + 4 bytes (bf16, fp32 grads)
    plus 12 over DP (Adam, distributed); the encoders' over TP on the first stage, or on every GPU with the
    encoders on every GPU, their Adam over DP in both (each stage's encoders are one DDP module over its DP group,
    as the trainer runs them); on encoder GPUs of their own, the encoders' over their TP there (Adam over their
    groups) and the replicas hold the backbone alone."""
    model = load_model_config("mllm_84b")
    params = model.num_parameters()
    encoders = params["vision"] + params["audio"]
    backbone = params["llm"] / 32 * (6 + 12 / 80)
    first = model_state_bytes(model, sim_main.StepModel(tensor_parallel=8, pipeline_stages=4), 80)
    assert first["first_stage"] == pytest.approx(backbone + encoders / 8 * (6 + 12 / 80))
    assert first["other_stages"] == pytest.approx(backbone)
    every = model_state_bytes(model, sim_main.StepModel(tensor_parallel=8, pipeline_stages=4, encoder_ranks="all"), 80)
    assert every["first_stage"] == every["other_stages"] == pytest.approx(backbone + encoders / 8 * (6 + 12 / 80))
    own = model_state_bytes(model, sim_main.StepModel(tensor_parallel=8, pipeline_stages=4, encoder_gpus=64,
                                                      encoder_tensor_parallel=2), 80)
    assert own["first_stage"] == own["other_stages"] == pytest.approx(backbone)
    assert own["encoder_gpus"] == pytest.approx(encoders / 2 * (6 + 12 / 32))


def test_encoders_on_gpus_of_their_own_overlap_the_backbone():
    """Encoder GPUs of their own (PP 2, DP 8, encoder TP 1): each encoder phase's busiest group holds
    ceil(n / N) items; the step is the slower side (encoders' forward and backward and their gradient tail, or the
    backbone and its own) plus the embeddings there and their gradients back; MFU counts the encoder GPUs;
    upstream and backbone-only keep Megatron's layout on the replicas' GPUs; ``auto`` picks the count of the
    highest modeled MFU among the choices, and the per-phase plans stay at or above the bound."""
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), 8, 8, "tiny", 3)
    link = LinkModel(gpus_per_node=4)
    first = simulate_step(sizes, TINY, link, step_model=sim_main.StepModel(pipeline_stages=2))
    own = simulate_step(sizes, TINY, link, step_model=sim_main.StepModel(pipeline_stages=2, encoder_gpus=4))
    items = phase_items(sizes, TINY.phases())
    for phase in ("vision", "audio"):
        assert own["orch"]["phase_seconds"][phase] == pytest.approx(-(-len(items[phase]) // 4) * items[phase].cost[0]
                                                                    / 400e12)
    orch = own["orch"]
    parts = orch["parts"]
    encoders = sum(orch["phase_seconds"][p] for p in ("vision", "audio"))
    assert parts["encoder_gpus_seconds"] >= encoders and parts["backbone_gpus_seconds"] >= parts["backbone"]
    embeddings = sum(m["seconds"] for name, m in orch["comm"].items() if name.endswith("embeddings"))
    assert parts["exposed_moves"] >= 0 and parts["step"] == pytest.approx(
        max(parts["encoder_gpus_seconds"], parts["backbone_gpus_seconds"]) + parts["exposed_moves"])
    assert embeddings > 0 and parts["compute"] == pytest.approx(max(encoders, parts["backbone"]))
    assert orch["gpus"] == 16 + 4 and own["none"]["gpus"] == own["backbone_only"]["gpus"] == 16
    flops = first["none"]["mfu"] * first["none"]["step_seconds"] * 16
    assert orch["mfu"] == pytest.approx(flops / (orch["step_seconds"] * 20))
    assert own["none"]["step_seconds"] == first["none"]["step_seconds"]
    for method in ("orch", "equal_count", "locality", "equal_locality"):
        assert own[method]["step_over_bound"] >= 1.0 - 1e-12, method
    chosen = simulate_step(sizes, TINY, link, step_model=sim_main.StepModel(pipeline_stages=2),
                           encoder_gpu_choices=[4, 8, 12])
    choice = chosen["encoder_gpu_choice"]
    best = max(choice["mfu"].values())
    assert choice["mfu"][str(chosen["encoder_gpus"])] == best
    assert chosen["orch"]["mfu"] == pytest.approx(best) and chosen["orch"]["gpus"] == 16 + chosen["encoder_gpus"]
    assert choice["step_seconds"]["4"] == pytest.approx(orch["step_seconds"])
    with pytest.raises(ValueError, match="encoder_gpus 6 must be >= 0 and a multiple of the encoders' TP size 4"):
        sim_main.StepModel(tensor_parallel=4, encoder_gpus=6)
    with pytest.raises(ValueError, match="encoder_ranks 'all' exclude each other"):
        sim_main.StepModel(encoder_gpus=4, encoder_ranks="all")


@pytest.mark.distributed
def test_simulator_imports_no_torch():
    code = "import sys, megatron_orch.sim.__main__; print(any(m == 'torch' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_checks_are_printed_as_findings_with_their_figures():
    """Old code printed "per_phase_at_least_backbone_only: DID NOT HOLD" and nothing to judge it by."""
    checks = {
        "pipeline_aware_never_slower": {"held": True, "pipelined": False},
        "per_phase_at_least_backbone_only": {"held": True, "best_per_phase_speedup": {"64": 1.469, "512": 1.586},
                                             "backbone_only_speedup": {"64": 1.464, "512": 1.585}},
        "speedup_grows_with_dp": {"held": True, "orch_speedup": {"64": 1.469, "512": 1.586}},
        "locality_never_slower": {"held": False, "pairs": [["locality", "orch"]], "nic_gbits_per_s": 1.0,
                                  "step_seconds": {"64": {"locality": 6.46, "orch": 7.932}},
                                  "slower": [["512", 2, 400.0, "locality", 4.21, 4.2]],
                                  "equal_locality_slower_than_orch": []}}
    lines = sim_main.findings(checks)
    assert lines[0].endswith("per-phase >= backbone-only: DP 64 1.469 vs 1.464 (+0.3%), DP 512 1.586 vs 1.585 "
                             "(+0.1%)"), lines[0]
    assert lines[1].endswith("grows with DP: DP 64 1.469, DP 512 1.586 (+8.0%)"), lines[1]
    assert lines[2].startswith("[sim] step s of locality vs orch at the lowest NIC bandwidth swept (1 Gb/s per GPU)")
    assert "DP 64 6.46 vs 7.932 (-18.6%)" in lines[2], lines[2]
    assert "slower in 1 cases: DP 512 seed 2 at 400 Gb/s: locality 4.21 s vs 4.2 s" in lines[3], lines[3]
    assert not any("held" in line.lower() for line in lines)


def test_log_axes_are_labelled_with_plain_numbers():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([8, 64], [1, 2])
    ax.set_xscale("log")
    sim_main._plain_log_axis(ax.xaxis, [8, 64])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "64"]  # not 10^1 (and 2x10^1 ... minor labels)
    assert not ax.xaxis.get_minorticklocs().size
    plt.close(fig)


@pytest.mark.parametrize("stages,virtual", [(1, 1), (2, 1), (4, 2)])
def test_upstream_runs_its_encoders_inside_the_first_stages_microbatches(stages, virtual):
    """Upstream (each example's phases on its loader's rank, one example per micro-batch) runs its encoders
    inside the first stage's micro-batches: by hand, every rank's micro-batches through the schedule with each
    example's encoder seconds added to its first-stage forward (a third) and backward; on one stage, the
    slowest rank's sum of every phase."""
    from megatron_orch.balance.pipeline_schedule import PipelineSchedule
    from megatron_orch.balance.step_model import StepModel
    dp, per_rank, gpus = 8, 4, 4
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), dp, per_rank, "tiny", 3)
    link = LinkModel(gpus_per_node=gpus)
    model = StepModel(link=link, pipeline_stages=stages, virtual_stages=virtual)
    upstream = simulate_step(sizes, TINY, link, step_model=model)["none"]
    items = phase_items(sizes, TINY.phases())
    seconds = {p: items[p].cost / (model.tflops * 1e12) for p in PHASES}
    llm = seconds["llm"].reshape(dp, per_rank)  # rank r's examples in loading order, one per micro-batch
    inside = sum(np.bincount(items[p].example, weights=seconds[p], minlength=dp * per_rank)
                 for p in ("vision", "audio")).reshape(dp, per_rank)
    by_hand = PipelineSchedule(stages, virtual).replica_seconds(llm, inside / 3, 2 * inside / 3).max()
    assert upstream["compute_seconds"] == pytest.approx(by_hand, rel=1e-12)
    assert upstream["pipeline_bubble_seconds"] >= -1e-15
    if stages == 1:
        assert by_hand == pytest.approx((llm + inside).sum(axis=1).max(), rel=1e-12)


def test_paper_refuses_a_layout_flag_it_would_override(capsys):
    """--paper sets the paper's configuration; a flag of one's own that differs is refused, never overridden."""
    with pytest.raises(SystemExit):
        sim_main.main(["--paper", "--per-rank", "64"])
    assert "--paper sets --per-rank 16, got --per-rank 64" in capsys.readouterr().err
