"""What one rank of a compact-trainer run returned or raised, for tests that run many launches in turn."""
from __future__ import annotations

from megatron_orch.mllm.task import MLLM_TASK


def pretrain_outcome(argv, world_size: int, **figures: str) -> dict:
    """Run ``pretrain`` with ``argv`` on this (spawned) rank; returns its log ``lines`` and either
    ``error`` (``"Type: message"``) or, per keyword, ``{iteration: getattr(record, attribute)}`` of the
    logged iterations (e.g. ``loss="lm_loss"``)."""
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, loop as trainer

    lines = []
    try:
        args = arguments.parse_args(MLLM_TASK, argv, world_size=world_size)
        records = trainer.pretrain(args, MLLM_TASK, print_fn=lines.append)
        outcome = {key: {r.iteration: getattr(r, attribute) for r in records} for key, attribute in figures.items()}
    except Exception as err:  # noqa: BLE001 -- what each rank raised is the result
        outcome = {"error": f"{type(err).__name__}: {err}"}
    finally:
        parallel_state.destroy_model_parallel()
    return {**outcome, "lines": lines}
