"""Cost profiles: the fit recovers known coefficients, the planner balances the profile's costs, and a
profile with a bad field or for another model shape is refused with a message naming the field."""
import argparse
import dataclasses

import numpy as np
import pytest
import yaml

from megatron_orch.balance.cost_profile import (PhaseFit, cost_profile_from_dict, fit_phase, load_cost_profile,
                                                profile_dict, rank_seconds)
from megatron_orch.balance.partition import equal_count_lower_bound
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import DEFAULT_MIXTURE
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import draw_sizes
from megatron_orch.mllm.config import load_model_config
from megatron_orch.megatron.orch_arguments import add_orch_args, orch_config_from_args
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import plan_step

TINY = load_model_config("tiny")
# Attention-bound: at 350 tokens 55% of the seconds are quadratic, where 25% of the tiny model's FLOPs are.
QUADRATIC = PhaseFit(c0=2e-4, c1=1e-6, c2=1e-8, call_overhead=0.0, residual_rms=0.0, residual_max=0.0, num_points=3)
ENCODER = PhaseFit(c0=3e-4, c1=0.0, c2=0.0, call_overhead=5e-3, residual_rms=0.0, residual_max=0.0, num_points=3)


def document(config=TINY, llm=QUADRATIC):
    return profile_dict("test device", "fp32", config.name, config.phases(),
                        {"vision": ENCODER, "audio": ENCODER, "llm": llm}, {})


def test_fit_recovers_known_coefficients_from_noisy_timings():
    rng = np.random.default_rng(0)
    s = np.array([16, 32, 64, 128, 256, 512, 1024, 2048, 4096] * 2, dtype=float)
    n = np.ones_like(s)
    n[-3:] = 4  # calls of several sequences count per sequence
    truth = (3e-3, 2e-6, 5e-10)
    seconds = n * (truth[0] + truth[1] * s + truth[2] * s * s) * rng.normal(1, 0.01, s.size)
    fit = fit_phase(n, s, seconds, call_overhead=False)
    np.testing.assert_allclose((fit.c0, fit.c1, fit.c2), truth, rtol=0.05)
    assert fit.call_overhead == 0 and fit.num_points == s.size and 0 < fit.residual_rms < 0.02

    items = np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=float)
    seconds = (0.012 + items * 0.0025) * rng.normal(1, 0.01, items.size)
    fit = fit_phase(items, np.full(items.size, 1025), seconds, call_overhead=True)
    assert fit.call_overhead == pytest.approx(0.012, rel=0.05) and fit.c0 == pytest.approx(0.0025, rel=0.03)
    assert fit.c1 == fit.c2 == 0  # one item length: only the per-item time is identifiable


def test_fit_keeps_coefficients_non_negative():
    s = np.array([100, 200, 400, 800], dtype=float)
    seconds = 1e-5 * s - 5e-4  # an unconstrained fit would give c0 < 0
    fit = fit_phase(np.ones(4), s, seconds, call_overhead=False)
    assert min(fit.c0, fit.c1, fit.c2) >= 0 and fit.c1 > 0
    noisy = fit_phase([1, 8], [17, 17], [7e-3, 5e-3], call_overhead=True)  # more items, less time: noise
    assert noisy.c0 > 0 and noisy.call_overhead == 0
    with pytest.raises(ValueError, match="cannot fit 4 coefficients"):
        fit_phase([1, 2], [5, 6], [1.0, 2.0], call_overhead=True)


def test_profile_round_trips_through_yaml_and_sets_item_costs(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(document()))
    profile = load_cost_profile(str(path), TINY.phases())
    assert profile.phases["llm"] == QUADRATIC and profile.phases["vision"] == ENCODER
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), 4, 4, "tiny", 0)
    items = phase_items(sizes, profile.apply(TINY.phases()))
    np.testing.assert_allclose(items["llm"].cost, QUADRATIC.item_seconds(sizes.num_tokens))
    np.testing.assert_allclose(items["vision"].cost, ENCODER.c0)
    flops = phase_items(sizes, TINY.phases())  # the default stays FLOPs, every other field unchanged
    np.testing.assert_allclose(flops["llm"].cost, TINY.backbone.transformer.train_flops(sizes.num_tokens))
    np.testing.assert_array_equal(flops["audio"].nbytes, items["audio"].nbytes)
    rank = np.array([0, 0, 2])
    np.testing.assert_allclose(rank_seconds(ENCODER, [1.0, 2.0, 4.0], rank, 4), [3.005, 0, 4.005, 0])


