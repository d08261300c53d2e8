"""What a new user sees at launch: scripts that take their options, and one line per failure.

* The scripts parse their options (any order, ``--help``, unknown options refused before anything runs)
  and take paths relative to the caller's folder.
* ``python pretrain_mllm.py`` without torchrun says how to launch it.
* After the launch, a failing rank's error is one line, written to torchrun's error file;
  ``python -m megatron_orch.trainer.launch`` (what the launch scripts run) prints the failing ranks'
  messages last, once per message, with no Python traceback and no torchrun report unless
  ``ORCH_DEBUG=1``. End to end: a bad image on one rank, a save to a relative folder, a resume with
  nothing left to train.
"""
import itertools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dist_utils import scaled
from megatron_orch.trainer import launch

REPO = Path(__file__).resolve().parents[2]


def run(args, cwd=REPO, env_extra=None, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ORCH_DEBUG")}
    env.update({"MEGATRON_ORCH_SKIP_SETUP": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})})
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=scaled(timeout))


# ----------------------------------------------------------------------------------- script options

@pytest.mark.distributed
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_costs.sh"])
def test_device_scripts_take_options_in_any_order_and_refuse_unknown_ones(script, tmp_path):
    """Old code: `--cpu OUT` ran the GPU steps into a folder named --cpu, and --help made a folder --help."""
    path = str(REPO / "scripts" / script)
    helped = run(["bash", path, "--help"], cwd=tmp_path)
    assert helped.returncode == 0 and f"bash scripts/{script} --cpu OUT_DIR" in helped.stdout, helped
    for args, message in ((["--cpu", "--gpu", "out"], "unknown option --gpu"),
                          (["out", "more"], "one OUT_DIR only, got 'out' and 'more'"),
                          (["--cpu"], "OUT_DIR is missing")):
        refused = run(["bash", path, *args], cwd=tmp_path)
        assert refused.returncode == 2 and refused.stdout == "", refused
        assert refused.stderr.splitlines() == [refused.stderr.splitlines()[0]], refused.stderr
        assert refused.stderr.startswith(f"{script}: error: {message}"), refused.stderr
    assert list(tmp_path.iterdir()) == [], "a refused or --help run wrote something"


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_costs.sh"])
@pytest.mark.parametrize("mode", ["gpu", "cpu"])
def test_device_scripts_steps_fit_one_device_call(script, mode, tmp_path):
    """A dry run lists every step and its limit: on a GPU they add up to at most 540 s (a device call runs
    at most 600 s), no step is refused for the budget, and nothing is written. Old code: 12 and 11 files
    in OUT and limits adding up to 600 and 590 s."""
    out = tmp_path / "out"
    proc = run(["bash", str(REPO / "scripts" / script), *(["--cpu"] if mode == "cpu" else []), str(out)],
               cwd=tmp_path, env_extra={"ORCH_DEVICE_DRY_RUN": "1"})
    assert proc.returncode == 0 and proc.stderr == "", proc
    lines = proc.stdout.splitlines()
    steps = {line.split()[1]: int(line.split()[2]) for line in lines if line.startswith("step ")}
    budget = 540 if mode == "gpu" else 4400
    assert lines[-1] == f"total {sum(steps.values())} of {budget} s" and len(steps) == len(lines) - 1, lines
    assert "NOT RUN" not in proc.stdout and sum(steps.values()) <= budget
    if mode == "gpu" and script == "gpu_check.sh":
        assert set(steps) == {"env", "train_bf16", "train_fp32", "recompute_dropout", "syncs", "memory", "packed",
                              "alltoall", "resume", "fsdp", "moe", "sdpa_kernels", "context_parallel",
                              "encoder_layout"}, steps
    assert list(tmp_path.iterdir()) == [], "a dry run wrote something"


def _fake_device_script(tmp_path, steps: str) -> Path:
    """A device script of the given steps, on device_steps.sh as gpu_check.sh uses it."""
    script = tmp_path / "fake_check.sh"
    script.write_text("set -uo pipefail\n"
                      f'source {REPO}/scripts/cli.sh\ndevice_options "$@"\ncd {REPO}\n'
                      f"source scripts/device_steps.sh\n{steps}\nfinish\n")
    return script


