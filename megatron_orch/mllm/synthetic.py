"""The embedded default dataset: synthetic examples whose modality lengths are drawn from real traces."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatron_orch.balance.traces import TraceMixture, load_mixture
from megatron_orch.balance.workload import SOURCE_VIDEO_FPS, sampled_video_frames
from megatron_orch.megatron.batch import Example, ExampleSizes
from megatron_orch.mllm.examples import assemble_example, example_shape, layout_sizes


@dataclass(frozen=True)
class SyntheticScaling:
    """How a real trace row's lengths shrink to a tiny model's example.

    * vision: image tiles as in the trace (``vision_tiles``, 1-7); video frames sampled from the
      duration at the model config's ``video_fps``, capped at its ``video_max_frames``
      (:func:`~megatron_orch.balance.workload.sampled_video_frames`);
    * audio: ``ceil(audio_sec / audio_window_sec)`` windows, capped at ``max_audio_windows``: the model's
      window (however many frames) stands for ``audio_window_sec`` seconds of real audio (Whisper: 30 s);
      the last window keeps the real fraction of its frames and is zero-padded;
    * text: ``max(1, round(text_tokens * text_scale))`` answer tokens; rows without text (LibriSpeech
      train-clean-100) get ``asr_text_tokens_per_sec * audio_sec`` tokens first (traces README);
    * the backbone's ``prompt_tokens`` precede the media. An example that would exceed ``seq_length``
      loses video frames / tiles, then audio windows, from the end, then answer tokens.

    Answer text follows a fixed random bigram chain over ``a-z`` and space (the next character is the
    chain's successor with probability ``markov_follow_prob``, else uniform), so a tiny model's loss falls
    quickly in a short overfit run.
    """

    audio_window_sec: float = 30.0
    max_audio_windows: int = 16
    text_scale: float = 0.25
    asr_text_tokens_per_sec: float = 3.0
    markov_follow_prob: float = 0.8


_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8).astype(np.int64)
_PROMPTS = {"image": "image:", "video": "video:", "audio": "audio:", "text": "text:"}  # space-padded
# Independent random streams of one dataset seed: which trace, which row, each example's content,
# the text chain. Each is indexed by sample, so example i never depends on the dataset's length.
_TRACE_STREAM, _ROW_STREAM, _CONTENT_STREAM, _CHAIN_STREAM = range(4)


class SyntheticMultimodalDataset:
    """Random pixels, mel frames and text whose per-example lengths come from real traces.

    Example ``i`` draws a trace of ``mixture`` by weight and a row of it uniformly (as upstream's
    blended, shuffled datasets and :meth:`TraceMixture.draw` do), scales its lengths with
    :class:`SyntheticScaling`, and fills the tensors from a generator seeded by ``(seed, i)``: it is a
    pure function of ``(seed, i)`` (and the mixture, scaling and shape), so any rank can build any example
    and resuming from a consumed-sample count is exact. All sizes are drawn up front, vectorised, so
    :meth:`example_sizes` costs nothing.
    """

    def __init__(self, model_config, num_samples: int, seed: int, mixture: Optional[TraceMixture] = None,
                 scaling: SyntheticScaling = SyntheticScaling(), seq_length: Optional[int] = None):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.shape = example_shape(model_config, seq_length)
        self.scaling = scaling
        self.seed = seed
        self.prompt_tokens = model_config.backbone.prompt_tokens
        mixture = load_mixture() if mixture is None else mixture
        trace_u = np.random.default_rng([seed, _TRACE_STREAM]).random(num_samples)
        row_u = np.random.default_rng([seed, _ROW_STREAM]).random(num_samples)
        which = np.minimum(np.searchsorted(np.cumsum(mixture.weights), trace_u, side="right"),
                           len(mixture.traces) - 1)
        columns = {c: np.zeros(num_samples) for c in ("vision_tiles", "video_sec", "video_frames", "audio_sec",
                                                      "text_tokens")}
        for k, trace in enumerate(mixture.traces):
            slots = np.flatnonzero(which == k)
            rows = (row_u[slots] * len(trace)).astype(np.int64)
            for column, values in columns.items():
                values[slots] = trace[column][rows]
        self._draw_lengths(columns, model_config.vision)
        chain_rng = np.random.default_rng([seed, _CHAIN_STREAM])
        self._successor = chain_rng.permutation(_ALPHABET.size)

    def _draw_lengths(self, columns: dict, vision) -> None:
        shape, scaling = self.shape, self.scaling
        video_sec = np.where(columns["video_sec"] > 0, columns["video_sec"],
                             columns["video_frames"] / SOURCE_VIDEO_FPS)
        frames = sampled_video_frames(video_sec, vision.video_fps, vision.video_max_frames)
        tiles = np.rint(columns["vision_tiles"]).astype(np.int64)
        audio_sec = columns["audio_sec"]
        windows = np.ceil(audio_sec / scaling.audio_window_sec - 1e-9).astype(np.int64)
        audio_items = np.minimum(windows, scaling.max_audio_windows)
        text = np.where(columns["text_tokens"] > 0, columns["text_tokens"],
                        scaling.asr_text_tokens_per_sec * audio_sec)
        answer = np.maximum(1, np.rint(text * scaling.text_scale)).astype(np.int64)

        room = shape.seq_length - 2 - self.prompt_tokens  # BOS, prompt, >= 1 answer token
        largest_item = max(shape.vision_llm_tokens_per_item, shape.audio_llm_tokens_per_item)
        if room < largest_item:
            raise ValueError(f"seq_length={shape.seq_length} leaves room for {room} media tokens after BOS, "
                             f"{self.prompt_tokens} prompt tokens and one answer token; one item needs "
                             f"{largest_item}")
        vision_items = np.minimum(tiles + frames, room // shape.vision_llm_tokens_per_item)
        frames = np.maximum(0, vision_items - tiles)
        vision_room = room - vision_items * shape.vision_llm_tokens_per_item
        audio_items = np.minimum(audio_items, vision_room // shape.audio_llm_tokens_per_item)
        media = vision_items * shape.vision_llm_tokens_per_item + audio_items * shape.audio_llm_tokens_per_item
        self.num_vision_items = vision_items
        self.num_audio_items = audio_items
        self.answer_tokens = np.minimum(answer, room + 1 - media)
        last_fraction = np.where(audio_items == windows,
                                 audio_sec / scaling.audio_window_sec - (windows - 1), 1.0)
        self.last_window_frames = np.clip(np.ceil(last_fraction * shape.audio_frames_per_window - 1e-9), 1,
                                          shape.audio_frames_per_window).astype(np.int64)
        self.kind = np.where(frames > 0, "video", np.where(vision_items > 0, "image",
                                                           np.where(audio_items > 0, "audio", "text")))

    def __len__(self) -> int:
        return self.num_vision_items.size

    def _check_index(self, sample_index: int) -> int:
        if not 0 <= sample_index < len(self):
            raise IndexError(f"sample {sample_index} outside the dataset's 0..{len(self) - 1}")
        return int(sample_index)

    def example_sizes(self, sample_index: int) -> ExampleSizes:
        i = self._check_index(sample_index)
        return layout_sizes(i, self.prompt_tokens, int(self.num_vision_items[i]), int(self.num_audio_items[i]),
                            int(self.answer_tokens[i]), self.shape)

    def read(self, sample_index: int) -> tuple[Example, None]:
        """Example ``sample_index`` and no truncation note (its answer is drawn to fit)."""
        return self[sample_index], None

    def __getitem__(self, sample_index: int) -> Example:
        i = self._check_index(sample_index)
        shape = self.shape
        rng = np.random.default_rng([self.seed, _CONTENT_STREAM, i])
        prompt = list(_PROMPTS[str(self.kind[i])].encode().ljust(self.prompt_tokens)[:self.prompt_tokens])
        vision = rng.standard_normal((int(self.num_vision_items[i]), shape.vision_patches_per_item,
                                      shape.vision_patch_dim), dtype=np.float32)
        audio = rng.standard_normal((int(self.num_audio_items[i]), shape.audio_frames_per_window,
                                     shape.audio_mel_bins), dtype=np.float32)
        if audio.shape[0]:
            audio[-1, int(self.last_window_frames[i]):] = 0.0
        answer = self._chain_text(rng, int(self.answer_tokens[i]))
        return assemble_example(i, prompt, answer, torch.from_numpy(vision), torch.from_numpy(audio), shape)

    def _chain_text(self, rng: np.random.Generator, length: int) -> list[int]:
        follow = rng.random(length) < self.scaling.markov_follow_prob
        jumps = rng.integers(0, _ALPHABET.size, size=length)
        state = np.empty(length, dtype=np.int64)
        for t in range(length):
            state[t] = self._successor[state[t - 1]] if t and follow[t] else jumps[t]
        return _ALPHABET[state].tolist()
