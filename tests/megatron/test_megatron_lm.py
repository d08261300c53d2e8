"""Megatron-LM integration: the patches of ``patches/<release>``, ``scripts/apply_patches.sh``, the run-time
schedule hook, and ``pretrain_mllm.py``'s ``megatron.training`` path with post-balancing off and on.

The release under test is the installed megatron-core's (:func:`megatron_lm_doubles.megatron_lm_files_or_skip`):
0.19.2's wheel ships its ``megatron/training`` (the ``pretrain(cfg_container, ...)`` API), and for 0.16.1 the
tag's files come from ``../shared/megatron-lm`` (the ``extra_args_provider`` API); CI runs both set-ups. With a
Megatron-LM main checkout first on ``PYTHONPATH`` (its ``megatron/``: core and training) the tests run on main:
the patch tests skip, saying why (main has no patch by design), and the training runs go through the run-time
hook.
The training runs go through Megatron-LM's own ``megatron.training.pretrain`` (from a patched copy of those
files, or the unpatched ones with the run-time hook, on CPU over gloo with the test doubles of
``megatron_lm_doubles``): DP 2, PP 2 x DP 2, TP 2 x DP 2, TP 2 + SP x DP 2 and CP 2 x DP 2, post-balancing off
(upstream) then on in the same spawned ranks, fp32, SGD and dropout 0, and the losses of every iteration and
every rank's parameters after the run must agree within 1e-5; PP 2 x VPP 2 x DP 2 (virtual pipeline stages)
too, on scripted steps, also with ``--overlap-grad-reduce``. DP 2 also runs post-balancing with
``--overlap-grad-reduce``, including a step where a rank gets no items of an encoder phase, and the project's
compact trainer on the same flags, which must reproduce megatron.training's losses.
"""
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import megatron_lm_doubles as doubles
from dist_utils import TRAINED_PARAMS_ATOL, run_distributed, scaled
from megatron_orch.mllm.task import MLLM_TASK

REPO = Path(__file__).resolve().parents[2]
APPLY = REPO / "scripts" / "apply_patches.sh"
RELEASES = sorted(path.name for path in (REPO / "patches").glob("core_v*"))
SEED = 11
ITERS = 3
TOLERANCE = 1e-5
# Megatron-LM flags: docs/integration.md's launch line ("Using it with Megatron-LM"), read from it so that what it
# prints is what the tests train with; only the batch, the length and the seed change, and gloo trains on
# CPU. Dropout 0 and no evaluation, as there; the rerun state machine keeps Megatron's default mode.
README_FLAGS = re.search(r'^FLAGS="(.*?)"$', (REPO / "docs" / "integration.md").read_text(),
                         re.M | re.S).group(1).replace("\\\n", " ").split()
CHANGED = {"--global-batch-size": "4", "--train-iters": str(ITERS)}
# SGD: the runs' parameters are compared too, and Adam's update normalises each gradient element, so an element
# whose gradient is reduction-order noise moves by different amounts in two runs that agree.
ARGV = [CHANGED.get(previous, value) for previous, value in zip([None, *README_FLAGS], README_FLAGS)] + [
    "--seed", str(SEED), "--distributed-backend", "gloo", "--optimizer", "sgd"]
RUNS = {"upstream": [], "post-balancing": ["--orch-post-balancing"],
        "post-balancing, overlapped grad reduce": ["--orch-post-balancing", "--overlap-grad-reduce"]}
SHADOW = {"post-balancing shadow": ["--orch-shadow"]}  # planned by the schedule hook, trained upstream
# With pipeline stages --orch-encoder-ranks auto puts the encoders on every rank; Megatron's layout, asked for:
FIRST_STAGE = {"post-balancing, encoders on the first stage": ["--orch-post-balancing", "--orch-encoder-ranks",
                                                               "first-stage"]}
RAMP_UP = "batch-size ramp-up"  # a layout's marker: the global batch 2, 4, 4 over the ITERS steps (_ramped)
RAMPED_MICROBATCHES = [1, 2, 2]  # per step on each of 2 DP ranks
# The project's compact trainer on the same flags (those it has): it must reproduce megatron.training.
COMPACT = "compact trainer"
VPP_LAYERS = 4  # the backbone's layers with virtual pipeline stages: one per model chunk at PP 2 x VPP 2
COMPACT_ARGV = ["--model-config", "tiny", "--seq-length", "128", "--max-position-embeddings", "128",
                "--micro-batch-size", "1", "--global-batch-size", "4",
                "--train-iters", str(ITERS), "--lr", "2e-3", "--log-interval", "1", "--seed", str(SEED),
                "--distributed-backend", "gloo", "--transformer-impl", "local", "--optimizer", "sgd",
                "--hidden-dropout", "0", "--attention-dropout", "0"]


