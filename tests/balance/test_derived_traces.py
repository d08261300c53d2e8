"""The heavy-tailed mixtures' derived traces: every example is a run of consecutive real rows of a shipped
trace, summed, with its length in the stated range, the same every time."""
import numpy as np
import pytest

from megatron_orch.balance.traces import (DERIVED_TRACES, HEAVY_TAILED_MIXTURES, NUMERIC_COLUMNS, TAIL_TRACES,
                                          DerivedTrace, Trace, load_mixture, load_trace)


@pytest.mark.parametrize("name", sorted(DERIVED_TRACES))
def test_examples_are_runs_of_real_rows(name):
    spec = DERIVED_TRACES[name]
    derived, source = load_trace(name), load_trace(spec.source)
    keep = np.flatnonzero(np.logical_and.reduce([np.isin(source[c], v) for c, v in spec.select]
                                                + [source[c] <= bound for c, bound in spec.at_most]
                                                + [np.ones(len(source), dtype=bool)]))
    assert len(derived) == keep.size > 0
    rng = np.random.default_rng(0)
    for i in rng.choice(keep.size, 40, replace=False):
        # example i: rows keep[i], keep[i + 1], ... (wrapping), as many as the length needs
        if spec.length_column is None:
            run = keep[[i]]
        else:
            total, k = derived[spec.length_column][i], 0
            while source[spec.length_column][keep[(i + np.arange(k)) % keep.size]].sum() < total - 1e-6:
                k += 1
            run = keep[(i + np.arange(k)) % keep.size]
        for column in NUMERIC_COLUMNS:
            if column in spec.drop:
                assert derived[column][i] == 0
            elif column not in ("width", "height"):
                assert derived[column][i] == pytest.approx(source[column][run].sum()), (name, column)
    if spec.length_column is not None:
        length = derived[spec.length_column]
        assert length.min() >= spec.low and np.median(length) < spec.high
    again = spec.build()
    assert all(np.array_equal(again[c], derived[c]) for c in NUMERIC_COLUMNS)


def test_mixtures_are_short_examples_and_a_tail():
    for tail_weight, specs in zip((0.05, 0.02, 0.15), (HEAVY_TAILED_MIXTURES["heavy-tail"],
                                                       HEAVY_TAILED_MIXTURES["heavy-tail-rare"],
                                                       HEAVY_TAILED_MIXTURES["heavy-tail-harsh"])):
        mixture = load_mixture(specs)
        weights = dict(zip((t.name for t in mixture.traces), mixture.weights))
        assert sum(weights[name] for name in TAIL_TRACES) == pytest.approx(tail_weight)
        batch = mixture.draw(4000, seed=0)
        assert (batch["audio_sec"] > 60).mean() == pytest.approx(tail_weight / 3, abs=0.01)


def test_a_selection_that_matches_nothing_is_refused():
    spec = DerivedTrace("none", "nothing", "asr_librispeech_commonvoice.csv", (("source", ("no such source",)),))
    with pytest.raises(ValueError, match="no row of asr_librispeech_commonvoice.csv matches"):
        spec.build()
    assert isinstance(load_trace("long_asr"), Trace)


def test_the_shipped_benchmark_mixture_leaves_out_only_the_clip_training_refuses():
    from megatron_orch.balance.traces import AUDIO_CAPTIONS, DEFAULT_MIXTURE, SHIPPED_MIXTURE

    full, kept = load_trace(AUDIO_CAPTIONS), load_trace("audio_captions_20min")
    assert len(full) - len(kept) == 1 and full["audio_sec"].max() > 40 * 60 >= 20 * 60 >= kept["audio_sec"].max()
    assert [w for _, w in SHIPPED_MIXTURE] == [w for _, w in DEFAULT_MIXTURE]
    assert [n for n, _ in SHIPPED_MIXTURE] == [("audio_captions_20min" if n == AUDIO_CAPTIONS else n)
                                               for n, _ in DEFAULT_MIXTURE]