@pytest.mark.distributed
def test_a_device_script_leaves_a_summary_and_one_tarball_of_its_logs(tmp_path):
    import tarfile
    script = _fake_device_script(tmp_path, 'step hello 10 bash -c "echo hi > $work/hello.txt; echo said hi"\n'
                                           'step broken 10 bash -c "echo about to fail; exit 3"\n'
                                           'summarize "hello: $(tail -n 1 $work/hello.txt)"')
    out = tmp_path / "out"
    proc = run(["bash", str(script), "--cpu", str(out)], cwd=tmp_path, env_extra={"PYTHON": sys.executable})
    assert proc.returncode == 1, proc
    assert sorted(p.name for p in out.iterdir()) == ["fake_check.tar.gz", "summary.txt"]
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[1].startswith("fake_check.sh (cpu): steps' limits 20 s of 4400 s"), summary
    assert summary[2:] == ["hello: hi", "FAILED: broken (exit 3)"], summary
    with tarfile.open(out / "fake_check.tar.gz") as tar:
        names = sorted(tar.getnames())
        assert names == ["fake_check", "fake_check/broken.log", "fake_check/hello.log", "fake_check/hello.txt",
                         "fake_check/summary.txt", "fake_check/summary_lines.txt"], names
        assert tar.extractfile("fake_check/broken.log").read().decode().splitlines() == [
            "about to fail", "== broken: exit 3 after 0 s (limit 10 s)"]

    over = _fake_device_script(tmp_path, "step first 300 true\nstep second 300 true")  # 600 s: over 540
    proc = run(["bash", str(over), str(tmp_path / "gpu_out")], cwd=tmp_path, env_extra={"PYTHON": sys.executable})
    assert proc.returncode == 1
    assert "== second: NOT RUN: its limit of 300 s would bring the steps to 600 s" in proc.stdout
    assert (tmp_path / "gpu_out" / "summary.txt").read_text().splitlines()[-1] == \
        "FAILED: second (not run: over the time budget)"


@pytest.mark.distributed
def test_device_options_resolve_out_dir_against_the_callers_folder(tmp_path):
    for args in (["--cpu", "rel/out"], ["rel/out", "--cpu"]):
        proc = run(["bash", "-c", f'source {REPO}/scripts/cli.sh; device_options "$@"; echo "$mode $out"', "x",
                    *args], cwd=tmp_path)
        assert proc.stdout.split() == ["cpu", f"{tmp_path}/rel/out"], proc
    proc = run(["bash", "-c", f'source {REPO}/scripts/cli.sh; device_options "$@"; echo "$mode $out"', "x",
                "/abs"], cwd=tmp_path)
    assert proc.stdout.split() == ["gpu", "/abs"], proc


