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