def _ramped(argv):
    """``argv`` with Megatron-LM's batch-size ramp-up of the installed release, the global batch 2, 4, 4 over the
    ITERS steps: from 0.19 ``--step-batch-size-schedule`` (thresholds in tokens: 4 from 2 samples on; without
    ``--global-batch-size``), before it ``--rampup-batch-size 2 2 2`` (from 2 to 4 over 2 samples; sample-based
    training, ``--train-samples``: 2 + 4 + 4)."""
    from megatron.core import num_microbatches_calculator

    flags = {}  # each flag's values
    for part in argv:
        if part.startswith("--"):
            flags[part] = []
        else:
            flags[next(reversed(flags))].append(part)
    assert flags["--train-iters"] == [str(ITERS)] and flags["--micro-batch-size"] == ["1"], flags
    if hasattr(num_microbatches_calculator, "StepBatchsizeNumMicroBatchesCalculator"):
        del flags["--global-batch-size"]
        flags["--step-batch-size-schedule"] = [f"0:2 {2 * int(flags['--seq-length'][0])}:4"]
    else:
        del flags["--train-iters"]
        flags.update({"--global-batch-size": ["4"], "--rampup-batch-size": ["2", "2", "2"], "--train-samples": ["10"]})
    return [part for flag, values in flags.items() for part in (flag, *values)]


def _patch_index(patch: Path):
    """(path, pre-image blob, post-image blob) of each file the patch changes."""
    text = patch.read_text()
    return re.findall(r"^diff --git a/(\S+) b/\S+\n(?:.*\n)*?index ([0-9a-f]{40})\.\.([0-9a-f]{40})", text, re.M)


def _apply(target: Path, cwd: Path = REPO):
    return subprocess.run(["bash", str(APPLY), str(target)], cwd=cwd, capture_output=True, text=True)


