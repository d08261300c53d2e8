"""Encoder chunks with recompute, on one process: a toy encoder that draws dropout masks from the CPU
generator and from Megatron's RNG tracker gives, kept or recomputed (all chunks or some), the same
outputs, the same parameter gradients and the same RNG states after the step; without the replay it
does not (the test can fail)."""
import pytest
import torch
import torch.nn.functional as F

from megatron_orch.trainer import cpu_harness

cpu_harness.install()

from megatron.core import tensor_parallel  # noqa: E402

from megatron_orch.megatron import encoder_chunks  # noqa: E402
from megatron_orch.megatron.encoder_chunks import backward_chunk, chunk_bounds, encode_in_chunks  # noqa: E402


class ToyEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.inner = torch.nn.Parameter(torch.randn(8, 16, generator=g))
        self.outer = torch.nn.Parameter(torch.randn(16, 4, generator=g))

    def forward(self, items):
        x = F.dropout(torch.tanh(items @ self.inner), p=0.3)  # the CPU generator
        with tensor_parallel.get_cuda_rng_tracker().fork():  # a model-parallel stream
            x = F.dropout(x, p=0.3)
        return (x @ self.outer).reshape(-1, 2)  # two output rows per item


def _rng_after():
    return torch.get_rng_state(), dict(tensor_parallel.get_cuda_rng_tracker().get_states())


def run(kept_items, chunk_items=2, n=7):
    """Outputs, parameter gradients and the RNG states after a step of ``n`` items."""
    torch.manual_seed(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    encoder = ToyEncoder()
    items = torch.randn(n, 8, generator=torch.Generator().manual_seed(2))
    outputs, chunks = encode_in_chunks(encoder, items, chunk_bounds(n, chunk_items, kept_items), grad=True)
    torch.rand(3)  # the backbone draws from the streams meanwhile
    with tensor_parallel.get_cuda_rng_tracker().fork():
        torch.rand(3)
    grad = torch.randn(outputs.shape, generator=torch.Generator().manual_seed(3))
    for chunk in reversed(chunks):
        backward_chunk(encoder, items, chunk, grad[2 * chunk.start:2 * chunk.stop])
    return outputs, {name: p.grad.clone() for name, p in encoder.named_parameters()}, _rng_after()


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=1e-6, atol=1e-7)
    assert torch.equal(a[2][0], b[2][0])
    assert a[2][1].keys() == b[2][1].keys() and all(torch.equal(a[2][1][k], b[2][1][k]) for k in a[2][1])


@pytest.mark.parametrize("kept_items", [0, 2, 4])
def test_recompute_replays_every_rng_state(world_of_one, kept_items):
    assert_same(run(kept_items), run(kept_items=7))


def test_without_the_replay_gradients_differ(world_of_one, monkeypatch):
    kept = run(kept_items=7)
    monkeypatch.setattr(encoder_chunks.RngStates, "restore", lambda self: None)
    replay_off = run(kept_items=0)
    torch.testing.assert_close(replay_off[0], kept[0], rtol=0, atol=0)  # the forward is the same
    assert any(not torch.allclose(replay_off[1][name], kept[1][name]) for name in kept[1])


def test_no_items_and_no_grad():
    encoder = ToyEncoder()
    outputs, chunks = encode_in_chunks(encoder, torch.zeros(0, 8), chunk_bounds(0, 2, 0), grad=True)
    assert outputs.shape == (0, 2) and chunks == []
    outputs, chunks = encode_in_chunks(encoder, torch.randn(5, 8), chunk_bounds(5, 2, 5), grad=False)
    assert outputs.shape == (10, 2) and not outputs.requires_grad
    assert [(c.start, c.stop, c.kept) for c in chunks] == [(0, 2, False), (2, 4, False), (4, 5, False)]


def test_the_planned_number_of_items_keeps_its_activations():
    """The chunks whose items all fall within ``kept_items`` keep their graphs, the others do not (a plan
    that keeps 4 items of chunks of 2 keeps two chunks; keeping all 7 keeps the last, short chunk too)."""
    encoder = ToyEncoder()
    items = torch.randn(7, 8)
    for kept_items, kept in ((0, [False] * 4), (3, [True, False, False, False]), (4, [True, True, False, False]),
                             (7, [True] * 4)):
        outputs, chunks = encode_in_chunks(encoder, items, chunk_bounds(7, 2, kept_items), grad=True)
        assert [(c.start, c.stop) for c in chunks] == [(0, 2), (2, 4), (4, 6), (6, 7)]
        assert [c.kept for c in chunks] == kept, kept_items
        assert all(c.outputs.requires_grad for c in chunks if c.kept)