@pytest.mark.parametrize("microbatching", ["equal_count", "packed"])
def test_planner_with_a_profile_balances_the_profiles_costs_better_than_flops(microbatching):
    profile = cost_profile_from_dict(document())
    dp = 8
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), dp, 8, "tiny", 3)
    measured = QUADRATIC.item_seconds(sizes.num_tokens)  # what the device would take
    topology = Topology.uniform(dp, 4)
    imbalance = {}
    for name, cost_profile in (("flops", None), ("profile", profile)):
        config = OrchestratorConfig(background=False, microbatching=microbatching, cost_profile=cost_profile)
        plan = plan_step(sizes, TINY.phases(), config, topology, micro_batch_size=2, num_microbatches=4)
        loads = np.bincount(plan.examples_backbone.rank, weights=measured, minlength=dp)
        imbalance[name] = loads.max() / loads.mean()
        if cost_profile is not None:  # the plan's own stats are in the profile's seconds
            assert plan.stats["llm"].imbalance_after == pytest.approx(imbalance[name])
    assert imbalance["profile"] < imbalance["flops"] - 0.04, imbalance
    if microbatching == "equal_count":  # the profile's plan: at the equal-count bound of the device's seconds
        bound = equal_count_lower_bound(measured, dp) / (measured.sum() / dp)
        assert imbalance["profile"] <= 1.001 * bound, (imbalance, bound)
    if microbatching == "packed":  # free counts per rank: at the lower bound (no example exceeds a fair share)
        assert measured.max() < measured.sum() / dp and imbalance["profile"] < 1.01, imbalance


def _bad(data, path_keys, value):
    target = data
    for key in path_keys[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path_keys[-1]]
    else:
        target[path_keys[-1]] = value
    return data


@pytest.mark.parametrize("keys, value, message", [
    (("phases", "llm", "c2"), KeyError, "phases.llm.c2: missing"),
    (("phases", "vision", "call_overhead"), -1.0, r"phases.vision.call_overhead: must be a finite number >= 0"),
    (("phases", "audio", "c0"), "fast", "phases.audio.c0: must be a finite number"),
    (("phases", "llm", "c0"), float("nan"), "phases.llm.c0: must be a finite"),
    (("phases", "audio"), KeyError, r"phases.audio: missing \(the measured model has this phase\)"),
    (("phases", "llm", "speed"), 3.0, "phases.llm.speed: unknown field"),
    (("device",), KeyError, "device: missing"),
    (("kind",), "something else", "kind: expected"),
    (("version",), 1, "version: expected 2"),
    (("model", "shape"), {}, "model.shape: expected a non-empty mapping"),
    (("phases", "llm", "points"), [{"items": 1, "seq_len": 5, "seconds": -1.0, "fitted_seconds": 1.0}],
     r"phases.llm.points\[0\].seconds: must be"),
])
def test_bad_profiles_are_refused_naming_the_field(keys, value, message):
    with pytest.raises(ValueError, match=message):
        cost_profile_from_dict(_bad(document(), keys, value), "bad.yaml")


def test_profile_for_another_model_shape_is_refused(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(document()))
    deeper = dataclasses.replace(TINY, backbone=dataclasses.replace(
        TINY.backbone, transformer=dataclasses.replace(TINY.backbone.transformer, num_layers=3)))
    with pytest.raises(ValueError, match=r"model.shape.llm.num_layers: measured on 2, but the model has 3"):
        load_cost_profile(str(path), deeper.phases())
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), 2, 2, "tiny", 0)
    with pytest.raises(ValueError, match="model.shape.audio.ffn_hidden_size: measured on 256, but the model has"):
        plan_step(sizes, load_model_config("mllm_10b").phases(),
                  OrchestratorConfig(background=False, cost_profile=load_cost_profile(str(path))),
                  Topology.uniform(2, 1), micro_batch_size=1, num_microbatches=2)
    with pytest.raises(ValueError, match="model.shape.video: measured without a video phase"):
        load_cost_profile(str(path), load_model_config("tiny_video").phases())
    (tmp_path / "broken.yaml").write_text("kind: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_cost_profile(str(tmp_path / "broken.yaml"))
    with pytest.raises(ValueError, match="no such file"):
        load_cost_profile(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize("keys, value, message", [
    (("phases", "vision", "c1"), 1e-6, "phases.vision.c1: must be 0 .* for an encoder phase"),
    (("phases", "llm", "call_overhead"), 1e-3, "phases.llm.call_overhead: must be 0 for the backbone phase"),
])
def test_a_profile_whose_fits_do_not_suit_the_phase_roles_is_refused(keys, value, message):
    profile = cost_profile_from_dict(_bad(document(), keys, value), "bad.yaml")
    with pytest.raises(ValueError, match=message):
        profile.apply(TINY.phases())


def test_the_shipped_profile_applies_to_the_tiny_model():
    profile = load_cost_profile("docs/costs/tiny_cpu_profile.yaml", TINY.phases())
    phases = profile.apply(TINY.phases())
    assert phases.names == TINY.phases().names
    assert phases.backbone.cost.item_cost(100) == pytest.approx(profile.phases["llm"].item_seconds(100))


def test_orch_cost_profile_flag(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(document()))
    parser = add_orch_args(argparse.ArgumentParser())
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    config = orch_config_from_args(parser.parse_args(["--orch-post-balancing", "--orch-cost-profile", str(path)]))
    assert config.cost_profile.phases["llm"] == QUADRATIC
    assert orch_config_from_args(parser.parse_args(["--orch-post-balancing"])).cost_profile is None
    path.write_text(yaml.safe_dump(_bad(document(), ("phases", "llm", "c1"), KeyError)))
    with pytest.raises(ValueError, match="phases.llm.c1: missing"):
        orch_config_from_args(parser.parse_args(["--orch-post-balancing", "--orch-cost-profile", str(path)]))
    with pytest.raises(ValueError, match="--orch-cost-profile given without --orch-post-balancing"):
        orch_config_from_args(parser.parse_args(["--orch-cost-profile", str(path)]))