def _git(cwd: Path, *command: str) -> None:
    subprocess.run(["git", "-c", "user.name=test", "-c", "user.email=test@example.com", *command], cwd=cwd,
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def files():
    return doubles.megatron_lm_files_or_skip()


@pytest.fixture(scope="module")
def released(files):
    """The files of a release that ``patches/`` holds a patch for; main or a fork: the test skips, saying why."""
    if files.release is None:
        pytest.skip(files.no_patch_reason())
    return files


@pytest.fixture(scope="module")
def unpatched_tree(files, tmp_path_factory):
    """The files without the patch: the wheel's or the checkout's own (None: nothing to put on sys.path), or a
    copy."""
    return None if files.on_path else doubles.unpatched_copy(files, tmp_path_factory.mktemp("megatron_lm") / "stock")


RUNTIME_HOOK = "schedule hook: installed at run time (no patched train()"


@pytest.fixture(scope="module")
def hooked_tree(files, tmp_path_factory):
    """(tree, the hook the run announces) of the training runs: a patched copy of the release's files, or
    for a checkout of main or a fork (no patch) the checkout itself with the run-time hook."""
    if files.release is None:
        return None, RUNTIME_HOOK
    tree = doubles.patched_copy(files, tmp_path_factory.mktemp("megatron_lm") / files.release)
    return str(tree), f"schedule hook: the patch of patches/{files.release}"


@pytest.mark.parametrize("release", RELEASES)
def test_every_patch_is_one_full_index_diff_of_training_py_with_its_release_named(release):
    """Each folder's patch says what and why, names the tag commit(s) it was made against, and is a
    ``git diff --full-index`` of training.py only (its pre-image blob is how apply_patches.sh finds it)."""
    patch, = (REPO / "patches" / release).glob("*.patch")
    header = patch.read_text().split("diff --git", 1)[0]
    assert header.startswith(f"megatron-orch patch 0001 for Megatron-LM {release}\n(commit ")
    assert re.search(r"^\(commit [0-9a-f]{40}\)$", header, re.M)
    assert "What:" in header and "Why:" in header
    (path, pre, post), = _patch_index(patch)
    assert path == doubles.BASE_FILE and pre != post
    others = {other: _patch_index(next((REPO / "patches" / other).glob("*.patch")))[0][1] for other in RELEASES}
    assert list(others.values()).count(pre) == 1, "two folders for one training.py"


def test_patch_made_against_the_installed_release(released):
    (path, pre, _), = _patch_index(released.patch)
    assert pre == doubles.hash_object(released.root / path)


@pytest.mark.distributed
def test_patch_applies_and_compiles(released, tmp_path):
    files = released
    copy = doubles.unpatched_copy(files, tmp_path / "tree")
    # git apply from inside the copy, outside any work tree (see apply_patches.sh)
    check = subprocess.run(["git", "apply", "--check", str(files.patch)], cwd=copy, capture_output=True, text=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert check.returncode == 0, check.stderr
    result = _apply(copy)
    assert result.returncode == 0, result.stderr
    assert f"holds Megatron-LM {files.release}'s files" in result.stdout
    assert f"applied {files.release}/0001-forward-backward-func-wrapper.patch" in result.stdout
    patched = copy / doubles.BASE_FILE
    (path, _, post), = _patch_index(files.patch)
    assert doubles.hash_object(patched) == post
    py_compile.compile(str(patched), cfile=str(tmp_path / "training.pyc"), doraise=True)
    source = patched.read_text()
    for function in ("pretrain", "train"):
        signature = re.search(rf"^def {function}\((.*?)\):\n", source, re.M | re.S).group(1)
        assert "forward_backward_func_wrapper=None" in signature, function
    # right after each `forward_backward_func = get_forward_backward_func(...)` statement: train()'s is
    # wrapped, evaluate()'s keeps the stock schedule
    applied = re.findall(r"forward_backward_func = get_forward_backward_func\([^)]*\)\n(.*)\n(.*)\n", source)
    assert applied[0] == ("    if forward_backward_func_wrapper is not None:",
                          "        forward_backward_func = forward_backward_func_wrapper(forward_backward_func)")
    assert len(applied) == 2 and "wrapper" not in "".join(applied[1]), "evaluate() keeps the stock schedule"


@pytest.mark.distributed
def test_apply_patches_is_idempotent_also_inside_another_work_tree(released, tmp_path):
    files = released
    # A copy inside this repository's work tree (ignored runs/): git apply must still patch it.
    inside = REPO / "runs" / f"test_megatron_lm_{os.getpid()}"
    try:
        copy = doubles.unpatched_copy(files, inside / "tree")
        first = _apply(copy, cwd=inside)
        assert first.returncode == 0 and "applied" in first.stdout, first.stdout + first.stderr
        patched = (copy / doubles.BASE_FILE).read_bytes()
        second = _apply(copy, cwd=inside)
        assert second.returncode == 0, second.stderr
        assert "already applied" in second.stdout
        assert (copy / doubles.BASE_FILE).read_bytes() == patched
    finally:
        shutil.rmtree(inside, ignore_errors=True)


@pytest.mark.distributed
def test_apply_patches_takes_a_fork_with_other_commits(released, tmp_path):
    """A git checkout whose HEAD is not the tag (a fork: the release's files, then an unrelated commit)
    gets its release's patch, with a note that HEAD is not the tag's commit."""
    files = released
    fork = doubles.unpatched_copy(files, tmp_path / "fork")
    _git(fork, "init", "-q")
    _git(fork, "add", "-A")
    _git(fork, "commit", "-q", "-m", "the release's files")
    (fork / "FORK_NOTES.md").write_text("our own change\n")
    _git(fork, "add", "FORK_NOTES.md")
    _git(fork, "commit", "-q", "-m", "a fork's commit")
    result = _apply(fork)
    assert result.returncode == 0, result.stderr
    assert "is a git checkout at" in result.stdout and f"{files.release}'s patch applies" in result.stdout
    assert "forward_backward_func_wrapper" in (fork / doubles.BASE_FILE).read_text()


@pytest.mark.distributed
def test_apply_patches_refuses_a_changed_training_py(files, tmp_path):
    for kind in ("copy", "git checkout"):
        changed = doubles.unpatched_copy(files, tmp_path / kind.replace(" ", "_"))
        base = changed / doubles.BASE_FILE
        edited = base.read_bytes().replace(b"def evaluate(", b"def evaluate_changed(", 1)
        base.write_bytes(edited)
        if kind == "git checkout":
            _git(changed, "init", "-q")
            _git(changed, "add", "-A")
            _git(changed, "commit", "-q", "-m", "a changed training.py")
        result = _apply(changed)
        assert result.returncode == 1, kind
        assert "is neither the file of a supported Megatron-LM release" in result.stderr and str(base) in result.stderr
        assert "installs the same schedule hook at run time" in result.stderr
        assert base.read_bytes() == edited, "nothing written"
    result = _apply(tmp_path)
    assert result.returncode == 1 and "is not a Megatron-LM checkout" in result.stderr


@pytest.mark.distributed
def test_refusals_before_training(unpatched_tree):
    """--overlap-grad-reduce without post-balancing is refused with the reason (the unbalanced MLLM fails)."""
    tree = None if unpatched_tree is None else str(unpatched_tree)
    code = ("import sys; sys.path.insert(0, 'tests'); import megatron_lm_doubles as d, pathlib, runpy\n"
            f"d.install(None if {tree!r} is None else pathlib.Path({tree!r}))\n"
            "main = runpy.run_path('pretrain_mllm.py', run_name='pretrain_mllm')['main_megatron_lm']\n"
            "sys.argv = ['pretrain_mllm.py', '--overlap-grad-reduce']\n"
            "try:\n"
            "    main()\n"
            "except SystemExit as exit:\n"
            "    print(repr(exit.code))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--overlap-grad-reduce without --orch-post-balancing is not supported" in result.stdout.strip().splitlines()[-1]


def _megatron_args(**changes):
    import argparse
    args = dict(dataloader_type="external", calculate_per_token_loss=True, virtual_pipeline_model_parallel_size=None,
                context_parallel_size=1, tensor_model_parallel_size=1, orch_microbatching="equal_count",
                transformer_impl="local")
    return argparse.Namespace(**{**args, **changes})


def test_check_args_names_what_post_balancing_cannot_run_with():
    """Every refusal names its flag; the flags of newer releases (read with getattr) are refused where
    they are set and an older release's namespace, which lacks them, passes."""
    from megatron_orch.megatron import megatron_lm

    megatron_lm.check_args(_megatron_args())
    from megatron_orch.orchestrator.config import EncoderRanks, OrchestratorConfig
    megatron_lm.check_args(_megatron_args(pipeline_model_parallel_size=1, orch_config=OrchestratorConfig(
        encoder_ranks=EncoderRanks.ALL, verify_first_step=False)))  # one stage: the same layout
    interleaving = dict(pipeline_model_parallel_size=2, micro_batch_size=1, data_parallel_size=2)
    megatron_lm.check_args(_megatron_args(virtual_pipeline_model_parallel_size=2, **interleaving, global_batch_size=4))
    megatron_lm.check_args(_megatron_args(hybrid_context_parallel=False, sequence_packing_scheduler=None,
                                          use_varlen_dataset=False,
                                          cuda_graph_impl="local", cuda_graph_scope=["attn"],
                                          moe_expert_rank_capacity_factor=None, perform_rl_step=False,
                                          use_torch_fsdp2=False, use_megatron_fsdp=False,
                                          step_batch_size_schedule=None))
    for ramp_up in (dict(rampup_batch_size=["4", "4", "100"]), dict(step_batch_size_schedule="0:4 100:8")):
        megatron_lm.check_args(_megatron_args(**ramp_up))  # each step planned and run with its own count
    for sharded in ("use_torch_fsdp2", "use_megatron_fsdp"):  # the schedule runs with sharded parameters
        megatron_lm.check_args(_megatron_args(**{sharded: True}))
    moe = dict(num_experts=4, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.0,
               moe_z_loss_coeff=None, moe_expert_capacity_factor=None)
    megatron_lm.check_args(_megatron_args(**moe))  # Megatron-LM's defaults: no load-balancing loss
    megatron_lm.check_args(_megatron_args(**{**moe, "moe_router_load_balancing_type": ["seq_aux_loss"],
                                             "moe_aux_loss_coeff": [1e-2], "moe_z_loss_coeff": 1e-3}))
    for changes, flag in ((dict(dataloader_type="single"), "--dataloader-type single"),
                          (dict(calculate_per_token_loss=False), "--calculate-per-token-loss is required"),
                          (dict(virtual_pipeline_model_parallel_size=2, **interleaving, global_batch_size=2),
                           "virtual pipeline stages with 1 micro-batches per step"),
                          (dict(hybrid_context_parallel=True), "--hybrid-context-parallel"),
                          (dict(sequence_packing_scheduler="dp_balanced"), "--sequence-packing-scheduler dp_balanced: "
                                                                           "Megatron's own packing scheduler re-packs"),
                          (dict(use_varlen_dataset=True), "--use-varlen-dataset (it runs Megatron's sequence-packing "
                                                          "scheduler): Megatron's own packing scheduler re-packs"),
                          (dict(cuda_graph_impl="full_iteration"), "full-iteration CUDA graphs"),
                          (dict(cuda_graph_impl="local", cuda_graph_scope=["full_iteration"]), "full-iteration CUDA graphs"),
                          (dict(moe_expert_rank_capacity_factor=1.5), "--moe-expert-rank-capacity-factor"),
                          (dict(perform_rl_step=True), "--perform-rl-step"),
                          (dict(moe, moe_aux_loss_coeff=1e-2), "aux_loss with --moe-aux-loss-coeff 0.01: the "
                                                                   "micro-batch-level load-balancing loss"),
                          (dict(moe, moe_router_load_balancing_type=["global_aux_loss"], moe_aux_loss_coeff=[1e-2]),
                           "global_aux_loss"),
                          (dict(moe, moe_router_load_balancing_type="sinkhorn"), "sinkhorn"),
                          (dict(moe, moe_expert_capacity_factor=1.0), "--moe-expert-capacity-factor 1"),
                          (dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                orch_config=OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, verify_first_step=False,
                                                               encoder_tensor_parallel_size=1)),
                           "the encoders at a tensor-parallel size of their own (--orch-encoder-tensor-parallel-size "
                           "below --tensor-model-parallel-size) through megatron.training is not supported")):
        with pytest.raises(ValueError, match=re.escape(flag)):
            megatron_lm.check_args(_megatron_args(**changes))


def test_encoder_ranks_under_megatron_training():
    """``--orch-encoder-ranks auto`` (the default) under megatron.training, decided as the compact trainer decides:
    ``all`` with PP 2 where the layout runs it and it fits (no GPU here: not checked; check_args passes it), else
    first-stage saying why: it does not fit ``--orch-gpu-memory-gb``, the layout does not run it (FSDP2), the
    encoders at a TP of their own (what megatron.training's checkpoint cannot hold); ``all`` given is kept."""
    from megatron_orch.megatron import megatron_lm
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.orchestrator.config import EncoderRanks, OrchestratorConfig

    tiny = load_model_config("tiny")
    layout = dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=1, data_parallel_size=2,
                  seq_length=128, micro_batch_size=1, num_microbatches=2, use_distributed_optimizer=False,
                  sequence_parallel=False, overlap_grad_reduce=False, orch_encoder_tensor_parallel_size=None,
                  orch_gpu_memory_gb=None)

    def decide(**changes):
        args = _megatron_args(**{"orch_config": OrchestratorConfig(), "orch_encoder_ranks": "auto", **layout, **changes})
        return args, megatron_lm.encoder_ranks_decision(args, tiny.phases(), tiny.phase_parameters())

    args, decision = decide()
    assert decision.ranks is args.orch_config.encoder_ranks is EncoderRanks.ALL and args.orch_encoder_ranks == "all"
    assert "each encoder phase over DP x 2 pipeline stages" in decision.line(), decision.line()
    megatron_lm.check_args(args)
    for changes, reason in ((dict(orch_gpu_memory_gb=1e-6), "--orch-encoder-ranks all does not fit "
                                                            "--orch-gpu-memory-gb"),
                            (dict(use_torch_fsdp2=True), "--use-torch-fsdp2 is not supported"),
                            (dict(pipeline_model_parallel_size=1, tensor_model_parallel_size=2,
                                  orch_encoder_tensor_parallel_size=1,
                                  orch_config=OrchestratorConfig(encoder_tensor_parallel_size=1)),
                             "through megatron.training is not supported")):
        args, decision = decide(**changes)
        assert decision.ranks is args.orch_config.encoder_ranks is EncoderRanks.FIRST_STAGE, changes
        assert args.orch_encoder_ranks == "first-stage" and args.orch_config.encoder_tensor_parallel_size is None
        assert reason in decision.reason, (changes, decision.line())
        megatron_lm.check_args(args)
    args, decision = decide(orch_config=OrchestratorConfig(encoder_ranks=EncoderRanks.ALL))
    assert decision.ranks is EncoderRanks.ALL and decision.reason == "as asked"


