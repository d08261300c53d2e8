"""The device checks' own logic, on CPU: the memory report line the compact trainer prints on CUDA and
scripts/check_memory.py reads back, the reduced-depth model YAML, and scripts/check_syncs.py's recording
of sync warnings (the warning raised by hand: torch's sync debug mode needs CUDA)."""
import importlib.util
import sys
import warnings
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]


def _script(name):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", REPO / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "scripts"))


def test_the_memory_report_is_megatrons_line_and_check_memory_reads_it(monkeypatch):
    from megatron_orch.trainer.training_log import memory_report
    mib = 2 ** 20
    for name, value in (("memory_allocated", 1.5), ("max_memory_allocated", 2.25), ("memory_reserved", 3),
                        ("max_memory_reserved", 4)):
        monkeypatch.setattr(torch.cuda, name, lambda v=value: v * mib)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 3)
    line = memory_report("(after 2 iterations)")
    # megatron/training/utils.py report_memory, core_v0.16.1
    assert line == ("[Rank 3] (after 2 iterations) memory (MB) | allocated: 1.50 | max allocated: 2.25 | "
                    "reserved: 3.00 | max reserved: 4.00")
    check_memory = _script("check_memory")
    assert check_memory.parse_memory_reports(["noise", line]) == [
        {"rank": 3, "iteration": 2, "allocated": 1.5, "max_allocated": 2.25, "reserved": 3.0, "max_reserved": 4.0}]


def test_check_memory_writes_a_reduced_depth_config_the_trainer_loads(tmp_path):
    from megatron_orch.mllm.config import load_model_config
    check_memory = _script("check_memory")
    path = check_memory.reduced_depth_config("mllm_10b", "2,3,4", tmp_path)
    config = load_model_config(str(path))
    full = load_model_config("mllm_10b")
    assert [e.transformer.num_layers for e in config.encoders.values()] == [2, 3]
    assert config.backbone.transformer.num_layers == 4 and config.name == "mllm_10b_layers_2_3_4"
    assert config.backbone.transformer.hidden_size == full.backbone.transformer.hidden_size
    assert yaml.safe_load(path.read_text())["encoders"]["vision"]["tile_px"] == 448


def test_check_syncs_records_each_sync_warning_with_its_megatron_orch_frames(monkeypatch):
    check_syncs = _script("check_syncs")
    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    recorder = check_syncs.SyncRecorder(from_step=2, frames=2)

    def train_step(n):  # stands in for loop.train_step: syncs n times, and warns something else once
        for _ in range(n):
            warnings.warn(check_syncs.SYNC_MESSAGE, UserWarning)
        warnings.warn("an unrelated warning", UserWarning)
        return n

    wrapped = recorder.wrap(train_step)
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        assert [wrapped(2), wrapped(3), wrapped(1)] == [2, 3, 1]
    assert modes == ["warn", "default", "warn", "default"] and recorder.observed == [2, 3]
    # step 1 is not observed; the unrelated warnings are passed on, not recorded
    assert [str(w.message) for w in others] == [check_syncs.SYNC_MESSAGE] * 2 + ["an unrelated warning"] * 3
    report = recorder.report(allow=[])
    assert report["syncs"] == 4 and report["observed_steps"] == [2, 3]
    (site,) = report["sites"]
    assert site["count"] == 4 and site["per_step"] == {2: 3, 3: 1}
    assert "test_device_checks.py" in site["caller"] and site["caller"].endswith(" train_step"), site
    assert not site["ours"] and report["ours_not_allowed"] == 0  # the caller is not megatron_orch code


def test_encoder_layout_check_plans_each_layouts_busiest_rank():
    """scripts/check_encoder_layout.py's planned loads: with the encoders on every stage, a DP rank's items
    split over its PP stages, so the busiest rank holds ceil(first-stage's busiest / PP), in the plan's chunks."""
    from megatron_orch.mllm.config import load_model_config
    layouts = _script("check_encoder_layout").busiest_items(load_model_config("tiny"), dp=4, pp=2, per_rank=8, seed=0)
    assert set(layouts) == {"first-stage", "all"} and set(layouts["all"]) == {"vision", "audio"}
    for phase, first in layouts["first-stage"].items():
        assert first["items"] > 1 and first["chunk"] >= 1
        assert layouts["all"][phase] == {"items": -(-first["items"] // 2), "chunk": first["chunk"]}
