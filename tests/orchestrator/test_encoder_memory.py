"""The planner's memory model of the encoder phases: chunks, what each rank keeps, the modeled peaks.

The vectorised model of ``plan_step`` is checked against a direct walk through each rank's step (upstream:
micro-batch by micro-batch; balanced: the kept chunks beside every backbone micro-batch, then one recomputed
chunk at a time), and its promises: under the default cap (upstream's peak at the same global batch) no
rank's modeled peak exceeds upstream's and no chunk holds more than upstream's busiest micro-batch of
encoders; under a given cap, nothing the encoders hold goes over it; ``encoder_recompute`` keeps nothing;
``inf`` keeps everything in one chunk. Bad settings are refused with the flag's name.
"""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import StepSizes, phase_items
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.config import OrchestratorConfig, item_memory
from megatron_orch.orchestrator.step_plan import plan_step
from megatron_orch.trainer import arguments
from megatron_orch.mllm.task import MLLM_TASK

TINY = load_model_config("tiny").phases()


def sizes_of(vision, audio, tokens, num_ranks):
    return StepSizes(counts=np.full(num_ranks, len(tokens) // num_ranks),
                     items={"vision": np.asarray(vision), "audio": np.asarray(audio)}, num_tokens=np.asarray(tokens))


def walk(plan, sizes, mbs, num_mb, packed):
    """(upstream peak, balanced peak, largest recomputed chunk) of every rank, step by step, and upstream's
    largest micro-batch of encoders."""
    items = phase_items(sizes, TINY)
    num_ranks = sizes.counts.size
    llm = items["llm"].memory

    def backbone(examples, packed_rows):
        if not len(examples):
            return 0.0
        return float(llm[examples].sum()) if packed_rows else len(examples) * float(llm[examples].max())

    upstream, balanced, chunk_peak, upstream_encoders = [], [], [], 0.0
    for r in range(num_ranks):
        mine = np.flatnonzero(sizes.home == r)
        peak = 0.0
        for m in range(num_mb):
            examples = mine[m * mbs:(m + 1) * mbs]
            encoders = sum(float(items[p].memory[np.isin(items[p].example, examples)].sum()) for p in ("vision", "audio"))
            peak = max(peak, encoders + backbone(examples, False))  # the loader pads rows
            upstream_encoders = max(upstream_encoders, encoders)
        upstream.append(peak)
        on_rank = plan.examples_backbone.items_on(r)
        largest_mb = max(backbone(on_rank[plan.microbatch_of_example[on_rank] == m], packed) for m in range(num_mb))
        kept, recomputed = 0.0, 0.0
        for p in ("vision", "audio"):
            count = plan.encoders[p].encode.items_on(r).size
            chunks = plan.encoders[p].chunks
            per_item = item_memory(TINY.encoder(p))
            kept += chunks.kept[r] * per_item
            for start in range(chunks.kept[r], count, chunks.items):
                recomputed = max(recomputed, (min(start + chunks.items, count) - start) * per_item)
        balanced.append(max(kept + largest_mb, recomputed))
        chunk_peak.append(recomputed)
    return np.array(upstream), np.array(balanced), np.array(chunk_peak), upstream_encoders


@st.composite
def steps(draw):
    num_ranks = draw(st.integers(1, 5))
    mbs, num_mb = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    n = num_ranks * mbs * num_mb
    vision = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    audio = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(1, 400), min_size=n, max_size=n))
    return sizes_of(vision, audio, tokens, num_ranks), mbs, num_mb


@settings(max_examples=60, deadline=None)
@given(steps(), st.sampled_from(["equal_count", "packed"]), st.booleans())
def test_default_cap_keeps_the_step_within_upstreams_memory(step, microbatching, recompute):
    sizes, mbs, num_mb = step
    config = OrchestratorConfig(microbatching=microbatching, encoder_recompute=recompute, background=False)
    plan = plan_step(sizes, TINY, config, Topology.uniform(sizes.counts.size, 1), mbs, num_mb)
    upstream, balanced, chunk_peak, upstream_encoders = walk(plan, sizes, mbs, num_mb, microbatching == "packed")
    memory = plan.memory
    np.testing.assert_allclose(memory.upstream_peak, upstream, rtol=1e-12)
    np.testing.assert_allclose(memory.peak, balanced, rtol=1e-12)
    assert memory.encoder_cap == pytest.approx(upstream.max())
    assert chunk_peak.max() <= upstream_encoders * (1 + 1e-12)  # no chunk needs more than upstream's encoders
    if microbatching == "equal_count":  # rows padded to their longest: no micro-batch above upstream's largest
        assert memory.peak.max() <= memory.upstream_peak.max() * (1 + 1e-12)
    if recompute:
        assert all(not plan.encoders[p].chunks.kept.any() for p in ("vision", "audio"))


