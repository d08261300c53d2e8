"""Megatron-LM integration: the patch of ``patches/core_v0.16.1``, ``scripts/apply_patches.sh``, and
``pretrain_mllm.py``'s ``megatron.training`` path with post-balancing off and on.

The training runs go through Megatron-LM's own ``megatron.training.pretrain`` (from a patched copy of
the tag's files, on CPU over gloo with the test doubles of ``megatron_lm_doubles``): DP 2, PP 2 x DP 2
and TP 2 x DP 2, post-balancing off (upstream) then on in the same spawned ranks, fp32 and dropout 0,
and the losses of every iteration must agree within 1e-5. DP 2 also runs post-balancing with ``--overlap-grad-reduce``,
including a step where a rank gets no items of an encoder phase, and the project's compact trainer on
the same flags, which must reproduce megatron.training's losses.
Skipped, saying why, where the Megatron-LM files (``../shared/megatron-lm``) are absent.
"""
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import megatron_lm_doubles as doubles
from dist_utils import run_distributed, scaled

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "patches" / "core_v0.16.1" / "0001-forward-backward-func-wrapper.patch"
APPLY = REPO / "scripts" / "apply_patches.sh"
SEED = 11
ITERS = 3
TOLERANCE = 1e-5
# Megatron-LM flags: the tiny model's backbone shape (Megatron requires it), Megatron's own defaults that
# would not suit the check (dropout, evaluation), the tokenizer Megatron builds anyway. The rerun state
# machine keeps Megatron's default mode (validate_results).
ARGV = ["--model-config", "tiny", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "2e-3", "--log-interval", "1",
        "--seed", str(SEED), "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--calculate-per-token-loss",
        "--eval-iters", "0", "--eval-interval", "1000",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024"]
RUNS = {"upstream": [], "post-balancing": ["--orch-post-balancing"],
        "post-balancing, overlapped grad reduce": ["--orch-post-balancing", "--overlap-grad-reduce"]}
# The project's compact trainer on the same flags (those it has): it must reproduce megatron.training.
COMPACT = "compact trainer"
COMPACT_ARGV = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "4",
                "--train-iters", str(ITERS), "--lr", "2e-3", "--log-interval", "1", "--seed", str(SEED),
                "--distributed-backend", "gloo", "--transformer-impl", "local"]


def _patch_index(patch: Path):
    """(path, pre-image blob, post-image blob) of each file the patch changes."""
    text = patch.read_text()
    return re.findall(r"^diff --git a/(\S+) b/\S+\n(?:.*\n)*?index ([0-9a-f]{40})\.\.([0-9a-f]{40})", text, re.M)


def _hash_object(path: Path) -> str:
    return subprocess.run(["git", "hash-object", str(path)], check=True, capture_output=True, text=True).stdout.strip()


def _apply(target: Path, cwd: Path = REPO):
    return subprocess.run(["bash", str(APPLY), str(target)], cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def shared_tree():
    return doubles.shared_tree_or_skip()


@pytest.fixture(scope="module")
def patched_tree(shared_tree, tmp_path_factory):
    return doubles.patched_copy(tmp_path_factory.mktemp("megatron_lm") / "core_v0.16.1")


def test_patch_made_against_the_tag_with_full_index(shared_tree):
    index = _patch_index(PATCH)
    assert [path for path, _, _ in index] == [doubles.BASE_FILE]
    path, pre, _ = index[0]
    assert pre == _hash_object(shared_tree / path)
    header = PATCH.read_text().split("diff --git", 1)[0]
    assert "What:" in header and "Why:" in header


def test_patch_applies_and_compiles(shared_tree, tmp_path):
    copy = doubles.unpatched_copy(tmp_path / "tree")
    # git apply from inside the copy, outside any work tree (see apply_patches.sh)
    check = subprocess.run(["git", "apply", "--check", str(PATCH)], cwd=copy, capture_output=True, text=True,
                           env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert check.returncode == 0, check.stderr
    result = _apply(copy)
    assert result.returncode == 0, result.stderr
    assert "applied 0001-forward-backward-func-wrapper.patch" in result.stdout
    patched = copy / doubles.BASE_FILE
    (path, _, post), = _patch_index(PATCH)
    assert _hash_object(patched) == post
    py_compile.compile(str(patched), cfile=str(tmp_path / "training.pyc"), doraise=True)
    source = patched.read_text()
    for function in ("pretrain", "train"):
        signature = re.search(rf"^def {function}\((.*?)\):", source, re.M | re.S).group(1)
        assert "forward_backward_func_wrapper=None" in signature, function
    applied = re.findall(r"forward_backward_func = get_forward_backward_func\(\)\n(.*)\n(.*)\n", source)
    assert applied[0] == ("    if forward_backward_func_wrapper is not None:",
                          "        forward_backward_func = forward_backward_func_wrapper(forward_backward_func)")
    assert len(applied) == 2 and "wrapper" not in "".join(applied[1]), "evaluate() keeps the stock schedule"


def test_apply_patches_is_idempotent_also_inside_another_work_tree(shared_tree, tmp_path):
    # A copy inside this repository's work tree (ignored runs/): git apply must still patch it.
    inside = REPO / "runs" / f"test_megatron_lm_{os.getpid()}"
    try:
        copy = doubles.unpatched_copy(inside / "tree")
        first = _apply(copy, cwd=inside)
        assert first.returncode == 0 and "applied 0001" in first.stdout, first.stdout + first.stderr
        patched = (copy / doubles.BASE_FILE).read_bytes()
        second = _apply(copy, cwd=inside)
        assert second.returncode == 0, second.stderr
        assert "already applied" in second.stdout
        assert (copy / doubles.BASE_FILE).read_bytes() == patched
    finally:
        shutil.rmtree(inside, ignore_errors=True)


def test_apply_patches_refuses_a_mismatched_tree(shared_tree, tmp_path):
    changed = doubles.unpatched_copy(tmp_path / "changed")
    base = changed / doubles.BASE_FILE
    original = base.read_bytes()
    base.write_bytes(original.replace(b"def evaluate(", b"def evaluate_changed(", 1))
    result = _apply(changed)
    assert result.returncode == 1
    assert "is neither the core_v0.16.1 file" in result.stderr and str(base) in result.stderr
    assert base.read_bytes() == original.replace(b"def evaluate(", b"def evaluate_changed(", 1)

    other_commit = doubles.unpatched_copy(tmp_path / "git_checkout")
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "not the tag"]):
        subprocess.run(git + command, cwd=other_commit, check=True, capture_output=True)
    result = _apply(other_commit)
    assert result.returncode == 1
    assert "not Megatron-LM core_v0.16.1 (55ac7082517c3878ae653c07c09c534b8aed49f6)" in result.stderr
    assert "forward_backward_func_wrapper" not in (other_commit / doubles.BASE_FILE).read_text()

    result = _apply(tmp_path)
    assert result.returncode == 1 and "is not a Megatron-LM checkout" in result.stderr


