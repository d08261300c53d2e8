"""Quiet by default: what the entry points silence of the libraries' notes (``quiet_megatron_core_warnings``) and
what they avoid causing (``check_data``'s Energon loader processes). A whole CPU run's output is checked in
``tests/trainer/test_train.py`` (the torchrun entry point)."""
import logging
import warnings

from megatron_orch import quiet_megatron_core_warnings


def test_torchs_no_cuda_runtime_note_is_dropped_and_nothing_else(caplog):
    quiet_megatron_core_warnings()
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        logger.warning("Error checking compiler version for %s", "c++")
    assert [record.getMessage() for record in caplog.records] == ["Error checking compiler version for c++"]


def test_check_datas_default_energon_workers_draw_no_dataloader_warning():
    """torch's DataLoader warns when asked for more workers than it suggests; the default is its suggestion
    (the loader is built, no worker process started)."""
    import torch.utils.data

    from megatron_orch.mllm.check_data import default_workers
    for extra, warned in ((0, False), (1, True)):  # one worker more draws the warning: the check can fail
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.utils.data.DataLoader(range(4), num_workers=default_workers(energon=True) + extra)
        assert bool(caught) == warned, [str(w.message) for w in caught]