def test_kept_chunks_fill_the_cap_beside_the_backbone():
    rng = np.random.default_rng(3)
    num_ranks, mbs, num_mb = 4, 1, 4
    n = num_ranks * mbs * num_mb
    sizes = sizes_of(rng.integers(1, 9, n), rng.integers(0, 3, n), rng.integers(50, 400, n), num_ranks)
    topology = Topology.uniform(num_ranks, 2)
    per_item = {p: item_memory(TINY.encoder(p)) for p in ("vision", "audio")}
    backbone = plan_step(sizes, TINY, OrchestratorConfig(background=False), topology, mbs,
                         num_mb).memory.phase_peak["llm"]
    cap = backbone.max() + 3.5 * per_item["vision"]
    # one item per chunk (tiny: vision items run 17 tokens, audio items 32)
    config = OrchestratorConfig(encoder_memory_cap=cap, encoder_chunk_tokens=32, background=False)
    plan = plan_step(sizes, TINY, config, topology, mbs, num_mb)
    _, balanced, chunk_peak, _ = walk(plan, sizes, mbs, num_mb, packed=False)
    np.testing.assert_allclose(plan.memory.peak, balanced, rtol=1e-12)
    assert balanced.max() <= cap and chunk_peak.max() <= cap and plan.memory.encoder_cap == cap
    vision = plan.encoders["vision"]
    assert vision.chunks.items == 1 and plan.encoders["audio"].chunks.items == 1
    assert vision.chunks.kept.min() >= 3  # the rank with the largest backbone micro-batch keeps 3 of them
    # greedy: vision (the first phase) keeps all its items, or one more would not fit
    left = cap - plan.memory.phase_peak["llm"] - vision.chunks.kept * per_item["vision"]
    assert np.all((vision.chunks.kept == vision.encode.counts()) | (left < per_item["vision"]))

    # chunks as large as the cap holds (at most a rank's share): none fits beside the backbone here
    plan = plan_step(sizes, TINY, OrchestratorConfig(encoder_memory_cap=cap, background=False), topology, mbs, num_mb)
    counts = plan.encoders["vision"].encode.counts()
    assert plan.encoders["vision"].chunks.items == min(int(cap // per_item["vision"]), counts.max())
    assert np.all((plan.encoders["vision"].chunks.kept == 0) | (plan.encoders["vision"].chunks.kept == counts))

    unbounded = plan_step(sizes, TINY, OrchestratorConfig(encoder_memory_cap=math.inf, background=False), topology,
                          mbs, num_mb)
    for p in per_item:
        counts = unbounded.encoders[p].encode.counts()
        assert unbounded.encoders[p].chunks.items == max(counts.max(), 1)
        assert np.array_equal(unbounded.encoders[p].chunks.kept, counts)


def test_chunk_tokens_make_the_chunks():
    sizes = sizes_of([3, 5, 0, 2], [1, 0, 2, 1], [80, 90, 70, 60], 2)
    # tiny: vision items run 17 tokens, audio items 32
    plan = plan_step(sizes, TINY, OrchestratorConfig(encoder_chunk_tokens=40, background=False),
                     Topology.uniform(2, 1), 1, 2)
    assert plan.encoders["vision"].chunks.items == 2
    assert plan.encoders["audio"].chunks.items == 1
    with pytest.raises(ValueError, match="OrchestratorConfig.encoder_chunk_tokens 20: an item of encoder phase audio runs 32 "
                                         "tokens; a chunk holds at least one item"):
        plan_step(sizes, TINY, OrchestratorConfig(encoder_chunk_tokens=20), Topology.uniform(2, 1), 1, 2)


def test_a_cap_below_one_item_is_refused_with_the_phase():
    vision = item_memory(TINY.encoder("vision"))
    sizes = sizes_of([1, 0], [0, 0], [30, 30], 2)
    with pytest.raises(ValueError, match=r"OrchestratorConfig.encoder_memory_cap .* GB: an item of encoder phase vision needs "):
        plan_step(sizes, TINY, OrchestratorConfig(encoder_memory_cap=vision / 2), Topology.uniform(2, 1), 1, 1)
    with pytest.raises(ValueError, match="a chunk of 5 items"):
        OrchestratorConfig(encoder_chunk_tokens=5 * 17, encoder_memory_cap=4.5 * vision).check_phases(TINY)


@pytest.mark.parametrize("flags, message", [
    (["--orch-encoder-chunk-tokens", "0"], "--orch-encoder-chunk-tokens must be an int >= 1, got 0"),
    (["--orch-encoder-memory-cap", "0"], "--orch-encoder-memory-cap must be > 0 (inf: no cap), got 0.0 GB"),
    (["--orch-encoder-memory-cap", "nan"], "--orch-encoder-memory-cap must be > 0"),
    (["--orch-encoder-chunk-tokens", "8"], "--orch-encoder-chunk-tokens 8: an item of encoder phase vision runs 17"),
    (["--orch-encoder-memory-cap", "1e-9"], "--orch-encoder-memory-cap 1e-09 GB: an item of encoder phase vision"),
])
def test_memory_flags_are_checked_when_parsed(flags, message):
    common = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "2",
              "--lr", "1e-3", "--distributed-backend", "gloo", "--orch-post-balancing"]
    with pytest.raises(arguments.ArgumentError) as raised:
        arguments.parse_args(MLLM_TASK, common + flags, world_size=1)
    assert message in str(raised.value)


def test_memory_flags_need_the_switch():
    common = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "2",
              "--lr", "1e-3", "--distributed-backend", "gloo"]
    with pytest.raises(arguments.ArgumentError, match="--orch-encoder-memory-cap given without --orch-post-balancing"):
        arguments.parse_args(MLLM_TASK, common + ["--orch-encoder-memory-cap", "10"], world_size=1)
    args = arguments.parse_args(MLLM_TASK, common + ["--orch-post-balancing", "--orch-encoder-memory-cap", "inf",
                                          "--orch-encoder-chunk-tokens", "64"], world_size=1)
    assert args.orch_config.encoder_memory_cap == math.inf and args.orch_config.encoder_chunk_tokens == 64
    assert arguments.parse_args(MLLM_TASK, common + ["--orch-post-balancing", "--orch-encoder-memory-cap", "2.5"],
                                world_size=1).orch_config.encoder_memory_cap == 2.5e9
