"""Trace loading / drawing, trace rows -> per-example sizes, sizes -> the items of every phase, and the
phase records themselves (names, cost models, any number of encoders)."""
import dataclasses

import numpy as np
import pytest

from megatron_orch.balance.cost import FunctionCost, TransformerCost
from megatron_orch.balance.traces import (NUMERIC_COLUMNS, TEXT_COLUMNS, Trace, TraceMixture, load_mixture,
                                          load_trace, parse_trace_spec)
from megatron_orch.balance.workload import BackbonePhase, EncoderPhase, ModelPhases, StepSizes, phase_items
from megatron_orch.mllm.config import load_model_config, sampled_video_frames, sizes_from_trace

TINY = load_model_config("tiny")
# tiny: 16 px tiles of 4 px patches -> 16 patches + 1 class token, 4 LLM tokens per tile or video frame;
# video 0.5 fps, <= 4 frames; audio windows of 64 mel frames -> 32 tokens, 4 tokens -> 1 LLM token (8 per
# window, padded or not); prompt 8 tokens; backbone hidden 64.
ROWS = [
    dict(task="image_sft", vision_tiles=3, text_tokens=10),  # 3 tiles
    dict(task="video_openqa", video_sec=5, text_tokens=4),  # ceil(2.5) = 3 frames
    dict(task="video_mcqa", video_frames=600, text_tokens=0),  # 20 s at 30 fps -> 10 frames, capped at 4
    dict(task="asr", audio_frames=150, text_tokens=5),  # 3 windows (64, 64, 22 real mel frames)
    dict(task="text", text_tokens=7),  # no modality
    dict(task="video_segment_caption", video_sec=0.4, text_tokens=1),  # at least 1 frame
]
COUNTS = (2, 2, 2)  # rank 0 loads rows 0-1, rank 1 rows 2-3, rank 2 rows 4-5


def sizes(config=TINY, rows=ROWS, counts=COUNTS):
    return sizes_from_trace(Trace.from_rows("hand", rows), np.array(counts), config)


def test_trace_rows_become_the_sizes_the_data_pipeline_loads():
    s = sizes()
    np.testing.assert_array_equal(s.items["vision"], [3, 3, 4, 0, 0, 1])
    np.testing.assert_array_equal(s.items["audio"], [0, 0, 0, 3, 0, 0])
    text = np.array([10, 4, 0, 5, 7, 1])
    np.testing.assert_array_equal(s.num_tokens, text + 8 + 4 * s.items["vision"] + 8 * s.items["audio"])
    np.testing.assert_array_equal(s.home, [0, 0, 1, 1, 2, 2])


def test_vision_items():
    vision = phase_items(sizes(), TINY.phases())["vision"]
    np.testing.assert_array_equal(vision.example, [0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 5])
    np.testing.assert_array_equal(vision.home, [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2])
    np.testing.assert_array_equal(vision.tokens, [17] * 11)
    encoder = TINY.encoders["vision"]
    projector = encoder.projector(64)
    np.testing.assert_allclose(vision.cost, encoder.transformer.train_flops(17) + projector.train_flops(4))
    np.testing.assert_allclose(vision.nbytes, 3 * 16 * 16 * 2)
    np.testing.assert_allclose(vision.output_nbytes, 4 * 64 * 2)


def test_an_encoder_phases_figures_are_one_value_viewed_for_every_item():
    """An encoder phase's tokens, cost, memory and bytes are read-only views of one value (no array written per
    item: ~800k image tiles a step at DP 10240), of the dtypes the phase's arrays have; the backbone's are
    arrays, but for its output bytes (0)."""
    items = phase_items(sizes(), TINY.phases())
    for phase in ("vision", "audio"):
        it = items[phase]
        for name, dtype in (("tokens", np.int64), ("cost", np.float64), ("memory", np.float64),
                            ("nbytes", np.int64), ("output_nbytes", np.int64)):
            values = getattr(it, name)
            assert values.dtype == dtype and values.shape == it.example.shape and not values.flags.writeable
            assert values.strides == (0,) and (values == values[0]).all()
    assert items["llm"].cost.flags.c_contiguous and items["llm"].cost.flags.writeable
    assert items["llm"].output_nbytes.strides == (0,) and not items["llm"].output_nbytes.any()


