"""Data pipeline: example/micro-batch format, synthetic trace-driven dataset, Megatron sampler, JSONL manifests."""
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.cost import FunctionCost
from megatron_orch.balance.traces import Trace, TraceMixture
from megatron_orch.balance.workload import BackbonePhase, EncoderPhase, ModelPhases
from megatron_orch.megatron.batch import BatchSpec, EncoderInput, Example, collate, collate_packed
from megatron_orch.mllm.config import PAD_TOKEN_ID, load_model_config
from megatron_orch.mllm.data import MegatronPretrainingSampler, build_train_iterator
from megatron_orch.mllm.data_config import DataConfig
from megatron_orch.mllm.examples import batch_spec, example_layout
from megatron_orch.mllm.manifest import ImageTiling, ManifestDataset, ManifestError, image_tiling
from megatron_orch.mllm.synthetic import SyntheticMultimodalDataset

TINY = load_model_config("tiny")
SEQ = 256
IMAGE_TOKEN_ID, AUDIO_TOKEN_ID = (TINY.encoders[name].placeholder_id for name in ("vision", "audio"))

# A small hand-made mixture: image SFT, video QA (duration or source frames), ASR with and without text,
# and a long audio clip.
SMALL_MIXTURE = TraceMixture(
    (Trace.from_rows("images", [{"vision_tiles": 5, "text_tokens": 300}, {"vision_tiles": 1, "text_tokens": 12}]),
     Trace.from_rows("video", [{"video_sec": 117.0, "text_tokens": 11}, {"video_frames": 90, "text_tokens": 50}]),
     Trace.from_rows("asr", [{"audio_sec": 4.4, "text_tokens": 14}, {"audio_sec": 14.0},
                             {"audio_sec": 600.0, "text_tokens": 8}])),
    (0.4, 0.3, 0.3))


def small_dataset(num_samples=64, seed=7, **kwargs):
    return SyntheticMultimodalDataset(TINY, num_samples, seed, mixture=SMALL_MIXTURE, seq_length=SEQ, **kwargs)


def assert_examples_equal(a: Example, b: Example):
    assert a.sample_index == b.sample_index
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for phase in set(a.items) | set(b.items):  # a phase left out has no items
        assert a.num_items(phase) == b.num_items(phase), phase
        if a.num_items(phase):
            assert torch.equal(a.items[phase], b.items[phase]), phase


# ------------------------------------------------------------------------------------------------ sampler

def upstream_indices(total, consumed, mbs, rank, dp):
    """Megatron-LM's MegatronPretrainingSampler loop: fill mbs*dp indices, hand rank its slice."""
    out, batch = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp:
            out.append(batch[rank * mbs:(rank + 1) * mbs])
            batch = []
    return out


def test_sampler_hand_computed_dp2_mbs2():
    rank0 = list(MegatronPretrainingSampler(13, 0, 2, 0, 2))
    rank1 = list(MegatronPretrainingSampler(13, 0, 2, 1, 2))
    assert rank0 == [[0, 1], [4, 5], [8, 9]]
    assert rank1 == [[2, 3], [6, 7], [10, 11]]  # 12 is an incomplete step: dropped
    assert list(MegatronPretrainingSampler(13, 4, 2, 1, 2)) == [[6, 7], [10, 11]]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(0, 59), st.integers(1, 4), st.integers(1, 4), st.data())
def test_sampler_equals_upstream(total, consumed, mbs, dp, data):
    consumed = consumed % total
    rank = data.draw(st.integers(0, dp - 1))
    assert list(MegatronPretrainingSampler(total, consumed, mbs, rank, dp)) == \
        upstream_indices(total, consumed, mbs, rank, dp)


def test_sampler_resumes_by_consumed_samples():
    mbs, dp, total = 2, 3, 60
    full = list(MegatronPretrainingSampler(total, 0, mbs, 1, dp))
    for steps in range(len(full)):
        resumed = list(MegatronPretrainingSampler(total, steps * mbs * dp, mbs, 1, dp))
        assert resumed == full[steps:]


@pytest.mark.parametrize("args, message", [
    ((0, 0, 1, 0, 1), "no sample"), ((10, 10, 1, 0, 1), "no samples left"), ((10, 0, 0, 0, 1), "micro_batch"),
    ((10, 0, 1, 2, 2), "data_parallel_rank=2"), ((10, -1, 1, 0, 1), "no samples left")])
def test_sampler_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(*args)


# ---------------------------------------------------------------------------------------- synthetic data

def test_synthetic_is_a_pure_function_of_seed_and_index():
    a, b = small_dataset(64, seed=7), small_dataset(500, seed=7)
    for i in range(0, 64, 3):
        assert_examples_equal(a[i], b[i])  # also independent of the dataset's length
    other_seed = small_dataset(64, seed=8)
    assert not all(torch.equal(a[i].tokens, other_seed[i].tokens) for i in range(16))
    distinct = {tuple(a[i].tokens.tolist()) for i in range(64)}
    assert len(distinct) > 50