def test_pretrain_api_and_patch_detected_by_signature():
    """Which pretrain() API (0.16-0.17: extra_args_provider; 0.18+: a config container first) and whether the
    patch is in, from the signature alone, as megatron_lm.pretrain decides them."""
    from megatron_orch.megatron import megatron_lm

    def v016(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func,
             process_non_loss_data_func=None, extra_args_provider=None, args_defaults={}, store=None):
        pass

    def v019(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func, model_provider=None,
             store=None, pg_collection=None, forward_backward_func_wrapper=None):
        pass

    assert not megatron_lm.takes_config_container(v016) and megatron_lm.takes_config_container(v019)
    assert megatron_lm.is_patched(v019) and not megatron_lm.is_patched(v016)


def test_runtime_schedule_hook_wraps_train_only_and_restores():
    """The run-time hook: train()'s call of get_forward_backward_func gets the wrapper, evaluate()'s (and
    any other caller's) the stock schedule, and the module is as before once the block ends."""
    from megatron_orch.megatron import megatron_lm

    def stock_schedule(**kwargs):
        return "stock"

    training = types.ModuleType("training")
    training.get_forward_backward_func = lambda schedule_pg_collection=None: stock_schedule
    source = ("def evaluate():\n    return get_forward_backward_func()\n"
              "def train():\n    return get_forward_backward_func(schedule_pg_collection='pg'), evaluate()\n")
    exec(compile(source, "training.py", "exec"), training.__dict__)
    original = training.get_forward_backward_func
    wrapped = []

    def wrapper(schedule):
        wrapped.append(schedule)
        return ("wrapped", schedule)

    with megatron_lm.runtime_schedule_hook(training, wrapper):
        in_train, in_evaluate = training.train()
        assert training.evaluate() is stock_schedule
    assert in_train == ("wrapped", stock_schedule) and in_evaluate is stock_schedule and wrapped == [stock_schedule]
    assert training.get_forward_backward_func is original
    assert training.train() == (stock_schedule, stock_schedule)
    # a training run that fails inside the block leaves the module as it was too
    with pytest.raises(RuntimeError, match="a failing run"):
        with megatron_lm.runtime_schedule_hook(training, wrapper):
            assert training.train()[0] == ("wrapped", stock_schedule)
            raise RuntimeError("a failing run")
    assert training.get_forward_backward_func is original