@pytest.mark.distributed
def test_fetch_device_wheels_refuses_unknown_options(tmp_path):
    proc = run(["bash", str(REPO / "scripts" / "fetch_device_wheels.sh"), "--platform", "x"], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("fetch_device_wheels.sh: error: unknown option "
                                                           "--platform"), proc
    assert list(tmp_path.iterdir()) == []


@pytest.mark.distributed
def test_train_script_help_is_printed_once(tmp_path):
    """Old code: the help of the flag check, then of each torchrun rank (3 times, 642 lines)."""
    proc = run(["bash", str(REPO / "scripts" / "train_tiny_cpu.sh"), "--train-iters", "3", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc
    assert proc.stdout.count("usage: pretrain_mllm.py") == 1 and "--nproc N" in proc.stdout, proc.stdout[:2000]
    refused = run(["bash", str(REPO / "scripts" / "train_tiny_cpu.sh"), "--nproc", "two"], cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr == "train_tiny_cpu.sh: error: --nproc (or NPROC) must be a positive integer, got 'two'\n"


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["run_main.sh", "compare_baseline.sh"])
def test_compare_script_refuses_unknown_options(script, tmp_path):
    """run_main.sh -> compare_baseline.sh: checked by the standard library's argparse (before the set-up), the
    usage and the error naming the script run (old code: compare_baseline.py)."""
    proc = run(["bash", str(REPO / "scripts" / script), "--nproc", "2", "--train-iters", "3"], cwd=tmp_path)
    assert proc.returncode == 2, proc
    assert proc.stderr.splitlines()[-1].startswith(f"{script}: error: unrecognized arguments: --train-iters")
    helped = run(["bash", str(REPO / "scripts" / script), "--help"], cwd=tmp_path)
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {script} [-h] [--nproc NPROC]"), helped
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------- pretrain_mllm.py alone

@pytest.mark.distributed
def test_pretrain_without_torchrun_says_how_to_launch(tmp_path):
    """Old code: `environment variable RANK expected` from torch.distributed after 6 s."""
    proc = run([sys.executable, str(REPO / "pretrain_mllm.py"), "--train-iters", "2"], cwd=tmp_path, timeout=10)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith("pretrain_mllm.py: error: not started by torchrun ($RANK is not set): launch it "
                                  "with torchrun"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "torchrun --nproc-per-node N pretrain_mllm.py" in proc.stderr


def _load_pretrain_mllm():
    import importlib.util
    spec = importlib.util.spec_from_file_location("pretrain_mllm_under_test", REPO / "pretrain_mllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_rank_error_is_one_line_and_its_traceback_with_orch_debug(monkeypatch, capsys, tmp_path):
    pretrain_mllm = _load_pretrain_mllm()

    def fails():
        raise ValueError("data/x.jsonl:3: cannot read image x.png:\nimage file is truncated")

    monkeypatch.setattr(pretrain_mllm, "main_compact", fails)
    monkeypatch.setattr(pretrain_mllm, "megatron_lm_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["pretrain_mllm.py"])
    monkeypatch.setenv("RANK", "3")
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.delenv("ORCH_DEBUG", raising=False)
    with pytest.raises(SystemExit) as stopped:
        pretrain_mllm.main()
    assert stopped.value.code == 1
    assert capsys.readouterr().err == ("pretrain_mllm.py: error on rank 3: data/x.jsonl:3: cannot read image x.png: "
                                       "image file is truncated\n")
    report = json.loads(error_file.read_text())["message"]
    assert report["message"] == "data/x.jsonl:3: cannot read image x.png: image file is truncated"
    assert report["extraInfo"]["megatron_orch"] == {"prog": "pretrain_mllm.py", "rank": 3, "quoted": False}
    monkeypatch.setenv("ORCH_DEBUG", "1")
    with pytest.raises(ValueError, match="cannot read image"):
        pretrain_mllm.main()


def test_one_line_keeps_the_type_of_errors_that_need_it():
    assert launch.one_line(ValueError("a\n  b")) == "a b"
    assert launch.one_line(KeyError("vision")) == "KeyError: 'vision'"
    assert launch.one_line(MemoryError("out of memory")) == "MemoryError: out of memory"


# ---------------------------------------------------------------------------------- the launcher

_FILES = itertools.count()


def _failure(monkeypatch, tmp_path, rank, exitcode, message=None, report_rank="same", quoted=False):
    """torchrun's record of a failed rank, reading the error file report_failure wrote (if any)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    error_file = tmp_path / f"error_{next(_FILES)}.json"
    if message is not None:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
        launch.report_failure("pretrain_mllm.py", message, rank=rank if report_rank == "same" else report_rank,
                              quoted=quoted, show=False)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_launcher_prints_each_message_once_with_its_ranks(monkeypatch, tmp_path):
    f = lambda *a, **k: _failure(monkeypatch, tmp_path, *a, **k)  # noqa: E731
    same = {r: f(r, 1, "nothing left to train") for r in range(4)}
    assert launch.failure_lines(same) == ["pretrain_mllm.py: error on ranks 0-3: nothing left to train"]
    assert launch._exit_status(same) == 1
    # a command-line error is every rank's alike: no ranks named, argparse's status 2
    flags = {r: f(r, 2, "--lr must be > 0", report_rank=None) for r in range(2)}
    assert launch.failure_lines(flags) == ["pretrain_mllm.py: error: --lr must be > 0"]
    assert launch._exit_status(flags) == 2
    # the failing rank's own error, not the quotes of it; ranks torchrun stopped (SIGTERM) are not failures
    mixed = {0: f(0, 1, "reading failed on rank(s) [2]: ...", quoted=True), 1: f(1, -signal.SIGTERM),
             2: f(2, 1, "m.jsonl:4: cannot read image"), 3: f(3, -signal.SIGTERM, "m.jsonl:9: cannot read image")}
    assert launch.failure_lines(mixed) == ["pretrain_mllm.py: error on rank 2: m.jsonl:4: cannot read image",
                                           "pretrain_mllm.py: error on rank 3: m.jsonl:9: cannot read image"]
    # only quotes: they are shown (they name the failing rank)
    quotes = {0: f(0, 1, "failed on rank(s) [1]: ...", quoted=True), 1: f(1, -signal.SIGTERM)}
    assert launch.failure_lines(quotes) == ["pretrain_mllm.py: error on rank 0: failed on rank(s) [1]: ..."]


def test_launcher_names_ranks_that_ended_without_a_message_first(monkeypatch, tmp_path):
    f = lambda *a, **k: _failure(monkeypatch, tmp_path, *a, **k)  # noqa: E731
    killed = {0: f(0, 1, "iteration 3: a collective failed on rank 0 ..."), 1: f(1, -signal.SIGKILL)}
    lines = launch.failure_lines(killed)
    assert lines[0].startswith("torchrun: rank 1 was killed by SIGKILL without an error message (out of memory?)")
    assert lines[-1] == "pretrain_mllm.py: error on rank 0: iteration 3: a collective failed on rank 0 ..."
    assert launch._exit_status(killed) == 128 + signal.SIGKILL  # the killed rank's, not its peer's 1
    # torchrun's SIGTERM to the other ranks once one was killed: the killed rank's status, as the shell says it
    assert launch._exit_status({0: f(0, -signal.SIGTERM), 1: f(1, -signal.SIGKILL)}) == 137
    assert launch._exit_status({0: f(0, -signal.SIGTERM), 1: f(1, 3)}) == 3  # exited on its own, no message
    stopped = {0: f(0, -signal.SIGTERM), 1: f(1, -signal.SIGTERM)}  # from outside: said, though torchrun's own
    assert launch.failure_lines(stopped) == [
        "torchrun: ranks 0-1 were killed by SIGTERM without an error message (ORCH_DEBUG=1: tracebacks and "
        "torchrun's report)"]
    assert launch._exit_status(stopped) == 128 + signal.SIGTERM
    assert launch.rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


@pytest.mark.distributed
def test_the_launcher_exits_with_the_status_of_a_rank_killed_by_sigkill(tmp_path):
    """Rank 1 kills itself with SIGKILL (as the out-of-memory killer would) while rank 0 waits: torchrun
    stops rank 0 with SIGTERM; the launcher names rank 1 and exits with 137, a shell's status for SIGKILL."""
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(60)\n")
    proc = run([sys.executable, "-m", "megatron_orch.trainer.launch", "--standalone", "--nproc-per-node", "2",
                str(script)], cwd=tmp_path, env_extra={"PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 137, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.splitlines()[-1].startswith("torchrun: rank 1 was killed by SIGKILL without an error message "
                                                   "(out of memory?)"), proc.stderr[-2000:]
    _assert_no_report(proc)


# ---------------------------------------------------------------------------------- end to end

def _manifest(folder: Path, truncated: int = None) -> None:
    """8 one-image examples under folder/d; example ``truncated``'s PNG cut in half (its header reads)."""
    from PIL import Image
    (folder / "d" / "img").mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(8):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(folder / "d" / "img" / f"{i}.png")
    if truncated is not None:
        png = folder / "d" / "img" / f"{truncated}.png"
        png.write_bytes(png.read_bytes()[:png.stat().st_size // 2])
    (folder / "d" / "train.jsonl").write_text("".join(json.dumps({"text": f"example {i}", "images": [f"img/{i}.png"]})
                                                      + "\n" for i in range(8)))


TRAIN = ["bash", str(REPO / "scripts" / "train_tiny_cpu.sh"), "--train-iters", "1", "--lr-warmup-iters", "0",
         "--global-batch-size", "4", "--data-path", "d/train.jsonl"]


def _assert_no_report(proc):
    for noise in ("Traceback", "ChildFailedError", "Root Cause", "elastic", "[rank"):
        assert noise not in proc.stdout + proc.stderr, (noise, proc.stderr[-3000:])


@pytest.mark.distributed
def test_a_bad_image_on_one_rank_ends_the_launch_with_its_line(tmp_path):
    """Sample 3 (manifest line 4) is rank 1's in iteration 1 (DP 2, micro-batch 2); paths from tmp_path."""
    _manifest(tmp_path, truncated=3)
    proc = run(TRAIN, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == ("pretrain_mllm.py: error on rank 1: d/train.jsonl:4: cannot read image "
                                            "d/img/3.png: image file is truncated"), proc.stderr[-3000:]
    _assert_no_report(proc)


@pytest.mark.distributed
def test_saving_to_a_relative_folder_and_resuming_with_nothing_left(tmp_path):
    _manifest(tmp_path)
    saved = run(TRAIN + ["--save", "ck"], cwd=tmp_path, timeout=120)
    assert saved.returncode == 0, saved.stderr[-3000:]
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert "saving checkpoint at iteration       1 to ck" in saved.stdout, saved.stdout
    resumed = run(TRAIN + ["--load", "ck"], cwd=tmp_path, timeout=120)
    assert resumed.returncode == 1, resumed.stderr[-3000:]
    assert resumed.stderr.splitlines()[-1] == (
        "pretrain_mllm.py: error on ranks 0-1: nothing left to train: the checkpoint under --load ck is at "
        "iteration 1 and --train-iters is 1; raise --train-iters to train further, with "
        "--override-opt_param-scheduler (--train-iters is part of the LR schedule, which must otherwise match the "
        "checkpoint's)"), resumed.stderr[-3000:]
    _assert_no_report(resumed)
    # the hint followed: the next refusal (the LR schedule differs from the checkpoint's) does not come
    further = run(TRAIN + ["--load", "ck", "--train-iters", "2", "--override-opt_param-scheduler"], cwd=tmp_path,
                  timeout=120)
    assert further.returncode == 0, further.stderr[-3000:]
    assert "resumed from ck at iteration 1" in further.stdout and " iteration        2/       2 |" in further.stdout, \
        further.stdout[-3000:]


# ------------------------------------------------------------------------------ the main job's output

def _compare_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("compare_baseline_under_test", REPO / "scripts" / "compare_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(iteration, loss):
    pb = {f"{p} {w}": v for p in ("vision", "audio", "llm") for w, v in (("before", 1.5), ("after", 1.0))}
    return {"iteration": iteration, "lm_loss": loss, "elapsed_ms": 10.0,
            "time_ms": {"vision-encoder-forward": (2.0, 1.5)},
            "post_balancing": {**pb, "plan exposed ms": 0.0}}


@pytest.mark.parametrize("balanced_loss, last", [(6.9, "[compare] PASSED: the losses of all 2 iterations agree "
                                                       "within 1e-05"),
                                                 (6.8, "[compare] FAILED: post-balancing changed the losses")])
def test_the_main_job_says_what_its_columns_are_and_ends_with_passed_or_failed(monkeypatch, capsys, tmp_path,
                                                                               balanced_loss, last):
    compare = _compare_module()
    monkeypatch.setattr(compare, "check_flags", lambda nproc, flags: None)
    monkeypatch.setattr(compare, "run", lambda name, nproc, flags, out: [
        _record(1, 7.0), _record(2, 6.9 if name == "baseline" else balanced_loss)])
    if "PASSED" in last:
        compare.main(["--out", str(tmp_path)])
        lines = capsys.readouterr().out.splitlines()
    else:
        with pytest.raises(SystemExit) as stopped:
            compare.main(["--out", str(tmp_path)])
        lines = capsys.readouterr().out.splitlines() + [str(stopped.value.code)]
    assert lines[-1].startswith(last), lines
    assert lines[:2] == [f"[compare] {name}: checking its flags as its ranks will (importing torch and megatron-core, "
                         f"~7 s) ..." for name in ("baseline", "balanced")], lines[:2]
    header = lines[2]
    for group in ("lm loss off / on", "modeled cost max/mean over DP, before->after", "measured ms/iter",
                  "measured encoder forward ms, max/mean over ranks"):
        assert group in header, header
    assert "vision off" in lines[3] and "   1 |" in lines[4] and "2.0/1.5" in lines[4], lines[2:5]


def test_a_failed_run_of_the_main_job_ends_with_the_failing_ranks_line(monkeypatch, capsys, tmp_path):
    compare = _compare_module()
    import megatron_orch.trainer.training_log  # noqa: F401 -- what run() imports (megatron.core, which runs git
    # at import), before subprocess.run is replaced below; its warnings are not the run's output
    capsys.readouterr()

    class Launched:  # the launcher: its ranks failed
        def __init__(self, command, env, stdout, stderr):
            stdout.write(" iteration        1/      20 | ...\n[rank1]: noise\npretrain_mllm.py: error on rank 1: "
                         "m.jsonl:4: cannot read image\n")

        def wait(self, timeout):
            return 1

        def poll(self):
            return 1

    monkeypatch.setattr(compare.subprocess, "Popen", Launched)
    with pytest.raises(SystemExit) as stopped:
        compare.run("baseline", 2, [], tmp_path)
    assert stopped.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"[compare] FAILED: the baseline run failed (exit 1); its log: {tmp_path / 'baseline.log'}",
        "pretrain_mllm.py: error on rank 1: m.jsonl:4: cannot read image"]


def test_the_main_job_says_how_far_a_run_got_while_it_trains(monkeypatch, capsys, tmp_path):
    """Each run's output goes to its log: every PROGRESS_EVERY_S the script says the run's last iteration (or that
    its ranks are still starting), so it is never silent for long; a run still going when the script stops is
    killed."""
    compare = _compare_module()
    log = tmp_path / "baseline.log"
    waits, killed = [], []

    class Training:  # starts; then has logged iteration 3; then ends
        def wait(self, timeout):
            waits.append(timeout)
            if len(waits) == 2:
                log.write_text(" iteration        3/      20 | consumed samples:           96 | elapsed time per "
                               "iteration (ms): 250.0 | lm loss: 6.782458E+00 |\n")
            if len(waits) < 3:
                raise subprocess.TimeoutExpired("launch", timeout)
            return 0

        def poll(self):
            return 0 if len(waits) == 3 else None

        def kill(self):
            killed.append(True)

    log.write_text("")
    assert compare._wait_saying_progress("baseline", Training(), log) == 0
    said = capsys.readouterr().out.splitlines()
    assert waits == [compare.PROGRESS_EVERY_S] * 3 <= [10.0] * 3, waits
    assert [re.sub(r"\d+ s,", "N s,", line) for line in said] == [
        "[compare] baseline: N s, starting its ranks (imports, model and data set-up)",
        "[compare] baseline: N s, iteration 3 done"], said
    assert not killed

    class Interrupted(Training):  # the script is stopped (Ctrl-C) while the run trains
        def wait(self, timeout=None):
            if not killed:
                raise KeyboardInterrupt
            return -9

        def poll(self):
            return None

        def kill(self):
            killed.append(True)

    with pytest.raises(KeyboardInterrupt):
        compare._wait_saying_progress("baseline", Interrupted(), log)
    assert killed == [True]


@pytest.mark.distributed
def test_benchmarks_show_no_warnings_about_the_optional_gpu_packages():
    """Old code: 14 lines of Transformer Engine / Apex warnings before a benchmark's first line."""
    proc = run([sys.executable, "-m", "megatron_orch.bench.mfu", "--help"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "not installed" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