def test_synthetic_sizes_match_materialised_examples():
    dataset = small_dataset(200)
    spec = dataset.layout.spec
    for i in range(len(dataset)):
        example = dataset[i]
        sizes = dataset.example_sizes(i)
        assert sizes == example.sizes()
        assert int((example.tokens == IMAGE_TOKEN_ID).sum()) == sizes.num_items("vision") * spec.rows_per_item("vision")
        assert int((example.tokens == AUDIO_TOKEN_ID).sum()) == sizes.num_items("audio") * spec.rows_per_item("audio")
        assert example.num_tokens <= SEQ
        # next-token labels; loss only on the answer (and EOS), never on placeholders or the prompt
        assert torch.equal(example.labels[:-1], example.tokens[1:])
        masked_labels = example.labels[example.loss_mask > 0]
        assert not torch.isin(masked_labels, torch.tensor([IMAGE_TOKEN_ID, AUDIO_TOKEN_ID])).any()
        assert example.loss_mask[:1 + dataset.prompt_tokens].sum() == 0


def test_synthetic_scaling_of_trace_rows():
    dataset = small_dataset(400)
    window_tokens = dataset.layout.spec.rows_per_item("audio")
    seen = set()
    for i in range(len(dataset)):
        s = dataset.example_sizes(i)
        seen.add((s.num_items("vision"), s.num_items("audio")))
    # tiles as in the trace (5, 1); video at 0.5 fps capped at 4 frames (117 s and 90 frames/30 fps = 3 s
    # -> 4 and 2 frames); audio ceil(sec / 30 s) windows: 4.4 s and 14 s -> 1, 600 s -> 20, capped at 16.
    assert seen == {(5, 0), (1, 0), (4, 0), (2, 0), (0, 1), (0, 16)}
    long_clip = next(i for i in range(len(dataset)) if dataset.example_sizes(i).num_items("audio") == 16)
    assert dataset.example_sizes(long_clip).num_tokens == 1 + dataset.prompt_tokens + 16 * window_tokens + 2
    # ASR 4.4 s in a 30 s window: the last window keeps ceil(4.4/30 * 64) = 10 frames, then zero padding
    short = next(i for i in range(len(dataset)) if dataset.example_sizes(i).num_items("audio") == 1
                 and dataset.answer_tokens[i] == round(14 * 0.25))
    audio = dataset[short].items["audio"][0]
    assert audio[:10].abs().sum(dim=1).min() > 0 and audio[10:].abs().sum() == 0


def test_synthetic_fits_a_short_sequence_length():
    dataset = SyntheticMultimodalDataset(TINY, 200, 3, mixture=SMALL_MIXTURE, seq_length=32)
    for i in range(len(dataset)):
        example = dataset[i]
        assert example.num_tokens <= 32 and example.sizes().num_loss_tokens >= 2
    with pytest.raises(ValueError, match="seq_length=12"):
        SyntheticMultimodalDataset(TINY, 10, 3, mixture=SMALL_MIXTURE, seq_length=12)


def test_synthetic_text_is_learnable_bigram_chain():
    dataset = small_dataset(300)
    follows = total = 0
    for i in range(len(dataset)):
        example = dataset[i]
        answer = example.labels[example.loss_mask > 0][:-1].tolist()  # drop EOS
        letters = [("abcdefghijklmnopqrstuvwxyz ".index(chr(t))) for t in answer]
        follows += sum(int(dataset._successor[a] == b) for a, b in zip(letters, letters[1:]))
        total += max(0, len(letters) - 1)
    assert total > 1000 and 0.75 < follows / total < 0.9  # 0.8 + 0.2/27 expected


def test_default_mixture_shows_modality_incoherence():
    dataset = SyntheticMultimodalDataset(TINY, 3000, 0, seq_length=512)
    records = [dataset.example_sizes(i) for i in range(len(dataset))]
    vision = np.array([r.num_items("vision") for r in records])
    audio = np.array([r.num_items("audio") for r in records])
    loss = np.array([r.num_loss_tokens for r in records])
    assert ((vision > 0) & (audio == 0)).mean() > 0.4  # image SFT, captions, video
    assert ((audio > 0) & (vision == 0)).mean() > 0.2  # ASR, audio / music captions
    assert set(dataset.kind.tolist()) >= {"image", "video", "audio"}
    assert np.corrcoef(vision, audio)[0, 1] < 0  # a batch balanced for one encoder is not for the other
    spec = dataset.layout.spec
    media = vision * spec.rows_per_item("vision") + audio * spec.rows_per_item("audio")
    ratio = media / loss
    assert np.percentile(ratio, 90) / np.percentile(ratio, 10) > 10


# ------------------------------------------------------------------------------------- collate and split

def _phase(name: str) -> EncoderPhase:
    return EncoderPhase(name, FunctionCost(lambda s: s), item_tokens=1, input_bytes=1, output_rows=1,
                        output_row_bytes=1)


# Any phases: two encoder phases of items [3, 2] and [4, 3] (placeholders are not checked by collate).
TWO_PHASES = BatchSpec(ModelPhases((_phase("v"), _phase("a")), BackbonePhase("text", FunctionCost(lambda s: s), 1)),
                       (EncoderInput("v", (3, 2), 300), EncoderInput("a", (4, 3), 301)), pad_token_id=PAD_TOKEN_ID,
                       seq_length=64)


@st.composite
def examples_lists(draw):
    out = []
    for index in draw(st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=6, unique=True)):
        n = draw(st.integers(1, 20))
        n_v, n_a = draw(st.integers(0, 3)), draw(st.integers(0, 3))
        g = torch.Generator().manual_seed(index)
        mask = (torch.rand(n, generator=g) > 0.3).float()
        items = {"v": torch.randn(n_v, 3, 2, generator=g), "a": torch.randn(n_a, 4, 3, generator=g)}
        if draw(st.booleans()):  # a phase without items may be left out
            items = {name: t for name, t in items.items() if t.shape[0]}
        out.append(Example(index, torch.randint(0, 256, (n,), generator=g), torch.randint(0, 256, (n,), generator=g),
                           mask, items))
    return out


