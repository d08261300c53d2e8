"""The balancing benchmark: a small run produces valid JSON with every phase and method; verl's KK."""
import json
import math
import re

import numpy as np
import pytest

from megatron_orch.balance.pipeline_schedule import PipelineSchedule
from megatron_orch.balance.traces import NUMERIC_COLUMNS, TEXT_COLUMNS, load_mixture
from megatron_orch.bench.balance import COMPARED_METHODS, RANK_METHODS, main, verl_equal_size_kk, verl_workload
from megatron_orch.bench.common import draw_sizes
from megatron_orch.balance.workload import phase_items

ROWS = {
    "img.csv": [dict(task="image_sft", vision_tiles=t, text_tokens=40 + 7 * t) for t in (1, 3, 4, 5, 5, 7)],
    "asr.csv": [dict(task="asr", audio_frames=f, text_tokens=f // 30) for f in (300, 750, 1400, 2900, 4100, 9000)],
    "video.csv": [dict(task="video_openqa", video_sec=s, text_tokens=12) for s in (3.0, 20.0, 75.0, 200.0)],
}


@pytest.fixture()
def traces_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_ORCH_CACHE", str(tmp_path / "cache"))
    header = TEXT_COLUMNS + NUMERIC_COLUMNS
    for name, rows in ROWS.items():
        lines = [",".join(header)] + [",".join(str(r.get(c, "")) for c in header) for r in rows]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    return tmp_path


@pytest.mark.parametrize("model", ["tiny", "mllm_84b"])
def test_small_run_writes_every_phase_and_method(traces_dir, tmp_path, model, capsys):
    out = tmp_path / "bench.json"
    main(["--trace", "img.csv:0.5", "asr.csv:0.3", "video.csv:0.2", "--traces-dir", str(traces_dir),
          "--dp", "8", "--per-rank", "4", "--gpus-per-node", "4", "--model", model, "--seed", "3",
          "--repeats", "1", "--peer-steps", "3", "--json", str(out)])
    assert "| orch |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["params"]["dp"] == 8 and result["params"]["num_examples"] == 32
    assert [t["weight"] for t in result["params"]["traces"]] == [0.5, 0.3, 0.2]
    phases = ("vision", "audio", "llm")  # the model's, as its config names them
    for phase in phases:
        assert set(result[phase]) == set(COMPARED_METHODS)
        for method, fields in result[phase].items():
            for field in ("max_over_lb", "max_over_mean", "plan_ms"):
                assert math.isfinite(fields[field]) and fields[field] >= 0, (phase, method, field)
            assert fields["max_over_lb"] >= 1 - 1e-9 and fields["max_over_mean"] >= fields["max_over_lb"] - 1e-9
            assert ("inter_node_bytes_frac" in fields) == (method in RANK_METHODS)
        assert result[phase]["orch"]["max_over_lb"] <= result[phase]["none"]["max_over_lb"] + 1e-12
        assert result[phase]["none"]["inter_node_bytes_frac"] == 0.0
    assert result["params"]["items"]["llm"] == 32
    assert set(result["step"]) == set(COMPARED_METHODS)
    for figures in result["peers"].values():  # 2 nodes of 4: node-wise, at most 3 + 1 peers; a run holds its step
        assert figures["steps"] == 3
        for mode in ("flat", "node-wise"):
            step, run = figures[mode]["step"], figures[mode]["run"]
            assert all(s <= r for s, r in zip(step, run)) and run[0] <= 7, (mode, figures)
        assert figures["node-wise"]["run"][1] <= 3 and figures["node-wise"]["run"][2] <= 1, figures
    # The modeled step against a reference computed here from the same drawn batch: upstream (none)
    # runs each example end to end on its loading rank, so its step is the busiest rank's sum over
    # phases; a per-phase method's step is the sum over phases of its busiest rank.
    config, _, sizes = draw_sizes([("img.csv", 0.5), ("asr.csv", 0.3), ("video.csv", 0.2)], 8, 4, model, 3,
                                  str(traces_dir))
    items = phase_items(sizes, config.phases())
    upstream = sum(np.bincount(items[p].home, weights=items[p].cost, minlength=8) for p in phases).max()
    assert result["step"]["none"]["flops"] == pytest.approx(upstream, rel=1e-12)
    for method in set(COMPARED_METHODS) - {"none", "verl_kk"}:
        step = sum(result[p][method]["max_over_mean"] * result["params"]["total_flops"][p] / 8 for p in phases)
        assert result["step"][method]["flops"] == pytest.approx(step, rel=1e-9), method
        assert result["step"][method]["speedup"] == pytest.approx(upstream / step, rel=1e-9), method
    assert result["step"]["orch"]["speedup"] > 1.05  # this batch is unbalanced: balancing must pay


def test_pipelined_replicas_run_their_microbatches_through_the_schedule(traces_dir, tmp_path):
    """--pipeline-stages 4: upstream's step is every rank's own micro-batches (one example each, its encoders
    inside on the first stage) through 1F1B, as the schedule model replays it here; no method runs below the
    step's lower bound; the trainer's defaults plan the backbone for the pipeline."""
    out = tmp_path / "bench.json"
    main(["--trace", "img.csv:0.5", "asr.csv:0.3", "video.csv:0.2", "--traces-dir", str(traces_dir),
          "--dp", "8", "--per-rank", "4", "--gpus-per-node", "4", "--model", "mllm_84b", "--seed", "3",
          "--repeats", "1", "--pipeline-stages", "4", "--peer-steps", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    config, _, sizes = draw_sizes([("img.csv", 0.5), ("asr.csv", 0.3), ("video.csv", 0.2)], 8, 4, "mllm_84b", 3,
                                  str(traces_dir))
    items = phase_items(sizes, config.phases())
    llm = items["llm"].cost.reshape(8, 4)  # rank r's examples in loading order, one per micro-batch
    inside = sum(np.bincount(items[p].example, weights=items[p].cost, minlength=32) for p in ("vision", "audio"))
    inside = inside.reshape(8, 4)
    upstream = PipelineSchedule(4).replica_seconds(llm, inside / 3, 2 * inside / 3).max()
    assert result["step"]["none"]["flops"] == pytest.approx(upstream, rel=1e-12)
    assert result["params"]["pipeline_stages"] == 4
    for method in COMPARED_METHODS:
        assert result["step"][method]["over_lb"] >= 1 - 1e-9, method


def test_verl_kk_by_hand_and_equal_size():
    # states (2,1) and (4,3) have equal spread; the one with the larger top set merges first:
    # [4, 3] + reversed [2, 1] -> {4, 1} and {3, 2}
    bins = verl_equal_size_kk([1, 2, 3, 4], 2)
    assert bins[3] == bins[0] and bins[2] == bins[1] and bins[0] != bins[1]
    rng = np.random.default_rng(0)
    w = verl_workload(rng.integers(10, 5000, size=64))
    bins = verl_equal_size_kk(w, 8)
    np.testing.assert_array_equal(np.bincount(bins, minlength=8), [8] * 8)
    loads = np.bincount(bins, weights=w, minlength=8)
    assert loads.max() / loads.mean() < 1.05
    with pytest.raises(ValueError, match="multiple"):
        verl_equal_size_kk(w[:63], 8)


def test_verl_workload():
    np.testing.assert_array_equal(verl_workload([0, 1, 100]), [0, 24577, 2457600 + 10000])


def test_benchmarks_and_simulator_refuse_what_training_refuses(traces_dir, capsys):
    """An example longer than the sequence length: training's own check (BatchSpec.check) refuses it, and so,
    with the same message, do the benchmarks and the simulator (they used to plan it)."""
    import torch

    from megatron_orch.bench import planning
    from megatron_orch.megatron.batch import Example
    from megatron_orch.mllm.examples import batch_spec
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.sim import __main__ as sim_main

    tokens = torch.zeros(300, dtype=torch.long)
    with pytest.raises(ValueError) as training:
        batch_spec(load_model_config("tiny"), 256).check(Example(7, tokens, tokens, torch.ones(300)))
    assert str(training.value) == "example 7: 300 tokens exceed seq_length 256"
    message = r": example \d+ \(DP rank \d+, [^)]*\): \d+ tokens exceed seq_length 256"
    trace = ["--trace", "img.csv:0.5", "asr.csv:0.3", "video.csv:0.2", "--traces-dir", str(traces_dir)]
    for run in (lambda: main(trace + ["--dp", "8", "--per-rank", "4", "--model", "mllm_84b", "--seq-length", "256"]),
                lambda: planning.main(trace + ["--dp", "8", "--per-rank", "4", "--model", "mllm_84b",
                                               "--seq-length", "256"]),
                lambda: sim_main.main(trace + ["--dp", "8", "--per-rank", "4", "--model", "mllm_84b", "--seeds", "0",
                                               "--seq-length", "256"])):
        with pytest.raises(SystemExit):
            run()
        assert re.search(message, capsys.readouterr().err)
    rows = load_mixture([("img.csv", 1.0)], traces_dir).draw(8, 0)
    with pytest.raises(ValueError, match=message):
        planning.batch_sizes(rows, 2, 4, load_model_config("mllm_84b"), seq_length=256)