def test_refusals_before_training(shared_tree, tmp_path):
    """pretrain_mllm.py on an unpatched Megatron-LM refuses --orch-post-balancing and names the script;
    --overlap-grad-reduce without post-balancing is refused with the reason (the unbalanced MLLM fails)."""
    copy = doubles.unpatched_copy(tmp_path / "tree")
    code = ("import sys; sys.path.insert(0, 'tests'); import megatron_lm_doubles as d, pathlib, runpy\n"
            f"d.install(pathlib.Path({str(copy)!r}))\n"
            "main = runpy.run_path('pretrain_mllm.py', run_name='pretrain_mllm')['main_megatron_lm']\n"
            "for flag in ('--orch-post-balancing', '--overlap-grad-reduce'):\n"
            "    sys.argv = ['pretrain_mllm.py', flag]\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit as exit:\n"
            "        print(repr(exit.code))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stdout + result.stderr
    unpatched, overlap = result.stdout.strip().splitlines()[-2:]
    assert "has no 'forward_backward_func_wrapper' argument" in unpatched
    assert "scripts/apply_patches.sh MEGATRON_LM_DIR" in unpatched
    assert "--overlap-grad-reduce without --orch-post-balancing is not supported" in overlap


def _megatron_args(**changes):
    import argparse
    args = dict(dataloader_type="external", calculate_per_token_loss=True, virtual_pipeline_model_parallel_size=None,
                context_parallel_size=1, orch_microbatching="equal_count", transformer_impl="local",
                rampup_batch_size=None)
    return argparse.Namespace(**{**args, **changes})


def test_check_args_names_what_post_balancing_cannot_run_with():
    from megatron_orch.megatron import megatron_lm

    megatron_lm.check_args(_megatron_args())
    for changes, flag in ((dict(dataloader_type="single"), "--dataloader-type single"),
                          (dict(calculate_per_token_loss=False), "--calculate-per-token-loss is required"),
                          (dict(virtual_pipeline_model_parallel_size=2), "virtual pipeline stages"),
                          (dict(context_parallel_size=2), "--context-parallel-size 2"),
                          (dict(orch_microbatching="packed", transformer_impl="transformer_engine"),
                           "--orch-microbatching packed with --transformer-impl transformer_engine"),
                          (dict(rampup_batch_size=["4", "4", "100"]), "--rampup-batch-size")):
        with pytest.raises(ValueError, match=re.escape(flag)):
            megatron_lm.check_args(_megatron_args(**changes))


def test_patch_detection_by_signature():
    from megatron_orch.megatron import megatron_lm

    def stock(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, store=None):
        pass

    def patched(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, store=None,
                forward_backward_func_wrapper=None):
        pass

    assert megatron_lm.is_patched(patched) and not megatron_lm.is_patched(stock)
    megatron_lm.require_patched(patched)
    with pytest.raises(megatron_lm.PatchMissingError, match="scripts/apply_patches.sh MEGATRON_LM_DIR"):
        megatron_lm.require_patched(stock)


def _pretrain_runs(rank, world_size, tree, layouts, out_dir):
    """Megatron-LM's pretrain through pretrain_mllm.main_megatron_lm, once per run of each layout
    ``((tp, pp), runs)``, in these ranks; what each run did goes to ``out_dir/rank<r>.json``."""
    warnings.filterwarnings("ignore")
    doubles.install(Path(tree))
    spec = importlib.util.spec_from_file_location("pretrain_mllm", REPO / "pretrain_mllm.py")
    pretrain_mllm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain_mllm)
    results = {}
    for parallel, runs in layouts:
        for name in runs:
            run = _compact_run if name == COMPACT else _megatron_lm_run
            results.setdefault(str(parallel), {})[name] = run(pretrain_mllm, world_size, parallel, name)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


