"""Encoder recompute replays the RNG: with dropout 0.1, a balanced run that recomputes the encoders'
activations for their backward gives the losses of every step and the parameters after every step of
the same run that keeps them (the recomputed forward draws the dropout masks of the forward that fed
the backbone, and the RNG streams go on afterwards as if nothing had been recomputed).

Two pairs, DP 2 with post-balancing on the scripted stream of ``test_post_balancing``: each rank's items
of a phase in one chunk, kept against recomputed (``--orch-encoder-recompute``); and in chunks of one item,
all kept (``--orch-encoder-memory-cap inf``) against all recomputed. And consequence invariance with
chunks of one item under the default cap (dropout 0): the same losses and parameters as upstream.
"""

import pytest

from test_post_balancing import BALANCED, assert_invariant, assert_plan_balances, train

DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
ONE_CHUNK = ["--orch-encoder-chunk-tokens", "100000"]
ONE_ITEM_CHUNKS = ["--orch-encoder-chunk-tokens", "32"]  # tiny: vision items run 17 tokens, audio items 32


DIFFERENT = 2e-5  # ten times what assert_invariant lets parameters of about 0.1 differ by


def _largest_difference(a: dict, b: dict) -> float:
    return max(float((a["params"][r][name] - b["params"][r][name]).abs().max())
               for r in range(len(a["params"])) for name in a["params"][r])


@pytest.mark.distributed
def test_recompute_at_dropout_equals_keeping(tmp_path):
    kept = train(tmp_path, "kept", 2, *BALANCED, *DROPOUT, *ONE_CHUNK)
    recomputed = train(tmp_path, "recomputed", 2, *BALANCED, *DROPOUT, *ONE_CHUNK, "--orch-encoder-recompute")
    assert_invariant(recomputed, kept)
    # dropout is on: the run differs from the same run without it (else the comparison shows nothing)
    no_dropout = train(tmp_path, "no_dropout", 2, *BALANCED, *ONE_CHUNK)
    assert _largest_difference(kept, no_dropout) > DIFFERENT


@pytest.mark.distributed
def test_recompute_in_chunks_at_dropout_equals_keeping(tmp_path):
    kept = train(tmp_path, "kept", 2, *BALANCED, *DROPOUT, *ONE_ITEM_CHUNKS, "--orch-encoder-memory-cap", "inf")
    recomputed = train(tmp_path, "recomputed", 2, *BALANCED, *DROPOUT, *ONE_ITEM_CHUNKS, "--orch-encoder-recompute")
    assert_invariant(recomputed, kept)
    # chunks draw other dropout masks than one call: the chunking is real
    one_chunk = train(tmp_path, "one_chunk", 2, *BALANCED, *DROPOUT, *ONE_CHUNK)
    assert _largest_difference(kept, one_chunk) > DIFFERENT


@pytest.mark.distributed
def test_one_item_chunks_under_the_default_cap_are_invariant(tmp_path):
    baseline = train(tmp_path, "baseline", 2)
    chunked = train(tmp_path, "chunked", 2, *BALANCED, *ONE_ITEM_CHUNKS)
    assert_invariant(chunked, baseline)
    assert_plan_balances(chunked)