def test_rng_states_of_a_cuda_chunk_replay_its_devices_generator(world_of_one, monkeypatch):
    """A chunk on a CUDA device draws from that device's generator: capture and restore it (faked here by
    CPU generators behind torch.cuda's get/set_rng_state, one per device; the other device is left alone)."""
    generators = {0: torch.Generator().manual_seed(10), 1: torch.Generator().manual_seed(11)}

    def index(device):
        return torch.device(device).index

    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": generators[index(device)].get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": generators[index(device)].set_state(state))
    states = encoder_chunks.RngStates.capture(torch.device("cuda", 1))
    first_draw = torch.rand(4, generator=generators[1])
    other_device = torch.rand(4, generator=generators[0])
    states.restore()
    assert torch.equal(torch.rand(4, generator=generators[1]), first_draw)  # replayed
    assert not torch.equal(torch.rand(4, generator=generators[0]), other_device)  # not touched


def test_sharded_ranks_run_the_same_chunks_and_keep_one_only_where_every_rank_with_it_does():
    """aligned_chunks (every rank runs the same chunks under sharded parameters): a chunk is kept only if every
    rank holding real items in it keeps them (a rank recomputing it frees its activations; one keeping it
    would hold what the plan's memory cap did not allow), and a rank past its items pads with one-item chunks."""
    from megatron_orch.megatron.sharding import aligned_chunks

    counts, kept = [4, 6, 2], [4, 2, 2]  # chunks of 2: rank 0 keeps both, rank 1 its first, rank 2 its only one
    bounds = [aligned_chunks(counts, 2, kept, rank) for rank in range(3)]
    assert [len(b) for b in bounds] == [3, 3, 3]
    assert [[c.keep for c in b] for b in bounds] == [[True, False, False]] * 3
    assert [(c.start, c.stop) for c in bounds[0]] == [(0, 2), (2, 4), (4, 5)]   # a padding item past its 4
    assert [(c.start, c.stop) for c in bounds[1]] == [(0, 2), (2, 4), (4, 6)]
    assert [(c.start, c.stop) for c in bounds[2]] == [(0, 2), (2, 3), (3, 4)]
    every = [aligned_chunks([4, 4], 2, [4, 4], rank) for rank in range(2)]
    assert [[c.keep for c in b] for b in every] == [[True, True]] * 2


def test_a_sharded_encode_that_fails_leaves_the_roots_forward_its_own():
    """sharded_encode makes the wrapper's root module run ``encode`` for one call: after a call that raises (an
    encoder's error, a check's refusal), the root's forward is its own again, not the failed phase's encode."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    from megatron_orch.megatron.sharding import sharded_encode

    root = torch.nn.Linear(8, 2)
    wrapper = TorchFullyShardedDataParallel.__new__(TorchFullyShardedDataParallel)  # the class, not its set-up
    torch.nn.Module.__init__(wrapper)
    wrapper.module = root
    items = torch.randn(3, 8)
    torch.testing.assert_close(sharded_encode(wrapper, lambda x: 2 * x)(items), 2 * items)

    def failing(items):
        raise ValueError("an encoder's error")

    with pytest.raises(ValueError, match="an encoder's error"):
        sharded_encode(wrapper, failing)(items)
    assert "forward" not in vars(root)
    torch.testing.assert_close(root(items), items @ root.weight.T + root.bias)


def test_sharding_of_names_megatron_fsdp_by_its_wrapper_classes():
    """Megatron-FSDP's wrapper is the class ``FullyShardedDataParallel`` up to megatron-core 0.19.x; on Megatron-LM
    main that name is a factory of the classes ``FullyShardedDataParallelV1`` / ``V2`` (an isinstance check against
    it would raise TypeError). Either way a chunk inside a wrapper class is Megatron-FSDP's; Megatron DDP none."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    from megatron_orch.megatron.sharding import MEGATRON_FSDP, MEGATRON_FSDP_WRAPPERS, sharding_of

    named = mcore_fsdp_adapter.FullyShardedDataParallel
    expected = [named] if isinstance(named, type) else [mcore_fsdp_adapter.FullyShardedDataParallelV1,
                                                        mcore_fsdp_adapter.FullyShardedDataParallelV2]
    assert list(MEGATRON_FSDP_WRAPPERS) == expected
    for cls in (*MEGATRON_FSDP_WRAPPERS, DistributedDataParallel):
        wrapper = cls.__new__(cls)  # the class, not its set-up
        torch.nn.Module.__init__(wrapper)
        wrapper.module = torch.nn.Linear(2, 2)
        assert sharding_of(wrapper) == (None if cls is DistributedDataParallel else MEGATRON_FSDP)