def _megatron_lm_run(pretrain_mllm, world_size, parallel, name) -> dict:
    """Per step: the schedule train() used, the items the plan moved between ranks, the global loss (last
    pipeline stage); and how often an encoder without items got zero gradients."""
    from megatron.training import training

    from megatron_orch.megatron import schedule
    from megatron_orch.megatron.schedule import ModalityAwareSchedule

    record = {"losses": [], "schedule": [], "moved_items": 0, "zero_gradients": 0}
    stock_train_step, stock_zero_gradients = training.train_step, schedule._zero_gradients

    def train_step(*args, **kwargs):  # positional as train() calls it: the schedule is the 7th
        out = stock_train_step(*args, **kwargs)
        schedule_used = args[6]
        record["schedule"].append(type(schedule_used).__name__)
        if isinstance(schedule_used, ModalityAwareSchedule):
            plan = schedule_used.last_step.plan
            for transfer in (plan.text_transfer(), *(plan.input_transfer(p) for p in plan.encoders)):
                traffic = transfer.traffic_matrix()
                record["moved_items"] += int(traffic.sum() - traffic.trace())
        if out[0]:
            record["losses"].append(float(out[0]["lm loss"]))
        return out

    def zero_gradients(encoder):
        record["zero_gradients"] += 1
        stock_zero_gradients(encoder)

    training.train_step, schedule._zero_gradients = train_step, zero_gradients
    doubles.prepare_run(*parallel, seed=SEED)
    sys.argv = ["pretrain_mllm.py", *ARGV, "--tensor-model-parallel-size", str(parallel[0]),
                "--pipeline-model-parallel-size", str(parallel[1]), *RUNS[name]]
    try:
        pretrain_mllm.main_megatron_lm()
    finally:
        training.train_step, schedule._zero_gradients = stock_train_step, stock_zero_gradients
        doubles.reset()
    return record


def _compact_run(pretrain_mllm, world_size, parallel, name) -> dict:
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, loop
    args = arguments.parse_args(COMPACT_ARGV + ["--tensor-model-parallel-size", str(parallel[0]),
                                                "--pipeline-model-parallel-size", str(parallel[1])],
                                world_size=world_size)
    try:
        return {"losses": [record.lm_loss for record in loop.pretrain(args, print_fn=lambda line: None)]}
    finally:
        parallel_state.destroy_model_parallel()


def _check_runs(out_dir: Path, world_size: int, parallel, runs) -> None:
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text())[str(parallel)] for r in range(world_size)]
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
        for name in balanced:
            assert rank[name]["schedule"] == ["ModalityAwareSchedule"] * ITERS, name
    for name in balanced:  # the plans moved examples between ranks
        assert sum(rank[name]["moved_items"] for rank in ranks) > 0, name


def test_megatron_training_dp2(patched_tree, tmp_path):
    layout = ((1, 1), [*RUNS, COMPACT])
    run_distributed(_pretrain_runs, 2, str(patched_tree), [layout], str(tmp_path), timeout_s=400)
    _check_runs(tmp_path, 2, *layout)
    overlapped = [json.loads((tmp_path / f"rank{r}.json").read_text())[str(layout[0])]
                  ["post-balancing, overlapped grad reduce"] for r in range(2)]
    # a rank without items of an encoder phase in some step gave that encoder zero gradients, which
    # --overlap-grad-reduce needs (every parameter reports each step)
    assert sum(r["zero_gradients"] for r in overlapped) > 0


def test_megatron_training_pp2_dp2_and_tp2_dp2(patched_tree, tmp_path):
    """Four ranks, two layouts one after the other in the same processes (saves starting them twice)."""
    layouts = [((1, 2), ["upstream", "post-balancing"]), ((2, 1), ["upstream", "post-balancing"])]
    run_distributed(_pretrain_runs, 4, str(patched_tree), layouts, str(tmp_path), timeout_s=500)
    for layout in layouts:
        _check_runs(tmp_path, 4, *layout)
