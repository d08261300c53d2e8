"""The packed-attention benchmark on small rows: its figures are the ones it claims to measure."""
import json
import warnings

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.bench import packed_attention  # noqa: E402


def test_benchmark_reports_mask_and_packed_rows(tmp_path):
    out = tmp_path / "packed.json"
    result = packed_attention.main(["--lengths", "1100,2200", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert [r["tokens"] for r in result["rows"]] == [1100, 2200]
    for row in result["rows"]:
        lengths, length = row["example_lengths"], row["tokens"]
        assert row["examples"] == len(lengths) >= 1 and sum(lengths) + row["padding_tail"] == length
        assert row["mask_bytes"] == row["dense_pairs"] == length * length
        assert row["packed_pairs"] == sum(n * (n + 1) // 2 for n in lengths)
        assert row["packed_kernel"] == "sdpa_per_example"  # CPU
        # the dense path keeps its T x T mask for backward; the packed row only q, k, v, output and the
        # log-sum-exp: linear in T (fp32: 4 bytes per element, at most 5 [T, heads, d] tensors)
        per_token = result["heads"] * result["head_dim"] * 4
        assert row["dense_saved_bytes"] >= length * length
        assert row["packed_saved_bytes"] <= 5 * length * per_token
        assert row["packed_largest_tensor_bytes"] <= length * per_token < length * length
        assert row["dense_largest_tensor_bytes"] >= length * length
        assert row["mask_ms"] > 0 and row["params_ms"] > 0 and row["dense_s"] > 0 and row["packed_s"] > 0
    assert result["rows"][1]["examples"] > 1