@settings(max_examples=60, deadline=None)
@given(examples_lists(), st.booleans(), st.integers(0, 5))
def test_collate_split_roundtrip(examples, packed, extra):
    longest, total = max(e.num_tokens for e in examples), sum(e.num_tokens for e in examples)
    batch = (collate_packed(examples, TWO_PHASES, pad_to=total + extra) if packed
             else collate(examples, TWO_PHASES, pad_to=longest + extra))
    assert batch.num_examples == len(examples)
    assert batch.items["v"].shape == (sum(e.num_items("v") for e in examples), 3, 2)
    assert batch.items["a"].shape == (sum(e.num_items("a") for e in examples), 4, 3)
    for original, split in zip(examples, batch.examples()):
        assert_examples_equal(original, split)
    assert batch.sizes() == [e.sizes() for e in examples]
    assert float(batch.loss_mask.sum()) == sum(float(e.loss_mask.sum()) for e in examples)
    padding = batch.tokens == PAD_TOKEN_ID
    assert int(padding.sum()) >= batch.tokens.numel() - total
    if packed:
        assert batch.tokens.shape == (1, total + extra)
        # the attention's sequences against the owner of each position: example i is sequence i, the tail none
        owner = [i for i, e in enumerate(examples) for _ in range(e.num_tokens)] + [-1] * extra
        params = batch.to(torch.device("cpu")).packed_seq_params()
        bounds = params.host_cu_seqlens
        assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
        assert params.cu_seqlens_q.tolist() == list(bounds) and params.cu_seqlens_kv is params.cu_seqlens_q
        assert [owner[start:end] for start, end in zip(bounds, bounds[1:])] == [
            [i] * e.num_tokens for i, e in enumerate(examples)]
        assert owner[bounds[-1]:] == [-1] * extra
        assert params.max_seqlen_q == params.max_seqlen_kv == longest
        # Transformer Engine's: the padding tail, if any, is one more sequence
        te = batch.packed_seq_params(tail_as_sequence=True)
        te_bounds = list(bounds) + ([total + extra] if extra else [])
        assert list(te.host_cu_seqlens) == te.cu_seqlens_q.tolist() == te_bounds and te.cu_seqlens_kv is te.cu_seqlens_q
        assert te.cu_seqlens_q.dtype == torch.int32 and te.max_seqlen_q == max(longest, extra)
        starts = [0] + np.cumsum([e.num_tokens for e in examples]).tolist()
        for i, e in enumerate(examples):
            assert batch.position_ids[0, starts[i]:starts[i + 1]].tolist() == list(range(e.num_tokens))
    else:
        assert batch.tokens.shape == (len(examples), longest + extra) and batch.packed_seq_params() is None
        assert batch.position_ids[0].tolist() == list(range(longest + extra))


def test_collate_all_text_only_keeps_item_shapes_and_rejects_mismatch():
    dataset = small_dataset(8)
    spec = dataset.layout.spec
    text_only = [replace(dataset[i], items={}) for i in range(3)]
    batch = collate(text_only, spec)
    assert batch.items["vision"].shape == (0, 16, 48) and batch.items["audio"].shape == (0, 64, 16)
    assert batch.item_counts["vision"].tolist() == [0, 0, 0]
    odd = replace(text_only[1], items={"vision": torch.zeros(1, 5, 5)})
    with pytest.raises(ValueError, match="vision items have shape"):
        collate([text_only[0], odd], spec)
    with pytest.raises(ValueError, match="shorter than"):
        collate(text_only, spec, pad_to=3)
    with pytest.raises(ValueError, match="at least one example"):
        collate([], spec)


# ---------------------------------------------------------------------------------------- train iterator

def test_train_iterator_follows_the_sampler_and_resumes():
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=2, num_samples=40, seed=5)
    per_rank = [list(build_train_iterator(config, 0, rank, 2)) for rank in range(2)]
    assert [len(batches) for batches in per_rank] == [10, 10]
    for step in range(10):
        ids = per_rank[0][step].sample_ids.tolist() + per_rank[1][step].sample_ids.tolist()
        assert ids == list(range(4 * step, 4 * step + 4))
    resumed = list(build_train_iterator(config, 12, 1, 2))
    assert len(resumed) == 7
    for a, b in zip(resumed, per_rank[1][3:]):
        for x, y in zip(a.examples(), b.examples()):
            assert_examples_equal(x, y)
    fixed = next(build_train_iterator(replace(config, pad_to_seq_length=True), 0, 0, 2))
    assert fixed.tokens.shape == (2, SEQ)


def test_batch_spec_of_tiny_config():
    spec = batch_spec(TINY, SEQ)
    assert spec.inputs == (EncoderInput("vision", (16, 48), 260), EncoderInput("audio", (64, 16), 259))
    assert (spec.rows_per_item("vision"), spec.rows_per_item("audio")) == (4, 8)
    assert spec.pad_token_id == PAD_TOKEN_ID and spec.seq_length == SEQ and spec.phases == TINY.phases()
    with pytest.raises(ValueError, match="max_position_embeddings"):
        batch_spec(TINY, 10 ** 6)
    with pytest.raises(ValueError, match="placeholder ids .* and pad id 259 must be distinct"):
        replace(spec, pad_token_id=259)
    with pytest.raises(ValueError, match=r"inputs are for phases \['audio'\]"):
        replace(spec, inputs=spec.inputs[1:])