def test_runtime_schedule_hook_sees_through_decorators_and_never_fired_is_an_error():
    """A train() decorated with functools.wraps (Megatron-LM main decorates evaluate()) still gets the wrapped
    schedule; a decorator that hides train() (no __wrapped__) leaves the hook unfired, which is an error when
    the block ends instead of a run on the stock schedule."""
    from megatron_orch.megatron import megatron_lm

    def stock_schedule(**kwargs):
        return "stock"

    source = ("import functools\n"
              "def logged(f):\n    @functools.wraps(f)\n"
              "    def run(*a, **k):\n        return f(*a, **k)\n    return run\n"
              "def opaque(f):\n    def run(*a, **k):\n        return f(*a, **k)\n    return run\n"
              "@DECORATOR\ndef train():\n    return get_forward_backward_func()\n")

    def training_module(decorator):
        training = types.ModuleType("training")
        training.get_forward_backward_func = lambda: stock_schedule
        exec(compile(source.replace("DECORATOR", decorator), "training.py", "exec"), training.__dict__)
        return training

    training = training_module("logged")
    with megatron_lm.runtime_schedule_hook(training, lambda schedule: ("wrapped", schedule)):
        assert training.train() == ("wrapped", stock_schedule)
    training = training_module("opaque")
    with pytest.raises(megatron_lm.HookNeverFiredError, match=r"hook never fired: train\(\) \(training.py:\d+\) "
                                                               r"did not ask get_forward_backward_func"):
        with megatron_lm.runtime_schedule_hook(training, lambda schedule: ("wrapped", schedule)):
            assert training.train() is stock_schedule
    with pytest.raises(megatron_lm.HookNeverFiredError):  # nor is a block that never trains
        with megatron_lm.runtime_schedule_hook(training_module("logged"), lambda schedule: schedule):
            pass


def _pretrain_runs(rank, world_size, tree, layouts, out_dir):
    """Megatron-LM's pretrain through pretrain_mllm.main_megatron_lm, once per run of each layout
    ``((tp, pp), runs)``, or ``((tp, pp, vpp), runs)`` with virtual pipeline stages (a 4-layer backbone, the
    scripted steps of test_virtual_pipeline), in these ranks; what each run did goes to ``out_dir/rank<r>.json``."""
    warnings.filterwarnings("ignore")
    doubles.install(None if tree is None else Path(tree))
    spec = importlib.util.spec_from_file_location("pretrain_mllm", REPO / "pretrain_mllm.py")
    pretrain_mllm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain_mllm)
    results, params = {}, {}
    for parallel, runs in layouts:
        for name in runs:
            run = _compact_run if name == COMPACT else _megatron_lm_run
            results.setdefault(str(parallel), {})[name] = run(pretrain_mllm, world_size, parallel, name)
            params.setdefault(str(parallel), {})[name] = results[str(parallel)][name].pop("params", None)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))
    torch.save(params, Path(out_dir) / f"params{rank}.pt")  # each run's parameters after its last step


