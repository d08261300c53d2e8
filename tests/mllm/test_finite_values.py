"""The manifest loader's finite check (mllm/manifest.py) as a plain function: every floating dtype, float16
included, and every row of a large array, across the edges of the blocks it converts at a time."""
import numpy as np
import pytest

from megatron_orch.mllm import manifest
from megatron_orch.mllm.manifest import ManifestError


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_of_any_floating_dtype_is_refused(dtype, bad):
    pixels = np.zeros((4, 5, 3), dtype=dtype)
    pixels[2, 1, 0] = bad
    with pytest.raises(ManifestError, match=r"image x\.npy holds -?(nan|inf) at index \[2, 1, 0\]"):
        manifest._check_finite(pixels, "line 3: image x.npy", "pixel values")
    manifest._check_finite(np.zeros((4, 5, 3), dtype=dtype), "line 3: image x.npy", "pixel values")


@pytest.mark.parametrize("rows,row", [(701, r) for r in (0, 254, 255, 256, 257, 511, 512, 700)]
                         + [(1, 0), (256, 255), (257, 256), (512, 511)])
def test_every_row_is_checked_across_the_block_edges(rows, row):
    assert manifest._FINITE_CHECK_ROWS == 256  # the edges above are this block size's
    mel = np.zeros((rows, 8), dtype=np.float32)
    manifest._check_finite(mel, "line 1: audio a.npy", "log-mel frames")
    mel[row, 7] = np.nan
    with pytest.raises(ManifestError, match=rf"audio a\.npy holds nan at index \[{row}, 7\]"):
        manifest._check_finite(mel, "line 1: audio a.npy", "log-mel frames")


def test_a_float64_beyond_float32s_range_is_refused_and_integers_pass():
    mel = np.zeros((3, 2), dtype=np.float64)
    mel[1, 1] = 1e300
    with pytest.raises(ManifestError, match=r"holds 1e\+300 \(float64, beyond float32's range\) at index \[1, 1\]"):
        manifest._check_finite(mel, "line 1: audio a.npy", "log-mel frames")
    manifest._check_finite(np.full((3, 2), 255, dtype=np.uint8), "line 1: image b.npy", "pixel values")
