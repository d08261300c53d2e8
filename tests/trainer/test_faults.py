"""A failure on one rank ends the run on every rank, and the error says which rank and what.

* A rank stuck (sleeping) in its vision encoder's forward: the other rank waits in the post-balancing
  all-to-all over the DP group, whose timeout must be ``--distributed-timeout-minutes`` (megatron-core's
  groups default to 30 minutes), and the error must name the stuck rank and the collective.
* A loader error on one rank (a manifest line whose image cannot be read), with post-balancing off and
  on, a manifest that fails while the data iterator is built, a model that fails to build: every rank
  raises, and every rank's error carries the failing rank's message (with the manifest line and path).
"""
import dataclasses
import inspect
import re
import time
import warnings
from pathlib import Path

import pytest

from dist_utils import run_distributed, scaled
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

TIMEOUT_MINUTES = scaled(5.0) / 60  # 15 s at the default factor 3: a loaded machine needs longer collectives
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
          "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1", "--seed", "3", "--distributed-backend", "gloo",
          "--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
BALANCED = ["--orch-post-balancing", "--orch-gpus-per-node", "2"]
LOADER_ERROR = "data/train.jsonl line 7: cannot read image data/images/0007.png: truncated PNG"
BUILD_ERROR = "out of memory while building the vision encoder (simulated)"


def _in_the_balanced_schedule() -> bool:
    """Whether this call comes from the modality-aware schedule's own encoder phase (not a checked step's)."""
    files = [frame.filename for frame in inspect.stack()]
    return (any(f.endswith("megatron_orch/megatron/schedule.py") for f in files)
            and not any(f.endswith("megatron_orch/megatron/first_step.py") for f in files))