def _megatron_lm_run(pretrain_mllm, world_size, parallel, name) -> dict:
    """Per step: the schedule train() used, the items the plan moved between ranks, the global loss (last
    pipeline stage); and how often an encoder without items got zero gradients."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import training

    from megatron_orch.megatron import schedule
    from megatron_orch.megatron.schedule import ModalityAwareSchedule
    from megatron_orch.mllm import providers
    from test_virtual_pipeline import scripted_iterator

    import megatron.training

    record = {"losses": [], "schedule": [], "moved_items": 0, "zero_gradients": 0, "hook": [], "reports": [],
              "sequence_parallel": [], "microbatches": [], "balanced_microbatches": []}
    stock_train_step, stock_zero_gradients = training.train_step, schedule._zero_gradients
    stock_print_rank_0 = megatron.training.print_rank_0

    def print_rank_0(message):  # what pretrain_mllm's megatron_lm.pretrain announces
        if "post-balancing in megatron.training" in message:
            record["hook"].append(message)
        stock_print_rank_0(message)

    def train_step(*args, **kwargs):  # positional as train() calls it: the model chunks 3rd, the schedule 7th
        out = stock_train_step(*args, **kwargs)
        model, schedule_used = args[2], args[6]
        record["schedule"].append(type(schedule_used).__name__)
        stock = schedule_used.forward_backward_func if isinstance(schedule_used, ModalityAwareSchedule) else schedule_used
        record["megatron_schedule"], record["chunks"] = stock.__name__, len(model)
        record["params"] = {f"chunk{i}.{n}": p.detach().clone() for i, chunk in enumerate(model)
                            for n, p in chunk.named_parameters()}
        record["sequence_parallel"].append(args[5].sequence_parallel)  # the model config train() runs with
        if isinstance(schedule_used, ModalityAwareSchedule):
            plan = schedule_used.last_step.plan
            record["reports"].append(plan.report())
            for transfer in (plan.text_transfer(), *(plan.input_transfer(p) for p in plan.encoders)):
                traffic = transfer.traffic_matrix()
                record["moved_items"] += int(traffic.sum() - traffic.trace())
        record["microbatches"].append(get_num_microbatches())  # what train() passed the schedule
        if isinstance(schedule_used, ModalityAwareSchedule):
            record["balanced_microbatches"].append(len(schedule_used.last_step.microbatches))
        if out[0]:
            record["losses"].append(float(out[0]["lm loss"]))
        return out

    def zero_gradients(encoder):
        record["zero_gradients"] += 1
        stock_zero_gradients(encoder)

    tp, pp, *rest = parallel  # (TP, PP[, VPP][, Megatron-LM flags of the layout])
    virtual = [v for v in rest if isinstance(v, int)]
    extra = [flag for flag in rest if isinstance(flag, str) and flag != RAMP_UP]
    flags = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    stock_data = providers.build_train_data_iterator
    if virtual:
        flags += ["--num-layers", str(VPP_LAYERS), "--num-layers-per-virtual-pipeline-stage",
                  str(VPP_LAYERS // (pp * virtual[0]))]
        providers.build_train_data_iterator = scripted_iterator
    training.train_step, schedule._zero_gradients = train_step, zero_gradients
    megatron.training.print_rank_0 = print_rank_0
    cp = int(extra[extra.index("--context-parallel-size") + 1]) if "--context-parallel-size" in extra else 1
    doubles.prepare_run(tp, pp, seed=SEED, virtual_pipeline_model_parallel_size=virtual[0] if virtual else None,
                        context_parallel_size=cp)
    argv = _ramped(ARGV) if RAMP_UP in rest else ARGV
    sys.argv = ["pretrain_mllm.py", *argv, *flags, *extra, *{**RUNS, **SHADOW, **FIRST_STAGE}[name]]
    try:
        pretrain_mllm.main_megatron_lm()
    finally:
        training.train_step, schedule._zero_gradients = stock_train_step, stock_zero_gradients
        megatron.training.print_rank_0 = stock_print_rank_0
        providers.build_train_data_iterator = stock_data
        doubles.reset()
    return record


def _compact_run(pretrain_mllm, world_size, parallel, name) -> dict:
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, loop
    args = arguments.parse_args(MLLM_TASK, COMPACT_ARGV + ["--tensor-model-parallel-size", str(parallel[0]),
                                                "--pipeline-model-parallel-size", str(parallel[1])],
                                world_size=world_size)
    try:
        return {"losses": [record.lm_loss for record in loop.pretrain(args, MLLM_TASK, print_fn=lambda line: None)]}
    finally:
        parallel_state.destroy_model_parallel()


def _check_runs(out_dir: Path, world_size: int, parallel, runs, hook: str, encoders_on_every_rank=()) -> None:
    """Every megatron.training run of the layout: the upstream run's losses and, on every rank, its parameters
    after the run (within 1e-5), the schedule each used, and that the balanced runs moved data. The runs named in
    ``encoders_on_every_rank`` (``--orch-encoder-ranks all``) hold the encoders off the first stage too, trained to
    upstream's first-stage encoders (rank 0's); the others hold upstream's parameters exactly."""
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text())[str(parallel)] for r in range(world_size)]
    first_stage = torch.load(out_dir / "params0.pt")[str(parallel)]["upstream"]
    for rank in range(world_size):
        params = torch.load(out_dir / f"params{rank}.pt")[str(parallel)]
        for name in [run for run in runs[1:] if run != COMPACT]:
            extra = params[name].keys() - params["upstream"].keys()
            assert params["upstream"].keys() <= params[name].keys(), name
            assert all(".encoders." in key for key in extra), (name, extra)
            if rank == world_size - 1:  # the last stage
                assert bool(extra) == (name in encoders_on_every_rank), (name, extra)
            for key, value in [*params["upstream"].items(), *((key, first_stage[key]) for key in extra)]:
                torch.testing.assert_close(params[name][key], value, rtol=TOLERANCE, atol=TRAINED_PARAMS_ATOL,
                                           msg=lambda m: f"{parallel} {name}, rank {rank}, {key}: {m}")
    last = ranks[-1]  # on the last pipeline stage (and the compact trainer's logging rank)
    upstream = last["upstream"]["losses"]
    assert len(upstream) == ITERS
    for name in runs[1:]:
        losses = last[name]["losses"]
        assert len(losses) == ITERS, name
        for step, (off, on) in enumerate(zip(upstream, losses), 1):
            assert abs(on - off) <= TOLERANCE * abs(off), f"{parallel} {name}, iteration {step}: {on} vs {off}"
    balanced = [name for name in runs if name.startswith("post-balancing")]
    for rank in ranks:
        assert rank["upstream"]["schedule"] == ["function"] * ITERS  # megatron-core's own schedule
        assert rank["upstream"]["hook"] == []
        for name in balanced:
            assert rank[name]["schedule"] == ["ModalityAwareSchedule"] * ITERS, name
    for name in balanced:  # the plans moved examples between ranks; rank 0 said which hook it used
        assert sum(rank[name]["moved_items"] for rank in ranks) > 0, name
        announced, = ranks[0][name]["hook"]
        assert hook in announced, announced