def test_three_encoders_by_configuration_alone():
    """tiny_video: the synthetic data sends images to the vision phase, sampled video frames to the video
    phase (24 px frames), audio to audio; each phase's placeholders follow its items."""
    three = load_model_config("tiny_video")
    dataset = SyntheticMultimodalDataset(three, 300, 0, seq_length=512)
    spec = dataset.layout.spec
    assert [i.phase for i in spec.inputs] == ["vision", "video", "audio"]
    assert spec.input("video").item_shape == (36, 48) and spec.rows_per_item("video") == 9
    counts = {phase: 0 for phase in spec.phases.encoder_names}
    for i in range(len(dataset)):
        example = dataset[i]
        spec.check(example)
        assert dataset.example_sizes(i) == example.sizes()
        for phase in counts:
            counts[phase] += example.num_items(phase)
        if dataset.kind[i] == "video":
            assert example.num_items("video") > 0 and example.num_items("vision") == 0
    assert min(counts.values()) > 0, counts


# ------------------------------------------------------------------------------------------ JSONL manifest

def test_image_tiling_rule():
    tiling = ImageTiling(tile_px=16, patch_px=4, max_tiles=6)
    assert tiling.grid(640, 480) == (3, 2) and tiling.num_tiles(640, 480) == 7  # as the COCO trace's 7
    assert tiling.num_tiles(16, 16) == 1 and tiling.num_tiles(10, 40) == 3  # 1 x 2 grid + thumbnail
    image = np.arange(16 * 16 * 3, dtype=np.float32).reshape(16, 16, 3)
    patches = tiling.tiles(image)
    assert patches.shape == (1, 16, 48)
    # patch (row 1, col 2) in raster order, flattened channel-major
    assert np.array_equal(patches[0, 1 * 4 + 2], image[4:8, 8:12].transpose(2, 0, 1).reshape(-1))


@pytest.fixture
def manifest_dir(tmp_path):
    from PIL import Image
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (48, 32, 3), dtype=np.uint8)).save(tmp_path / "tall.png")
    np.save(tmp_path / "square.npy", rng.random((16, 16, 3)).astype(np.float32))
    np.save(tmp_path / "speech.npy", rng.standard_normal((150, 16)).astype(np.float32))  # 3 windows of 64
    np.save(tmp_path / "rgba.npy", np.zeros((8, 8, 4), np.uint8))
    np.save(tmp_path / "wrong_bins.npy", np.zeros((10, 80), np.float32))
    return tmp_path


def write_manifest(path, entries):
    path.write_text("\n".join(e if isinstance(e, str) else json.dumps(e) for e in entries) + "\n")
    return path


def test_manifest_loads_examples_and_sizes_without_data(manifest_dir):
    layout = example_layout(TINY, SEQ)
    entries = [
        {"text": "a tall picture", "prompt": "describe:", "images": ["tall.png", "square.npy"]},
        {"text": "hello world", "audio": ["speech.npy"]},
        {"text": "both", "images": ["square.npy"], "audio": ["speech.npy"],
         "sizes": {"vision_items": 1, "audio_items": 3, "text_tokens": 4}},
        "",  # blank lines are skipped
        {"text": "x" * 1000},  # answer truncated to the sequence length
    ]
    dataset = ManifestDataset(write_manifest(manifest_dir / "m.jsonl", entries), layout, image_tiling(TINY))
    assert len(dataset) == 4
    for i in range(len(dataset)):
        assert dataset.example_sizes(i) == dataset[i].sizes()
    tall = dataset[0]
    assert tall.num_items("vision") == 7 + 1  # 32 x 48 px: a 2 x 3 grid + thumbnail, then the 16 x 16 image
    assert bytes(tall.tokens[1:10].tolist()) == b"describe:"
    square = np.load(manifest_dir / "square.npy")
    assert torch.allclose(tall.items["vision"][7, 0],
                          torch.from_numpy(square[:4, :4].transpose(2, 0, 1).reshape(-1)))
    speech = dataset[1]
    mel = torch.from_numpy(np.load(manifest_dir / "speech.npy"))
    audio = speech.items["audio"]
    assert audio.shape == (3, 64, 16)
    assert torch.equal(audio.reshape(-1, 16)[:150], mel) and audio.reshape(-1, 16)[150:].abs().sum() == 0
    answer = speech.labels[speech.loss_mask > 0]
    assert bytes(answer[:-1].tolist()) == b"hello world"
    assert dataset[3].num_tokens == SEQ


def test_manifest_sizes_field_avoids_reading_files(manifest_dir):
    entries = [{"text": "abc", "images": ["missing.png"], "sizes": {"vision_items": 2, "audio_items": 0,
                                                                    "text_tokens": 3}}]
    dataset = ManifestDataset(write_manifest(manifest_dir / "m.jsonl", entries), example_layout(TINY, SEQ),
                              image_tiling(TINY))
    sizes = dataset.example_sizes(0)
    assert (sizes.num_items("vision"), sizes.num_items("audio"), sizes.num_loss_tokens) == (2, 0, 4)
    with pytest.raises(ManifestError, match=r"m.jsonl:1: image file .*missing.png does not exist"):
        dataset[0]


