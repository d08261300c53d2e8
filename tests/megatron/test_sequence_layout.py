"""How a rank holds a micro-batch's sequence under context and sequence parallelism
(``megatron_orch.megatron.sequence_layout``), and the CPU path of context-parallel attention
(``megatron_orch.mllm.attention.context_parallel_attention``), on 2 gloo ranks forming the CP group:

* each CP rank's shard of a padded micro-batch equals megatron-core's own ``get_batch_on_this_cp_rank`` of the
  same batch (padded to the multiple); a packed row's shard equals that helper applied sequence by sequence to
  the row padded example by example (what TE's ``thd_get_partitioned_indices`` computes, which needs a GPU:
  the device script compares with it there);
* the attention of every CP shard, keys and values all-gathered, equals the unsharded causal attention (and
  the gradients of queries, keys and values), for padded rows and packed rows, with grouped-query attention;
* placeholders land where the shard holds their column, in each rank's SP chunk, and nowhere else.
"""
import inspect

import pytest
import torch

from dist_utils import run_distributed

pytestmark = pytest.mark.distributed

CP = 2
PAD = 7


def _examples(spec, lengths, seed=0):
    from megatron_orch.megatron.batch import Example
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = torch.randint(10, 250, (n,), generator=g)
        tokens[1:3] = spec.inputs[0].placeholder_id if n > 4 else tokens[1:3]
        out.append(Example(sample_index=i, tokens=tokens, labels=torch.randint(10, 250, (n,), generator=g),
                           loss_mask=(torch.rand(n, generator=g) > 0.3).float()))
    return out


def _spec():
    from megatron_orch.megatron.batch import BatchSpec, EncoderInput
    from megatron_orch.balance.cost import FunctionCost
    from megatron_orch.balance.workload import BackbonePhase, EncoderPhase, ModelPhases
    cost = FunctionCost(lambda s: s)
    phases = ModelPhases((EncoderPhase("vision", cost, item_tokens=1, input_bytes=4, output_rows=1,
                                       output_row_bytes=4),), BackbonePhase("llm", cost, token_bytes=20))
    return BatchSpec(phases, (EncoderInput("vision", (1,), placeholder_id=3),), pad_token_id=PAD, seq_length=64)


def _megatron_cp_shard(batch: dict, group) -> dict:
    """megatron-core's own helper, whichever signature the installed release has."""
    from megatron.core.utils import get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=group)
    return get_batch_on_this_cp_rank(dict(batch), cp_group=group)


def _shards_and_attention(rank, world_size):
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_orch.megatron.batch import collate, collate_packed
    from megatron_orch.megatron.sequence_layout import SequenceLayout
    from megatron_orch.mllm.attention import context_parallel_attention
    from megatron_orch.trainer import cpu_harness

    cpu_harness.install()
    group = dist.group.WORLD
    spec, layout = _spec(), SequenceLayout(CP, rank)
    keys = ("tokens", "labels", "loss_mask", "position_ids")

    # padded rows: megatron-core's zig-zag of the batch padded to 2 x CP
    padded = collate(_examples(spec, [13, 9, 5]), spec)
    shard = layout.shard(padded, PAD)
    whole = layout.padded_rows(padded, PAD)
    assert whole.tokens.shape[1] == 16
    want = _megatron_cp_shard({k: getattr(whole, k) for k in keys}, group)
    for k in keys:
        torch.testing.assert_close(getattr(shard, k), want[k], msg=k)

    # packed row: each example padded to 2 x CP inside its sequence, the tail one more sequence; megatron-core's
    # helper on every sequence
    lengths = [5, 8, 3]
    packed = collate_packed(_examples(spec, lengths, seed=1), spec, pad_to=20)
    shard = layout.shard(packed, PAD)
    params = shard.packed_seq_params
    assert params.host_cu_seqlens == (0, 8, 16, 20, 24) and params.cu_seqlens_q_padded is not None
    pieces = []
    for (start, end), n, first in zip([(0, 8), (8, 16), (16, 20), (20, 24)], lengths + [4], [0, 5, 13, 16]):
        sequence = {}
        for k in keys:
            fill = PAD if k in ("tokens", "labels") else 0
            part = torch.full((1, end - start), fill, dtype=getattr(packed, k).dtype)
            part[0, :n] = getattr(packed, k)[0, first:first + n]
            sequence[k] = part
        pieces.append(_megatron_cp_shard(sequence, group))
    for k in keys:
        torch.testing.assert_close(getattr(shard, k), torch.cat([p[k] for p in pieces], dim=1), msg=k)

    # placeholders: each lands on the one rank and SP chunk that holds its column
    cols = padded.placeholders["vision"][1]
    for sp in (1, 2):
        held_here = 0
        for chunk in range(sp):
            part = SequenceLayout(CP, rank, sp, chunk).shard(padded, PAD)
            slots, rows = part.placeholders["vision"]
            held = slots < part.chunk_length
            local = chunk * part.chunk_length + slots[held]
            assert (part.tokens[rows[held], local] == spec.inputs[0].placeholder_id).all()
            held_here += int(held.sum())
        total = torch.tensor([held_here])
        dist.all_reduce(total)
        assert int(total) == cols.numel() > 0, (sp, int(total), cols.numel())

    # attention: every shard against the unsharded causal attention, values and gradients (GQA: 4 heads, 2 groups)
    g = torch.Generator().manual_seed(3)
    for packed_row in (False, True):
        length, batch = (16, 2) if not packed_row else (24, 1)
        q = torch.randn(length, batch, 4, 8, generator=g)
        k, v = (torch.randn(length, batch, 2, 8, generator=g) for _ in range(2))
        weight = torch.randn(length, batch, 4, 8, generator=g)
        sequences = ((0, 16),) if not packed_row else ((0, 8), (8, 16), (16, 20), (20, 24))
        reference = []
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        for start, end in sequences:
            fq, fk, fv = (t[start:end].permute(1, 2, 0, 3) for t in full)
            reference.append(F.scaled_dot_product_attention(fq, fk, fv, is_causal=True, scale=0.3, enable_gqa=True)
                             .permute(2, 0, 1, 3))
        reference = torch.cat(reference)
        (reference * weight).sum().backward()
        mine = torch.from_numpy(layout.local_positions(sequences))
        local = [t[mine].clone().requires_grad_() for t in (q, k, v)]
        params = None
        if packed_row:
            from megatron_orch.megatron.batch import PackedRowParams
            bounds = tuple(b for s in sequences for b in s[:1]) + (sequences[-1][1],)
            params = PackedRowParams(qkv_format="thd", host_cu_seqlens=bounds)
            local = [t[:, 0].detach().clone().requires_grad_() for t in local]
        out = context_parallel_attention(*local, group, params, scale=0.3)
        expected = reference[mine] if not packed_row else reference[mine][:, 0]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
        (out * (weight[mine] if not packed_row else weight[mine][:, 0])).sum().backward()
        for name, got, want in zip("qkv", local, full):
            grad = want.grad[mine] if not packed_row else want.grad[mine][:, 0]
            torch.testing.assert_close(got.grad, grad, rtol=1e-5, atol=1e-6, msg=f"{name} gradient")


def test_shards_are_megatron_cores_and_context_parallel_attention_is_exact():
    run_distributed(_shards_and_attention, CP, timeout_s=120)
