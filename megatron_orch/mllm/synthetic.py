"""The embedded default dataset: synthetic examples whose modality lengths are drawn from real traces."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatron_orch.balance.traces import TraceMixture, load_mixture
from megatron_orch.megatron.batch import Example, ExampleSizes
from megatron_orch.mllm.config import SOURCE_VIDEO_FPS, sampled_video_frames
from megatron_orch.mllm.examples import assemble_example, example_layout, layout_sizes


@dataclass(frozen=True)
class SyntheticScaling:
    """How a real trace row's lengths shrink to a tiny model's example.

    * images: tiles as in the trace (``vision_tiles``, 1-7); video: frames sampled from the duration at
      the ``video_fps`` of the encoder that takes video, capped at its ``video_max_frames``
      (:func:`~megatron_orch.mllm.config.sampled_video_frames`);
    * audio: ``ceil(audio_sec / audio_window_sec)`` windows, capped at ``max_audio_windows``: the model's
      window (however many frames) stands for ``audio_window_sec`` seconds of real audio (Whisper: 30 s);
      the last window keeps the real fraction of its frames and is zero-padded;
    * a medium no encoder of the model takes is left out;
    * text: ``max(1, round(text_tokens * text_scale))`` answer tokens; rows without text (LibriSpeech
      train-clean-100) get ``asr_text_tokens_per_sec * audio_sec`` tokens first (traces README);
    * the backbone's ``prompt_tokens`` precede the media. An example that would exceed ``seq_length``
      keeps its encoders' items in the config's order while they fit, each encoder losing the items of
      its last medium first (video frames before tiles), then answer tokens.

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
        self.layout = example_layout(model_config, seq_length)
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
        self._draw_lengths(columns, model_config)
        chain_rng = np.random.default_rng([seed, _CHAIN_STREAM])
        self._successor = chain_rng.permutation(_ALPHABET.size)

    def _draw_lengths(self, columns: dict, model_config) -> None:
        layout, scaling = self.layout, self.scaling
        spec = layout.spec
        audio_sec = columns["audio_sec"]
        windows = np.ceil(audio_sec / scaling.audio_window_sec - 1e-9).astype(np.int64)
        wanted = {"images": np.rint(columns["vision_tiles"]).astype(np.int64),
                  "audio": np.minimum(windows, scaling.max_audio_windows)}
        if "video" in layout.media:
            encoder = model_config.encoders[layout.media["video"]]
            video_sec = np.where(columns["video_sec"] > 0, columns["video_sec"],
                                 columns["video_frames"] / SOURCE_VIDEO_FPS)
            wanted["video"] = sampled_video_frames(video_sec, encoder.video_fps, encoder.video_max_frames)
        text = np.where(columns["text_tokens"] > 0, columns["text_tokens"],
                        scaling.asr_text_tokens_per_sec * audio_sec)
        answer = np.maximum(1, np.rint(text * scaling.text_scale)).astype(np.int64)

        room = layout.seq_length - 2 - self.prompt_tokens  # BOS, prompt, >= 1 answer token
        largest_item = max((spec.rows_per_item(p) for p in spec.phases.encoder_names), default=0)
        if room < largest_item:
            raise ValueError(f"seq_length={layout.seq_length} leaves room for {room} media tokens after BOS, "
                             f"{self.prompt_tokens} prompt tokens and one answer token; one item needs "
                             f"{largest_item}")
        n = answer.size
        kept = {medium: np.zeros(n, dtype=np.int64) for medium in ("images", "video", "audio")}
        self.items = {}
        for phase in spec.phases.encoder_names:
            rows = spec.rows_per_item(phase)
            media = [m for m in model_config.encoders[phase].media if m in wanted]
            count = np.minimum(sum((wanted[m] for m in media), np.zeros(n, dtype=np.int64)), room // rows)
            left = count
            for medium in media:  # the last medium loses its items first
                kept[medium] = np.minimum(wanted[medium], left)
                left = left - kept[medium]
            self.items[phase] = count
            room = room - count * rows
        media_tokens = sum((self.items[p] * spec.rows_per_item(p) for p in self.items), np.zeros(n, dtype=np.int64))
        self.answer_tokens = np.minimum(answer, layout.seq_length - 2 - self.prompt_tokens + 1 - media_tokens)
        self.audio_phase = layout.media.get("audio")
        if self.audio_phase is not None:
            frames_per_window = spec.input(self.audio_phase).item_shape[0]
            last_fraction = np.where(kept["audio"] == windows,
                                     audio_sec / scaling.audio_window_sec - (windows - 1), 1.0)
            self.last_window_frames = np.clip(np.ceil(last_fraction * frames_per_window - 1e-9), 1,
                                              frames_per_window).astype(np.int64)
        self.kind = np.where(kept["video"] > 0, "video", np.where(kept["images"] > 0, "image",
                                                                  np.where(kept["audio"] > 0, "audio", "text")))

    def __len__(self) -> int:
        return self.answer_tokens.size

    def _check_index(self, sample_index: int) -> int:
        if not 0 <= sample_index < len(self):
            raise IndexError(f"sample {sample_index} outside the dataset's 0..{len(self) - 1}")
        return int(sample_index)

    def example_sizes(self, sample_index: int) -> ExampleSizes:
        i = self._check_index(sample_index)
        return layout_sizes(i, self.prompt_tokens, {p: int(counts[i]) for p, counts in self.items.items()},
                            int(self.answer_tokens[i]), self.layout.spec)

    def where(self, sample_index: int) -> str:
        """How a message names example ``sample_index`` (a manifest names its line)."""
        return f"synthetic example {self._check_index(sample_index)}"

    def read(self, sample_index: int) -> tuple[Example, None]:
        """Example ``sample_index`` and no truncation note (its answer is drawn to fit)."""
        return self[sample_index], None

    def __getitem__(self, sample_index: int) -> Example:
        i = self._check_index(sample_index)
        rng = np.random.default_rng([self.seed, _CONTENT_STREAM, i])
        prompt = list(_PROMPTS[str(self.kind[i])].encode().ljust(self.prompt_tokens)[:self.prompt_tokens])
        items = {}
        for encoder_input in self.layout.spec.inputs:
            phase = encoder_input.phase
            items[phase] = rng.standard_normal((int(self.items[phase][i]), *encoder_input.item_shape),
                                               dtype=np.float32)
        if self.audio_phase is not None and items[self.audio_phase].shape[0]:
            items[self.audio_phase][-1, int(self.last_window_frames[i]):] = 0.0
        answer = self._chain_text(rng, int(self.answer_tokens[i]))
        return assemble_example(i, prompt, answer, {p: torch.from_numpy(t) for p, t in items.items()}, self.layout.spec)

    def _chain_text(self, rng: np.random.Generator, length: int) -> list[int]:
        follow = rng.random(length) < self.scaling.markov_follow_prob
        jumps = rng.integers(0, _ALPHABET.size, size=length)
        state = np.empty(length, dtype=np.int64)
        for t in range(length):
            state[t] = self._successor[state[t - 1]] if t and follow[t] else jumps[t]
        return _ALPHABET[state].tolist()