@pytest.mark.parametrize("line, message", [
    ('{"text": "a", ', r"m.jsonl:2: not valid JSON"),
    ('["text"]', r"m.jsonl:2: expected a JSON object"),
    ('{"prompt": "a"}', r"m.jsonl:2: 'text' must be a string"),
    ('{"text": "a", "image": ["x.png"]}', r"m.jsonl:2: unknown keys \['image'\]"),
    ('{"text": "a", "audio": "speech.npy"}', r"m.jsonl:2: 'audio' must be a list of file paths"),
    ('{"text": "a", "sizes": {"vision_items": 1}}', r"m.jsonl:2: 'sizes' must be an object with exactly"),
    ('{"text": "a", "sizes": {"vision_items": -1, "audio_items": 0, "text_tokens": 1}}', r"non-negative"),
])
def test_manifest_rejects_bad_lines_naming_the_line(manifest_dir, line, message):
    path = write_manifest(manifest_dir / "m.jsonl", [{"text": "fine"}, line])
    with pytest.raises(ManifestError, match=message):
        ManifestDataset(path, example_layout(TINY, SEQ), image_tiling(TINY))


@pytest.mark.parametrize("entry, message", [
    ({"text": "a", "audio": ["wrong_bins.npy"]}, r"m.jsonl:1: audio .*wrong_bins.npy has shape \(10, 80\)"),
    ({"text": "a", "audio": ["tall.png"]}, r"m.jsonl:1: audio .*tall.png must be a .npy log-mel array"),
    ({"text": "a", "images": ["rgba.npy"]}, r"m.jsonl:1: image .*rgba.npy has 4 channels, the model takes 3"),
    ({"text": "a", "audio": ["speech.npy"], "sizes": {"vision_items": 0, "audio_items": 2, "text_tokens": 1}},
     r"m.jsonl:1: declared 'sizes' differ from the data \(declared, real\): \{'audio_items': \(2, 3\)\}"),
    ({"text": "a", "prompt": "x" * 10, "images": ["tall.png"] * 9}, r"m.jsonl:1: prompt \(10 tokens\), 63 vision items"),
])
def test_manifest_rejects_bad_data_naming_the_line(manifest_dir, entry, message):
    dataset = ManifestDataset(write_manifest(manifest_dir / "m.jsonl", [entry]), example_layout(TINY, SEQ),
                              image_tiling(TINY))
    with pytest.raises(ManifestError, match=message):
        dataset[0]


def test_manifest_tokenizer_hook(manifest_dir):
    class Words:
        def encode(self, text):
            return [500 + len(word) for word in text.split()]

    path = write_manifest(manifest_dir / "m.jsonl", [{"text": "three short words"}])
    example = ManifestDataset(path, example_layout(TINY, SEQ), image_tiling(TINY), tokenizer=Words())[0]
    assert example.labels[example.loss_mask > 0].tolist()[:-1] == [505, 505, 505]

    class Reserved:
        def encode(self, text):
            return [IMAGE_TOKEN_ID]

    with pytest.raises(ManifestError, match="reserved or negative ids"):
        ManifestDataset(path, example_layout(TINY, SEQ), image_tiling(TINY), tokenizer=Reserved())[0]


def test_train_iterator_on_a_manifest(manifest_dir):
    entries = [{"text": f"example {i}", "audio": ["speech.npy"] if i % 2 else []} for i in range(8)]
    path = write_manifest(manifest_dir / "m.jsonl", entries)
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=2, num_samples=8, data_path=str(path))
    batches = list(build_train_iterator(config, 0, 1, 2))
    assert [b.sample_ids.tolist() for b in batches] == [[2, 3], [6, 7]]
    assert batches[0].item_counts["audio"].tolist() == [0, 3]
    assert build_train_iterator(config, 0, 0, 1).epoch_note() is None


def _trained_ids(config, consumed=0, dp=2):
    """Dataset index of every sample the run trains on, in consumed-samples order (all DP ranks)."""
    per_rank = [list(build_train_iterator(config, consumed, rank, dp)) for rank in range(dp)]
    return [i for step in zip(*per_rank) for batch in step for i in batch.sample_ids.tolist()]


def test_a_run_longer_than_the_manifest_wraps_with_a_seeded_order_per_epoch(manifest_dir):
    path = write_manifest(manifest_dir / "m.jsonl", [{"text": f"example {i}"} for i in range(8)])
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=2, num_samples=32, data_path=str(path), seed=3)
    ids = _trained_ids(config)
    epochs = [ids[e * 8:(e + 1) * 8] for e in range(4)]
    assert epochs[0] == list(range(8))  # the file's order first
    assert all(sorted(epoch) == list(range(8)) for epoch in epochs)  # every example once per epoch
    assert len({tuple(epoch) for epoch in epochs}) == 4  # a new order each epoch
    assert _trained_ids(config, consumed=12) == ids[12:]  # resumed mid-epoch: the same samples
    assert _trained_ids(replace(config, seed=4))[8:] != ids[8:]  # the order is seeded
    assert "3 epochs" in build_train_iterator(replace(config, num_samples=24), 0, 0, 1).epoch_note()


@pytest.fixture
def manifest_with_a_missing_image(manifest_dir):
    entries = [{"text": f"example {i}", "images": ["square.npy"]} for i in range(8)]
    entries[5]["images"] = ["gone.png"]
    return write_manifest(manifest_dir / "m.jsonl", entries)


def test_a_bad_example_ends_the_run_naming_its_line(manifest_with_a_missing_image):
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=2, num_samples=8,
                        data_path=str(manifest_with_a_missing_image))
    iterator = build_train_iterator(config, 0, 0, 2)
    next(iterator)  # samples 0, 1
    with pytest.raises(ManifestError, match=r"^\S+m.jsonl:6: image file \S+gone.png does not exist$"):
        next(iterator)  # samples 4, 5