def test_audio_windows_run_at_full_length():
    """As the model encodes them: every window is 64 mel frames (the last zero-padded), 32 encoder tokens,
    8 LLM tokens; what moves is the padded window."""
    audio = phase_items(sizes(), TINY.phases())["audio"]
    np.testing.assert_array_equal(audio.example, [3, 3, 3])
    np.testing.assert_array_equal(audio.home, [1, 1, 1])
    np.testing.assert_array_equal(audio.tokens, [32, 32, 32])
    encoder = TINY.encoders["audio"]
    projector = encoder.projector(64)
    np.testing.assert_allclose(audio.cost, encoder.transformer.train_flops(32) + projector.train_flops(8))
    np.testing.assert_allclose(audio.memory, encoder.transformer.activation_bytes(32) + projector.activation_bytes(8))
    np.testing.assert_allclose(audio.nbytes, 64 * 16 * 2)  # frames x mel bins x bf16
    np.testing.assert_allclose(audio.output_nbytes, 8 * 64 * 2)


def test_llm_lengths_and_bytes():
    s = sizes()
    w = phase_items(s, TINY.phases())
    llm = w["llm"]
    np.testing.assert_array_equal(llm.tokens, s.num_tokens)
    np.testing.assert_array_equal(llm.example, np.arange(6))
    np.testing.assert_array_equal(llm.home, [0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose(llm.cost, TINY.backbone.transformer.train_flops(s.num_tokens))
    np.testing.assert_allclose(llm.nbytes, s.num_tokens * (8 + 8 + 4))  # token id, label, float32 loss mask
    # the embeddings an example's encoder items send on fill exactly its placeholders
    sent = sum(np.bincount(w[p].example, weights=w[p].output_nbytes, minlength=6) for p in ("vision", "audio"))
    np.testing.assert_allclose(sent, (4 * s.items["vision"] + 8 * s.items["audio"]) * 64 * 2)


def test_absent_modality_gives_empty_phase():
    w = phase_items(sizes(rows=[ROWS[0], ROWS[4]], counts=(1, 1)), TINY.phases())
    assert list(w) == ["vision", "audio", "llm"]
    assert len(w["audio"]) == 0 and len(w["vision"]) == 3 and len(w["llm"]) == 2
    no_vision = dataclasses.replace(TINY, encoders={"audio": TINY.encoders["audio"]})
    s = sizes(no_vision)
    assert list(s.items) == ["audio"]  # a medium no encoder takes is left out of the batch
    assert list(phase_items(s, no_vision.phases())) == ["audio", "llm"]
    np.testing.assert_array_equal(s.num_tokens, [18, 12, 8, 37, 15, 9])
    with pytest.raises(ValueError, match=r"items of \['vision'\], which are not encoder phases"):
        phase_items(sizes(), no_vision.phases())


def test_video_frames_as_their_own_encoder_by_configuration():
    """tiny_video: images to the vision ViT, sampled video frames to a second ViT (24 px frames: 36 patches
    + 1 class token, 9 LLM tokens), audio as in tiny: three encoder phases, planned like any others."""
    three = load_model_config("tiny_video")
    assert three.phases().names == ("vision", "video", "audio", "llm")
    s = sizes(three)
    np.testing.assert_array_equal(s.items["vision"], [3, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(s.items["video"], [0, 3, 4, 0, 0, 1])
    np.testing.assert_array_equal(s.items["audio"], [0, 0, 0, 3, 0, 0])
    text = np.array([10, 4, 0, 5, 7, 1])
    np.testing.assert_array_equal(s.num_tokens, text + 8 + 4 * s.items["vision"] + 9 * s.items["video"]
                                  + 8 * s.items["audio"])
    video = phase_items(s, three.phases())["video"]
    encoder = three.encoders["video"]
    np.testing.assert_array_equal(video.tokens, [37] * 8)
    np.testing.assert_allclose(video.cost, encoder.transformer.train_flops(37) + encoder.projector(64).train_flops(9))
    np.testing.assert_allclose(video.nbytes, 3 * 24 * 24 * 2)
    np.testing.assert_allclose(video.output_nbytes, 9 * 64 * 2)


def test_phase_records_and_cost_models():
    shape = TINY.backbone.transformer
    backbone = BackbonePhase("text", TransformerCost(shape), token_bytes=20)
    # A user's function as an encoder's cost model: any callable of the item tokens.
    quadratic = EncoderPhase("frames", FunctionCost(lambda s: 1.0 + s * s, memory=lambda s: 2.0 * s),
                             item_tokens=10, input_bytes=30, output_rows=3, output_row_bytes=4)
    phases = ModelPhases((quadratic,), backbone)
    assert phases.names == ("frames", "text") and phases.encoder("frames") is quadratic
    s = StepSizes(counts=np.array([1, 1]), items={"frames": np.array([2, 1])}, num_tokens=np.array([7, 5]))
    items = phase_items(s, phases)
    np.testing.assert_allclose(items["frames"].cost, [101.0] * 3)
    np.testing.assert_allclose(items["frames"].memory, [20.0] * 3)
    np.testing.assert_allclose(items["text"].cost, shape.train_flops([7, 5]))
    np.testing.assert_array_equal(items["text"].nbytes, [140, 100])
    assert TransformerCost(shape).signature()["num_layers"] == shape.num_layers
    with pytest.raises(ValueError, match="phase names must be distinct"):
        ModelPhases((dataclasses.replace(quadratic, name="text"),), backbone)
    with pytest.raises(ValueError, match="must be a lowercase identifier"):
        BackbonePhase("LLM tokens", TransformerCost(shape), token_bytes=20)
    with pytest.raises(ValueError, match="output_rows must be >= 1"):
        dataclasses.replace(quadratic, output_rows=0)
    with pytest.raises(KeyError, match="no encoder phase 'vision'"):
        phases.encoder("vision")
    negative = ModelPhases((dataclasses.replace(quadratic, cost=FunctionCost(lambda s: -s)),), backbone)
    with pytest.raises(ValueError, match="phase frames: the cost model gave an item cost that is negative"):
        phase_items(s, negative)


def test_sampled_video_frames():
    np.testing.assert_array_equal(sampled_video_frames([0, 0.1, 2, 2.1, 100], fps=0.5, max_frames=4),
                                  [0, 1, 1, 2, 4])


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="sum to 5, the trace has 6 rows"):
        sizes(counts=(2, 2, 1))
    with pytest.raises(ValueError, match="num_tokens has shape"):
        StepSizes(counts=np.array([2]), items={"vision": np.zeros(2, int)}, num_tokens=np.ones(3, int))
    with pytest.raises(ValueError, match=r"items\['audio'\] has a negative entry at example 1"):
        StepSizes(counts=np.array([2]), items={"vision": np.zeros(2, int), "audio": np.array([0, -1])},
                  num_tokens=np.ones(2, int))


def write_csv(path, rows):
    header = TEXT_COLUMNS + NUMERIC_COLUMNS
    lines = [",".join(header)] + [",".join(str(r.get(c, "")) for c in header) for r in rows]
    path.write_text("\n".join(lines) + "\n")


def test_load_trace_csv_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_ORCH_CACHE", str(tmp_path / "cache"))
    write_csv(tmp_path / "a.csv", [dict(source="s", task="asr", audio_frames=150, text_tokens=5),
                                   dict(source="s", task="img", vision_tiles=3, text_tokens="")])
    trace = load_trace("a.csv", traces_dir=tmp_path)
    assert len(trace) == 2
    np.testing.assert_array_equal(trace["audio_frames"], [150, 0])  # empty cell = absent = 0
    np.testing.assert_array_equal(trace["text_tokens"], [5, 0])
    assert list(trace["task"]) == ["asr", "img"]
    assert len(list((tmp_path / "cache" / "traces").glob("a-*.npz"))) == 1
    again = load_trace(str(tmp_path / "a.csv"))
    for c in NUMERIC_COLUMNS:
        np.testing.assert_array_equal(again[c], trace[c])
    with pytest.raises(FileNotFoundError, match="MEGATRON_ORCH_TRACES"):
        load_trace("missing.csv", traces_dir=tmp_path)


def test_gzipped_trace_is_found_by_its_csv_name_and_reads_the_same(tmp_path, monkeypatch):
    import gzip
    import shutil

    monkeypatch.setenv("MEGATRON_ORCH_CACHE", str(tmp_path / "cache"))
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    write_csv(plain / "a.csv", [dict(task="asr", audio_frames=150, text_tokens=5), dict(task="img", vision_tiles=3)])
    with open(plain / "a.csv", "rb") as src, gzip.open(packed / "a.csv.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    a, b = load_trace("a.csv", traces_dir=plain), load_trace("a.csv", traces_dir=packed)
    assert a.name == b.name == "a.csv"
    for c in NUMERIC_COLUMNS:
        np.testing.assert_array_equal(a[c], b[c])


def test_shipped_traces_are_the_shared_ones():
    """The gzipped copies in data/traces hold every row of the seven public traces."""
    expected = {"asr_librispeech_commonvoice.csv": 50512, "audio_caption_clotho_audiocaps_soundbible.csv": 38132,
                "image_caption_coco_val2017.csv": 25014, "music_caption_musiccaps.csv": 5521,
                "omnibal_internvl_sft.csv": 70706, "video_activitynet_captions_qa.csv": 119752,
                "video_qa_nextqa.csv": 13560}
    for name, rows in expected.items():
        assert len(load_trace(name)) == rows, name


def test_mixture_draw_is_seeded_and_weighted(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_ORCH_CACHE", str(tmp_path / "cache"))
    write_csv(tmp_path / "a.csv", [dict(task="a", text_tokens=i) for i in range(10)])
    write_csv(tmp_path / "b.csv", [dict(task="b", text_tokens=100 + i) for i in range(5)])
    write_csv(tmp_path / "c.csv", [dict(task="c", text_tokens=1000)])
    mixture = load_mixture([("a.csv", 3.0), ("b.csv", 1.0), ("c.csv", 0.0)], traces_dir=tmp_path)
    assert mixture.weights == (0.75, 0.25, 0.0)
    batch = mixture.draw(4000, seed=7)
    assert len(batch) == 4000
    tasks = list(batch["task"])
    assert "c" not in tasks
    assert abs(tasks.count("a") / 4000 - 0.75) < 0.03
    a_tokens = batch["text_tokens"][np.array(tasks) == "a"]
    assert set(a_tokens.astype(int)) == set(range(10))  # rows of a trace drawn uniformly
    np.testing.assert_array_equal(mixture.draw(4000, seed=7)["text_tokens"], batch["text_tokens"])
    assert not np.array_equal(mixture.draw(4000, seed=8)["text_tokens"], batch["text_tokens"])
    with pytest.raises(ValueError, match="weights"):
        TraceMixture(mixture.traces, (1.0, -1.0, 0.0))


def test_parse_trace_spec():
    assert parse_trace_spec("omnibal_internvl_sft.csv:0.3") == ("omnibal_internvl_sft.csv", 0.3)
    assert parse_trace_spec("/x/y.csv") == ("/x/y.csv", 1.0)
