"""On a GPU: the SDPA core attention runs on the fused kernels it is meant to, in bf16 at mllm_10b widths.

Each case forces one kernel with ``torch.nn.attention.sdpa_kernel``: if torch cannot use that kernel
for the call, it raises instead of falling back to the math kernel (which materialises the scores).
Cases: backbone causal rows (flash), encoder bidirectional items (flash), a 16k-token causal row, and
packed rows (no mask: ``cu_seqlens``): ``varlen_attn`` without dropout (its result checked against SDPA
example by example) and, with attention dropout, flash example by example. Exits non-zero on any failure.

    python scripts/check_sdpa_kernels.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_orch.mllm import attention  # noqa: E402
from megatron_orch.mllm.attention import SDPAttention  # noqa: E402
from megatron_orch.megatron.batch import Example, collate_packed  # noqa: E402
from megatron_orch.mllm.config import PAD_TOKEN_ID, load_model_config  # noqa: E402
from megatron_orch.mllm.examples import batch_spec  # noqa: E402


def _attention(heads: int, groups: int, head_dim: int, mask_type: AttnMaskType,
               attention_dropout: float = 0.0) -> SDPAttention:
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, bf16=True,
                               params_dtype=torch.bfloat16, attention_dropout=attention_dropout)
    return SDPAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self").eval()


def _packed_params(lengths, device):
    examples = [Example(sample_index=i, tokens=torch.full((n,), PAD_TOKEN_ID), labels=torch.full((n,), PAD_TOKEN_ID),
                        loss_mask=torch.ones(n)) for i, n in enumerate(lengths)]
    batch = collate_packed(examples, batch_spec(load_model_config("tiny"), max(lengths)))
    return batch.pin_memory().to(device).packed_seq_params()


def _run_packed(name: str, module: SDPAttention, lengths, groups: int) -> bool:
    """A packed row forward + backward: without dropout on varlen_attn (checked against SDPA example by
    example, bf16 within 2e-2), with dropout (training) on flash example by example."""
    heads, head_dim = module.config.num_attention_heads, module.config.kv_channels
    params, total = _packed_params(lengths, "cuda"), sum(lengths)
    q = torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(total, groups, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dropout = module.attention_dropout
    kernel = "varlen_attn" if attention.uses_varlen_kernel(q, dropout) else "sdpa per example"
    try:
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if dropout:
            module.train()
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                module(q, k, v, None, packed_seq_params=params).float().sum().backward()
        else:
            out = module(q, k, v, None, packed_seq_params=params)
            out.float().sum().backward()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if not dropout:
            uses = attention.uses_varlen_kernel
            attention.uses_varlen_kernel = lambda query, p: False
            try:
                per_example = module(q, k, v, None, packed_seq_params=params)
            finally:
                attention.uses_varlen_kernel = uses
            error = float((out.float() - per_example.float()).norm() / per_example.float().norm())
            if kernel != "varlen_attn" or error > 2e-2:
                print(f"[sdpa] FAIL  {name}: {kernel}, relative difference to SDPA per example {error:.2e}")
                return False
        print(f"[sdpa] ok    {name}: {kernel}, fwd+bwd {1e3 * elapsed:.1f} ms (first call), "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        return True
    except RuntimeError as err:
        print(f"[sdpa] FAIL  {name}: {kernel} could not run: {str(err).splitlines()[0]}")
        return False


def _run(name: str, backend: SDPBackend, module: SDPAttention, seq: int, batch: int, groups: int,
         mask=None) -> bool:
    heads, head_dim = module.config.num_attention_heads, module.config.kv_channels
    q = torch.randn(seq, batch, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(seq, batch, groups, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    try:
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with sdpa_kernel(backend):
            module(q, k, v, mask).float().sum().backward()
        torch.cuda.synchronize()
        print(f"[sdpa] ok    {name}: {backend.name}, fwd+bwd {1e3 * (time.perf_counter() - start):.1f} ms "
              f"(first call), peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
        return True
    except RuntimeError as err:
        print(f"[sdpa] FAIL  {name}: {backend.name} could not run: {str(err).splitlines()[0]}")
        return False


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("check_sdpa_kernels.py needs a GPU")
    causal, bidirectional = AttnMaskType.causal, AttnMaskType.no_mask
    backbone = _attention(28, 4, 128, causal)  # Qwen2.5-7B widths
    results = [
        _run("backbone 4096 causal, GQA 28/4", SDPBackend.FLASH_ATTENTION, backbone, 4096, 2, 4),
        _run("backbone 16384 causal, GQA 28/4", SDPBackend.FLASH_ATTENTION, backbone, 16384, 1, 4),
        _run("ViT 64 tiles x 1025 bidirectional", SDPBackend.FLASH_ATTENTION,
             _attention(16, 16, 64, bidirectional), 1025, 64, 16),
        _run("audio 32 windows x 1500 bidirectional", SDPBackend.FLASH_ATTENTION,
             _attention(20, 20, 64, bidirectional), 1500, 32, 20),
        _run_packed("packed row 4096 (7 examples), GQA 28/4", backbone, [900, 700, 600, 500, 600, 396, 400], 4),
        _run_packed("packed row 16384 (11 examples), GQA 28/4", backbone, [4172, 787, 1384, 1350, 4131, 784, 823,
                                                                            795, 1020, 853, 285], 4),
        _run_packed("packed row 4096, attention dropout 0.1", _attention(28, 4, 128, causal, 0.1),
                    [900, 700, 600, 500, 600, 396, 400], 4),
    ]
    print(f"[sdpa] {sum(results)}/{len(results)} cases on their fused kernel")
    if not all(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