def test_a_skipped_example_is_replaced_alike_on_every_rank_and_after_resuming(manifest_with_a_missing_image):
    from megatron_orch.mllm.data import SampleOrder

    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=2, num_samples=16,
                        data_path=str(manifest_with_a_missing_image), max_bad_examples=1, seed=9)
    runs = [[list(build_train_iterator(config, 0, rank, 2)) for rank in range(2)] for _ in range(2)]
    for rank in range(2):  # a TP/PP peer (the same DP rank) reads the same examples
        assert [b.sample_ids.tolist() for b in runs[0][rank]] == [b.sample_ids.tolist() for b in runs[1][rank]]
    ids = _trained_ids(config)
    assert len(ids) == 16  # the global batch keeps its size
    order = SampleOrder(8, 9)
    bad_positions = [p for p in range(16) if order[p] == 5]
    assert len(bad_positions) == 2  # once per epoch
    for position in bad_positions:
        assert ids[position] == order.replacement(position, 0) != 5
    iterator = build_train_iterator(config, 0, 0, 2)  # DP rank 0 reads samples 4, 5 in step 2
    list(iterator)
    events = iterator.take_events(before=16)
    assert [(e.position, e.skipped) for e in events] == [(5, True)] + \
        [(p, True) for p in bad_positions[1:] if (p // 2) % 2 == 0]
    assert re.fullmatch(r"\S+m.jsonl:6: image file \S+gone.png does not exist", events[0].message)
    assert events[0].replacement.endswith(f"m.jsonl:{order.replacement(5, 0) + 1}")
    assert iterator.take_events(before=16) == []
    resumed = _trained_ids(config, consumed=4)
    assert resumed == ids[4:]


def test_take_events_keeps_those_of_samples_not_trained_yet(manifest_with_a_missing_image):
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=2, num_samples=8,
                        data_path=str(manifest_with_a_missing_image), max_bad_examples=3)
    iterator = build_train_iterator(config, 0, 0, 2)
    next(iterator), next(iterator)  # read up to sample 5 (a prefetching iterator reads ahead)
    assert iterator.take_events(before=4) == []
    assert [e.position for e in iterator.take_events(before=8)] == [5]


def test_replacements_that_are_all_bad_end_the_run(manifest_dir):
    path = write_manifest(manifest_dir / "m.jsonl", [{"text": "a", "images": ["gone.png"]}] * 3)
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=1, num_samples=3, data_path=str(path),
                        max_bad_examples=5)
    with pytest.raises(ManifestError, match=r"m.jsonl:1: image file .* does not exist; and 16 seeded draws of a "
                                            r"replacement were bad too \(the last: \S+m.jsonl:\d: image file"):
        next(build_train_iterator(config, 0, 0, 1))


def test_long_answers_are_truncated_and_said_or_refused(manifest_dir):
    path = write_manifest(manifest_dir / "m.jsonl", [{"text": "short"}, {"text": "x" * 1000}])
    config = DataConfig(TINY, seq_length=SEQ, micro_batch_size=1, num_samples=2, data_path=str(path))
    iterator = build_train_iterator(config, 0, 0, 1)
    short, long = next(iterator), next(iterator)
    assert long.tokens.shape[1] == SEQ and short.tokens.shape[1] < SEQ
    events = iterator.take_events(before=2)
    assert [(e.position, e.skipped) for e in events] == [(1, False)]
    assert re.fullmatch(rf"\S+m.jsonl:2: answer of 1000 tokens, {SEQ - 1} fit in --seq-length {SEQ} after the "
                        rf"prompt and media: truncated to {SEQ - 1} \(EOS kept\)", events[0].message)
    refused = build_train_iterator(replace(config, refuse_long_answers=True), 0, 0, 1)
    next(refused)
    with pytest.raises(ManifestError, match=r"m.jsonl:2: answer of 1000 tokens, .* \(--refuse-long-answers\)$"):
        next(refused)