@pytest.mark.distributed
def test_megatron_training_dp2(hooked_tree, tmp_path):
    tree, hook = hooked_tree
    layout = ((1, 1), [*RUNS, COMPACT])
    run_distributed(_pretrain_runs, 2, tree, [layout], str(tmp_path), timeout_s=400)
    _check_runs(tmp_path, 2, *layout, hook=hook)
    overlapped = [json.loads((tmp_path / f"rank{r}.json").read_text())[str(layout[0])]
                  ["post-balancing, overlapped grad reduce"] for r in range(2)]
    # a rank without items of an encoder phase in some step gave that encoder zero gradients, which
    # --overlap-grad-reduce needs (every parameter reports each step)
    assert sum(r["zero_gradients"] for r in overlapped) > 0


@pytest.mark.distributed
def test_megatron_training_dp2_with_the_runtime_hook(unpatched_tree, tmp_path):
    """No patch (the wheel's own megatron.training, or an unpatched copy): the schedule hook is installed
    at run time, and post-balancing again reproduces the upstream losses; shadow mode goes through the same
    hook and trains upstream. Then with Megatron-LM's batch-size ramp-up (:func:`_ramped`): each balanced step
    planned over the global batch it loaded and run with the count train() passes, 1 then 2 micro-batches per rank,
    as upstream."""
    layout = ((1, 1), ["upstream", "post-balancing", *SHADOW])
    ramped = ((1, 1, RAMP_UP), ["upstream", "post-balancing"])
    run_distributed(_pretrain_runs, 2, None if unpatched_tree is None else str(unpatched_tree), [layout, ramped],
                    str(tmp_path), timeout_s=450)
    for each in (layout, ramped):
        _check_runs(tmp_path, 2, *each, hook=RUNTIME_HOOK)
    for rank in range(2):
        runs = json.loads((tmp_path / f"rank{rank}.json").read_text())[str(ramped[0])]
        assert runs["upstream"]["microbatches"] == runs["post-balancing"]["microbatches"] == RAMPED_MICROBATCHES
        assert runs["post-balancing"]["balanced_microbatches"] == RAMPED_MICROBATCHES


