"""On a GPU: the SDPA core attention runs on the fused kernels it is meant to, in bf16 at mllm_10b widths.

Each case forces one kernel with ``torch.nn.attention.sdpa_kernel``: if torch cannot use that kernel
for the call, it raises instead of falling back to the math kernel (which materialises the scores).
Cases: backbone causal rows (flash), encoder bidirectional items (flash), packed rows with their
block-diagonal mask (memory-efficient), a 16k-token causal row. Exits non-zero on any failure.

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

from megatron_orch.mllm.attention import SDPAttention  # noqa: E402
from megatron_orch.megatron.batch import Example, collate_packed  # noqa: E402
from megatron_orch.mllm.config import PAD_TOKEN_ID, load_model_config  # noqa: E402
from megatron_orch.mllm.examples import batch_spec  # noqa: E402


def _attention(heads: int, groups: int, head_dim: int, mask_type: AttnMaskType) -> SDPAttention:
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=head_dim, bf16=True,
                               params_dtype=torch.bfloat16)
    return SDPAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self").eval()


def _packed_mask(lengths, device) -> torch.Tensor:
    examples = [Example(sample_index=i, tokens=torch.full((n,), PAD_TOKEN_ID), labels=torch.full((n,), PAD_TOKEN_ID),
                        loss_mask=torch.ones(n)) for i, n in enumerate(lengths)]
    return collate_packed(examples, batch_spec(load_model_config("tiny"))).attention_mask().to(device)


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
        _run("packed row 4096 (7 examples), GQA 28/4", SDPBackend.EFFICIENT_ATTENTION, backbone, 4096, 1, 4,
             _packed_mask([900, 700, 600, 500, 600, 396, 400], "cuda")),
    ]
    print(f"[sdpa] {sum(results)}/{len(results)} cases on their fused kernel")
    if not all(results):
        sys.exit(1)


if __name__ == "__main__":
    main()
