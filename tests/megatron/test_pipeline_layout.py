"""megatron-core's interleaved schedule's conditions on a step's micro-batches (megatron/pipeline_layout.py),
as a plain function: the group of consecutive micro-batches per virtual stage lies in [PP, M], bounds
included, and the last group is empty or at least PP (``forward_backward_pipelining_with_interleaving``)."""
import pytest

from megatron_orch.megatron.pipeline_layout import check_interleaved_microbatches

# (micro-batches, pipeline size, group size or None for the default, PP)
ACCEPTED = [(4, 2, None), (6, 2, None), (2, 2, None), (6, 2, 3), (3, 2, 3), (5, 2, 3), (8, 2, 4), (4, 4, 4),
            (7, 3, 4)]
TOO_SMALL_OR_LARGE = [(1, 2, None), (6, 2, 1), (2, 2, 3), (3, 4, None)]
SHORT_LAST_GROUP = [(5, 2, None), (4, 2, 3), (7, 2, 3), (9, 4, 4)]


@pytest.mark.parametrize("microbatches,pipeline,group", ACCEPTED)
def test_accepted(microbatches, pipeline, group):
    check_interleaved_microbatches(microbatches, pipeline, group)


@pytest.mark.parametrize("microbatches,pipeline,group", TOO_SMALL_OR_LARGE)
def test_a_group_outside_pp_to_m_is_refused(microbatches, pipeline, group):
    with pytest.raises(ValueError, match=rf"runs {group or pipeline} consecutive micro-batches per virtual stage, "
                                         rf"which must lie in \[--pipeline-model-parallel-size {pipeline}, "
                                         rf"{microbatches}\]"):
        check_interleaved_microbatches(microbatches, pipeline, group)


@pytest.mark.parametrize("microbatches,pipeline,group", SHORT_LAST_GROUP)
def test_a_last_group_shorter_than_pp_is_refused(microbatches, pipeline, group):
    with pytest.raises(ValueError, match=rf"last group of {microbatches % (group or pipeline)} micro-batches is "
                                         rf"shorter than --pipeline-model-parallel-size {pipeline}"):
        check_interleaved_microbatches(microbatches, pipeline, group)