@pytest.mark.distributed
def test_megatron_training_pp2_dp2_tp2_dp2_and_pp2_vpp2_dp2(hooked_tree, tmp_path):
    """Four ranks, three layouts one after the other in the same processes (saves starting them three times).
    PP 2 x VPP 2 x DP 2 (Megatron-LM's --num-layers-per-virtual-pipeline-stage over a 4-layer backbone: two
    model chunks per rank, megatron-core's interleaved schedule) on the scripted steps of test_virtual_pipeline,
    also with --overlap-grad-reduce (a grad_sync_func per chunk: the encoders' backward runs from the first
    chunk's); its step with every heavy example on one DP rank moved data and lowered each phase's max/mean. With
    pipeline stages post-balancing runs the encoders on every rank (``--orch-encoder-ranks auto``: all; in every
    rank's first chunk with VPP, also with --overlap-grad-reduce), their parameters shared at build and trained as
    upstream's first-stage ones;
    PP 2 x DP 2 also with the encoders on the first stage, asked for, and (Adam) with the encoders on every rank saved
    by Megatron's distributed checkpoint after 2 steps and resumed for the third, as the straight run."""
    from test_virtual_pipeline import STEPS

    tree, hook = hooked_tree

    interleaved = ((1, 2, 2), ["upstream", "post-balancing", "post-balancing, overlapped grad reduce"])
    layouts = [((1, 2), ["upstream", "post-balancing", *FIRST_STAGE]), ((2, 1), ["upstream", "post-balancing"]),
               interleaved]
    # PP 2 x DP 2, the encoders on every rank, Adam (megatron-core loads no SGD state from a distributed
    # checkpoint), the LR decayed over 3 steps: 3 steps straight; 2 saved; the third resumed from the checkpoint
    checkpoint, adam = str(tmp_path / "checkpoint"), ("--optimizer", "adam", "--lr-decay-iters", str(ITERS))
    straight, saved, resumed = (((1, 2, *adam, *more), ["post-balancing"]) for more in (
        (), ("--save", checkpoint, "--save-interval", "2", "--train-iters", "2"),
        ("--load", checkpoint, "--override-opt_param-scheduler")))  # (its weight decay steps: the run's)
    run_distributed(_pretrain_runs, 4, tree, layouts + [straight, saved, resumed], str(tmp_path), timeout_s=900)
    for layout, on_every_rank in zip(layouts, (["post-balancing"], [], interleaved[1][1:])):
        _check_runs(tmp_path, 4, *layout, hook=hook, encoders_on_every_rank=on_every_rank)
    # the checkpoint holds every stage's encoders once and resumes them on every stage: the resumed step is the
    # straight run's third
    losses = {run[0]: json.loads((tmp_path / "rank3.json").read_text())[str(run[0])]["post-balancing"]["losses"]
              for run in (straight, saved, resumed)}
    assert losses[saved[0]] == pytest.approx(losses[straight[0]][:2], rel=TOLERANCE), losses
    assert losses[resumed[0]] == pytest.approx(losses[straight[0]][2:], rel=TOLERANCE), losses
    for rank in range(4):
        params = torch.load(tmp_path / f"params{rank}.pt")
        want, got = params[str(straight[0])]["post-balancing"], params[str(resumed[0])]["post-balancing"]
        assert got.keys() == want.keys() and (rank < 2 or any(".encoders." in key for key in got)), rank
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=TOLERANCE, atol=TRAINED_PARAMS_ATOL,
                                       msg=lambda m: f"resumed, rank {rank}, {key}: {m}")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text())[str(interleaved[0])] for r in range(4)]
    for run in interleaved[1]:
        assert all(r[run]["chunks"] == 2 for r in ranks), run
        assert {r[run]["megatron_schedule"] for r in ranks} == {"forward_backward_pipelining_with_interleaving"}, run
    for run in interleaved[1][1:]:
        heavy = ranks[0][run]["reports"][STEPS.index("heavy_on_one_rank")]
        assert heavy["intra-node MB"] + heavy["inter-node MB"] > 0, heavy
        for phase in ("vision", "audio", "llm"):
            assert heavy[f"{phase} after"] < heavy[f"{phase} before"], (run, heavy)


@pytest.mark.distributed
def test_megatron_training_tp2_sequence_parallel_dp2_and_cp2_dp2(hooked_tree, tmp_path):
    """Four ranks, two layouts one after the other in the same processes: TP 2 with sequence parallelism x DP 2
    (the model config megatron.training trains with has it on) and CP 2 x DP 2."""
    tree, hook = hooked_tree
    layouts = [((2, 1, "--sequence-parallel"), ["upstream", "post-balancing"]),
               ((1, 1, "--context-parallel-size", "2"), ["upstream", "post-balancing"])]
    run_distributed(_pretrain_runs, 4, tree, layouts, str(tmp_path), timeout_s=600)
    for layout in layouts:
        _check_runs(tmp_path, 4, *layout, hook=hook)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank in ranks:
        for name in layouts[0][1]:
            assert rank[str(layouts[0][0])][name]["sequence_parallel"] == [True] * ITERS, name
            assert rank[str(layouts[1][0])][name]["sequence_parallel"] == [False] * ITERS, name


@pytest.mark.distributed
def test_trainer_is_chosen_by_flag_not_by_machine():
    """--orch-trainer megatron-lm on a machine without CUDA stops with one line (which says why: no CUDA
    where megatron.training imports, else that it does not import); a bad value is argparse's one line.
    (Without the flag the compact trainer runs even where megatron.training imports: test_bad_input's
    checks before torch loads pass on the 0.19.2 set-up, whose wheel ships megatron.training.)"""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --orch-trainer megatron-lm would train here")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1"}
    expected = ("needs GPUs" if importlib.util.find_spec("megatron.training") is not None
                else "megatron.training does not import here")
    for value, message in (("megatron-lm", expected), ("tensorflow", "argument --orch-trainer: invalid choice")):
        result = subprocess.run([sys.executable, "pretrain_mllm.py", "--orch-trainer", value], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=scaled(120))
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("pretrain_mllm.py: error: "), result.stderr
        assert message in result.stderr