def test_check_makes_the_checks_of_loading_from_the_headers(manifest_dir):
    """``check`` finds without loading what loading would refuse: declared sizes that differ from the
    files, media that do not fit, a missing file; a truncated image's data only with ``decode``."""
    from PIL import Image
    Image.open(manifest_dir / "tall.png").save(manifest_dir / "cut.png")
    data = (manifest_dir / "cut.png").read_bytes()
    (manifest_dir / "cut.png").write_bytes(data[:len(data) // 2])
    entries = [{"text": "fine", "images": ["tall.png"]},
               {"text": "abc", "images": ["square.npy"], "sizes": {"vision_items": 2, "audio_items": 0,
                                                                   "text_tokens": 3}},
               {"text": "a", "images": ["tall.png"] * 9, "prompt": "x" * 10},
               {"text": "a", "audio": ["gone.npy"]},
               {"text": "a", "images": ["cut.png"]}]
    dataset = ManifestDataset(write_manifest(manifest_dir / "m.jsonl", entries), example_layout(TINY, SEQ),
                              image_tiling(TINY))
    assert dataset.check(0) is None and dataset.check(0, decode=True) is None
    for index, message in ((1, r"m.jsonl:2: declared 'sizes' differ from the data \(declared, real\): "
                               r"\{'vision_items': \(2, 1\)\}"),
                           (2, r"m.jsonl:3: prompt \(10 tokens\), 63 vision items"),
                           (3, r"m.jsonl:4: file \S+gone.npy does not exist")):
        for decode in (False, True):
            with pytest.raises(ManifestError, match=message):
                dataset.check(index, decode=decode)
    assert dataset.check(4) is None  # the header is fine
    with pytest.raises(ManifestError, match=r"m.jsonl:5: cannot read image \S+cut.png: image file is truncated"):
        dataset.check(4, decode=True)


def test_manifest_identity_follows_the_content(manifest_dir, monkeypatch):
    from megatron_orch.mllm import manifest

    lines = [{"text": f"example {i}"} for i in range(50)]
    path = write_manifest(manifest_dir / "m.jsonl", lines)
    first = manifest.manifest_identity(path)
    assert first == manifest.manifest_identity(write_manifest(manifest_dir / "copy.jsonl", lines))
    assert first["bytes"] == path.stat().st_size and len(first["sha256"]) == 64
    shuffled = write_manifest(manifest_dir / "m.jsonl", lines[1:] + lines[:1])  # same size, same lines
    assert manifest.manifest_identity(shuffled) != first
    monkeypatch.setattr(manifest, "FULLY_HASHED_BYTES", 100)  # a "huge" manifest: sampled, with its mtime
    sampled = manifest.manifest_identity(shuffled)
    assert set(sampled) == {"bytes", "mtime_ns", "sampled_mib", "sampled_sha256"}


# ------------------------------------------------------------------------------- input limits of a manifest

def _png_header_only(path, width, height):
    """A PNG whose header declares width x height pixels and holds no pixel data: enough for any reader
    that looks at the header, an error for one that decodes."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", b"") + chunk(b"IEND", b""))
    return path


def _npy_header_only(path, shape, dtype):
    """A .npy file whose header declares ``shape`` and holds no data."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                 "fortran_order": False, "shape": tuple(shape)})
    return path


def _limited_dataset(manifest_dir, entries, max_num_tiles=6, **limits):
    from megatron_orch.mllm.manifest import InputLimits
    return ManifestDataset(write_manifest(manifest_dir / "m.jsonl", entries), example_layout(TINY, SEQ),
                           image_tiling(TINY, max_num_tiles), limits=InputLimits(**limits))


@pytest.mark.parametrize("make, message", [
    (lambda d: _png_header_only(d / "huge.png", 100_000, 100_000),
     r"m.jsonl:2: image .*huge.png has 100000 x 100000 = 10000000000 pixels, above --max-image-pixels 67108864"),
    (lambda d: _npy_header_only(d / "huge.npy", (100_000, 100_000, 3), np.uint8),
     r"m.jsonl:2: image .*huge.npy has 100000 x 100000 = 10000000000 pixels, above --max-image-pixels 67108864"),
    (lambda d: _npy_header_only(d / "long.npy", (3_600_000, 16), np.float32),
     r"m.jsonl:2: audio .*long.npy holds 36000.0 s of log-mel frames \(3600000 at 100 per second\), above "
     r"--max-audio-seconds 600"),
])
def test_oversized_inputs_are_refused_from_their_headers(manifest_dir, make, message):
    """Header-only files: a loader that read the data (or let Pillow refuse) would fail differently."""
    path = make(manifest_dir)
    key = "audio" if "long" in path.name else "images"
    dataset = _limited_dataset(manifest_dir, [{"text": "fine"}, {"text": "big", key: [path.name]}])
    for read in (dataset.example_sizes, dataset.__getitem__):
        with pytest.raises(ManifestError, match=message):
            read(1)


def test_limits_of_tiles_and_items_per_example(manifest_dir):
    entries = [{"text": "a", "images": ["tall.png", "tall.png"]}]  # 2 x (2 x 3 grid + thumbnail) = 14 items
    assert _limited_dataset(manifest_dir, entries, max_num_tiles=2).example_sizes(0).num_items("vision") == 2 * 3
    dataset = _limited_dataset(manifest_dir, entries, max_vision_items_per_sample=13)
    for read in (dataset.example_sizes, dataset.__getitem__):
        with pytest.raises(ManifestError, match=r"m.jsonl:1: 14 vision items \(tiles and thumbnails of 2 images\), "
                                                r"above --max-vision-items-per-sample 13"):
            read(0)
    declared = [{"text": "a", "sizes": {"vision_items": 20, "audio_items": 0, "text_tokens": 1}}]
    with pytest.raises(ManifestError, match=r"m.jsonl:1: 'sizes' declares 20 vision items, above "
                                            r"--max-vision-items-per-sample 13"):
        _limited_dataset(manifest_dir, declared, max_vision_items_per_sample=13)
    with pytest.raises(ManifestError, match=r"m.jsonl:1: audio .*speech.npy holds 1.5 s .* above --max-audio-seconds 1"):
        _limited_dataset(manifest_dir, [{"text": "a", "audio": ["speech.npy"]}], max_audio_seconds=1.0)[0]


@pytest.mark.parametrize("bad", [dict(max_image_pixels=0), dict(max_num_tiles=0), dict(max_audio_seconds=-1.0),
                                 dict(max_audio_seconds=float("nan")), dict(max_vision_items_per_sample=0)])
def test_limits_out_of_range_are_refused(bad):
    from megatron_orch.mllm.manifest import InputLimits
    flag = "--" + next(iter(bad)).replace("_", "-")
    with pytest.raises(ValueError, match=re.escape(flag)):
        if "max_num_tiles" in bad:
            image_tiling(TINY, bad["max_num_tiles"])
        else:
            InputLimits(**bad)


def test_images_are_resized_before_float_conversion(manifest_dir):
    """A 2000 x 1500 RGB image (9 MB as uint8) becomes 7 tiles of 16 x 16: loading it must not hold a
    float copy of the whole image (36 MB), in .npy form (read through a memory map: only the tiles) or
    PNG form (Pillow's array export joins its chunks: two uint8 copies at the peak)."""
    import tracemalloc

    from PIL import Image
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (2000, 1500, 3), dtype=np.uint8)
    np.save(manifest_dir / "big.npy", pixels)
    Image.fromarray(pixels).save(manifest_dir / "big.png", compress_level=0)
    dataset = _limited_dataset(manifest_dir, [{"text": "a", "images": ["big.npy"]},
                                              {"text": "a", "images": ["big.png"]}])
    expected = dataset.tiling.tiles(pixels.astype(np.float32) / 255.0)  # the reference: float first
    for index, budget in ((0, 0.25 * pixels.nbytes), (1, 2.5 * pixels.nbytes)):
        tracemalloc.start()
        try:
            example = dataset[index]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        np.testing.assert_allclose(example.items["vision"].numpy(), expected, rtol=1e-6)
        assert peak < budget, (index, peak, pixels.nbytes)


@pytest.mark.parametrize("sizes", ['{"vision_items": NaN, "audio_items": 0, "text_tokens": 1}',
                                   '{"vision_items": 1, "audio_items": Infinity, "text_tokens": 1}',
                                   '{"vision_items": 1, "audio_items": 0, "text_tokens": -3}',
                                   '{"vision_items": 1.5, "audio_items": 0, "text_tokens": 3}'])
def test_manifest_sizes_negative_or_non_finite_are_refused_naming_the_line(manifest_dir, sizes):
    path = write_manifest(manifest_dir / "m.jsonl", [{"text": "fine"}, '{"text": "a", "sizes": ' + sizes + '}'])
    with pytest.raises(ManifestError, match=r"m.jsonl:2: 'sizes' values must be non-negative integers"):
        ManifestDataset(path, example_layout(TINY, SEQ), image_tiling(TINY))


@pytest.mark.parametrize("raw, message", [
    # cut short: json reports "line 2 column 1" (past the newline); the fault is after character 27
    (b'{"text": "abc", "images": [\n', r"m.jsonl:2: not valid JSON \(Expecting value at column 28\)"),
    (b'{"text": "abc", "images": ["a.png",]}\n', r"m.jsonl:2: not valid JSON \(Expecting value at column 36\)"),
    # Latin-1, not UTF-8: the e-acute of "caf\xe9" is character 14 (in the second line, character 18 and
    # byte 20: columns count characters)
    (b'{"text": "caf\xe9"}\n', r"m.jsonl:2: not UTF-8 text \(byte 0xe9 at column 14\)"),
    (b'{"text": "\xc3\xa9t\xc3\xa9 caf\xe9"}\n', r"m.jsonl:2: not UTF-8 text \(byte 0xe9 at column 18\)"),
])
def test_manifest_line_errors_name_the_line_and_column(manifest_dir, raw, message):
    path = manifest_dir / "m.jsonl"
    path.write_bytes(b'{"text": "fine"}\n' + raw + b'{"text": "also fine"}\n')
    with pytest.raises(ManifestError, match=message):
        ManifestDataset(path, example_layout(TINY, SEQ), image_tiling(TINY))


def test_16_bit_images_are_scaled_not_saturated(manifest_dir):
    """A 16-bit grey PNG (Pillow mode I;16, which convert("RGB") clips at 255) and a uint16 .npy array
    become pixels in [0, 1] by 1/65535, like their 8-bit versions by 1/255."""
    from PIL import Image
    grey16 = (np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 257)  # 0 .. 65535
    Image.fromarray(grey16).save(manifest_dir / "grey16.png")
    assert Image.open(manifest_dir / "grey16.png").mode.startswith("I;16")
    np.save(manifest_dir / "grey16.npy", grey16)
    np.save(manifest_dir / "grey8.npy", (grey16 // 257).astype(np.uint8))
    entries = [{"text": "a", "images": [name]} for name in ("grey16.png", "grey16.npy", "grey8.npy")]
    dataset = ManifestDataset(write_manifest(manifest_dir / "m.jsonl", entries), example_layout(TINY, SEQ),
                              image_tiling(TINY))
    expected = dataset.tiling.tiles(grey16.astype(np.float32) / 65535.0)
    for index in range(3):
        vision = dataset[index].items["vision"].numpy()
        np.testing.assert_allclose(vision, expected, atol=1e-6)
        assert (vision == 1.0).mean() < 0.01, index  # old code: the PNG saturated at 255 / 255 = 1


def test_manifest_media_without_an_encoder_are_refused_naming_the_line(manifest_dir):
    import dataclasses
    no_audio = dataclasses.replace(TINY, encoders={"vision": TINY.encoders["vision"]})
    path = write_manifest(manifest_dir / "m.jsonl", [{"text": "fine"}, {"text": "a", "audio": ["speech.npy"]}])
    dataset = ManifestDataset(path, example_layout(no_audio, SEQ), image_tiling(no_audio))
    assert dataset[0].sizes().items == {}
    for read in (dataset.example_sizes, dataset.__getitem__):
        with pytest.raises(ValueError, match=r"m.jsonl:2: the model has no encoder of audio \(its encoders take "
                                             r"images, video\)"):
            read(1)