def _stuck_in_encoder(rank, world_size, out_dir):
    """Rank 1 sleeps in the balanced schedule's vision-encoder forward of iteration 2 (the checked steps encode
    items of their own first) far longer than the timeout."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments, loop as trainer

    steps = []
    if rank == 1:
        train_step = trainer.train_step

        def counted(*args, **kwargs):
            steps.append(None)
            return train_step(*args, **kwargs)

        trainer.train_step = counted

    def model_provider(args, pre_process, post_process):
        model = providers.build_model(args, pre_process, post_process)
        if rank == 1:
            encode = model.encode

            def stuck_in_iteration_two(phase, items):
                if phase == "vision" and len(steps) == 2 and _in_the_balanced_schedule():
                    (Path(out_dir) / "stuck_since").write_text(repr(time.time()))
                    time.sleep(600)
                return encode(phase, items)

            model.encode = stuck_in_iteration_two
        return model

    args = arguments.parse_args(MLLM_TASK, COMMON + BALANCED, world_size=world_size)
    try:
        task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
        trainer.pretrain(args, task, print_fn=lambda line: None)
    except Exception:
        (Path(out_dir) / f"raised_rank{rank}").write_text(repr(time.time()))
        raise
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.distributed
def test_rank_stuck_in_an_encoder_is_named_within_twice_the_timeout(tmp_path):
    """The healthy rank raises within 2x the timeout of the stuck rank's sleep; the run then ends (the
    launcher kills the sleeper once a rank failed), process teardown adding a few seconds."""
    timeout_s = TIMEOUT_MINUTES * 60
    with pytest.raises(RuntimeError) as failure:  # old code: run_distributed's TimeoutError (DP group: 30 min)
        run_distributed(_stuck_in_encoder, 2, str(tmp_path), timeout_s=2 * timeout_s + 120)
    ended = time.time()
    stuck_since = float((tmp_path / "stuck_since").read_text())
    raised = float((tmp_path / "raised_rank0").read_text())
    assert raised - stuck_since <= 2 * timeout_s, (raised - stuck_since, ended - stuck_since)
    assert not (tmp_path / "raised_rank1").exists()  # the sleeper was still asleep: it was rank 0 that reported
    report = str(failure.value)
    assert "CollectiveFailureError: iteration 2: a collective failed on rank 0" in report, report[-3000:]
    assert re.search(r"rank\(s\) 1 did not reach a collective", report), report[-3000:]
    # The collective rank 0 waited in: the encoder outputs' asynchronous all-to-all of the modality-aware
    # schedule, whose error surfaces where the schedule waits for it.
    assert re.search(r"ranks 0 in the wait for an asynchronous collective at megatron_orch/comm/alltoall\.py:\d+ "
                     r"called from megatron_orch/megatron/schedule\.py:\d+ <lambda> <- "
                     r"megatron_orch/megatron/schedule\.py:\d+ _run <- "
                     r"megatron_orch/megatron/schedule\.py:\d+ __call__", report), report[-3000:]


CASES = {"no post-balancing, step 2": [], "post-balancing, step 2": BALANCED, "building the iterator": [],
         "building the model": []}


def _loader_errors(rank, world_size, out_dir):
    """Each case trains in the same processes; rank 1's loader raises; every rank writes what it raised."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.mllm import providers
    from megatron_orch.mllm.manifest import ManifestError
    from megatron_orch.trainer import arguments, loop as trainer

    build = providers.build_train_data_iterator
    for index, (case, flags) in enumerate(CASES.items()):
        def failing_loader(args, consumed_samples, dp_rank, dp_size, case=case):
            if dp_rank == 1 and case == "building the iterator":
                raise ManifestError(LOADER_ERROR)
            batches = build(args, consumed_samples, dp_rank, dp_size)

            def read():  # one micro-batch per step: the second is step 2's
                for step, batch in enumerate(batches):
                    if dp_rank == 1 and step == 1:
                        raise ManifestError(LOADER_ERROR)
                    yield batch
            return read()

        def model_provider(args, pre_process, post_process, case=case):
            if rank == 1 and case == "building the model":
                raise MemoryError(BUILD_ERROR)
            return providers.build_model(args, pre_process, post_process)

        providers.build_train_data_iterator = failing_loader
        args = arguments.parse_args(MLLM_TASK, COMMON + flags, world_size=world_size)
        try:
            task = dataclasses.replace(MLLM_TASK, build_model=model_provider)
            trainer.pretrain(args, task, print_fn=lambda line: None)
            outcome = "no error"
        except Exception as err:  # noqa: BLE001 -- what each rank raised is the result
            outcome = f"{type(err).__name__}: {err}"
        finally:
            parallel_state.destroy_model_parallel()
        (Path(out_dir) / f"case{index}_rank{rank}.txt").write_text(outcome)


@pytest.mark.distributed
def test_one_ranks_loader_or_build_error_raises_on_every_rank_with_its_message(tmp_path):
    run_distributed(_loader_errors, 2, str(tmp_path), timeout_s=240.0)
    for index, case in enumerate(CASES):
        failing = (tmp_path / f"case{index}_rank1.txt").read_text()
        other = (tmp_path / f"case{index}_rank0.txt").read_text()
        expected = f"MemoryError: {BUILD_ERROR}" if case == "building the model" else f"ManifestError: {LOADER_ERROR}"
        assert failing == expected, (case, failing)
        assert other.startswith("PeerFailedError: "), (case, other)
        assert f"failed on rank(s) [1]: rank 1: {expected}" in other, (case, other)


def test_lost_collectives_are_told_from_reports_of_them():
    from megatron_orch.comm.status import PeerFailedError
    from megatron_orch.trainer.faults import CollectiveFailureError, lost_collective

    assert lost_collective(RuntimeError("[gloo/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation"))
    assert lost_collective(RuntimeError("[gloo/pair.cc:534] Connection closed by peer [127.0.0.1]:4711"))
    assert not lost_collective(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not lost_collective(PeerFailedError("reading the step's input", {1: "RuntimeError: Timed out"}))
    assert not lost_collective(CollectiveFailureError("iteration 2: ... Timed out ..."))
