"""Bad input a new user meets first, each refused with one clear error before anything runs or is written:
flags out of range or inconsistent, a missing model config or manifest, a bad manifest, bad trace rows;
and how ``pretrain_mllm.py`` and the launch scripts report it (one line, exit status 2, before torch loads).
"""
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_utils import scaled
from megatron_orch.balance.traces import NUMERIC_COLUMNS, TEXT_COLUMNS, Trace, load_trace
from megatron_orch.megatron.orch_arguments import flag_setting
from megatron_orch.trainer import arguments
from megatron_orch.mllm.task import MLLM_TASK

REPO = Path(__file__).resolve().parents[2]
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "2",
          "--lr", "1e-3", "--distributed-backend", "gloo"]
BALANCED = ["--orch-post-balancing"]


def parse(*flags, world_size=1):
    return arguments.parse_args(MLLM_TASK, COMMON + list(flags), world_size=world_size)


# ------------------------------------------------------------------------------------------------ flags

@pytest.mark.parametrize("phases", ["", " , "])
def test_orch_phases_must_name_a_phase(phases):
    with pytest.raises(arguments.ArgumentError, match="--orch-phases must name at least one phase"):
        parse(*BALANCED, "--orch-phases", phases)


def test_orch_phases_are_the_models_phase_names():
    with pytest.raises(arguments.ArgumentError, match="--orch-phases: the model has no phase 'video'; its phases "
                                                      "are vision,audio,llm"):
        parse(*BALANCED, "--orch-phases", "vision,video")
    assert parse(*BALANCED).orch_config.phases is None  # every phase of the model
    three = ["--model-config", "tiny_video"]
    assert parse(*three, *BALANCED, "--orch-phases", "video,llm").orch_config.phases == ("video", "llm")


def test_orch_gpus_per_node_must_fit_the_launch(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(arguments.ArgumentError, match="--orch-gpus-per-node 3 does not divide the world size 4"):
        parse(*BALANCED, "--orch-gpus-per-node", "3", world_size=4)
    assert parse(*BALANCED, "--orch-gpus-per-node", "2", world_size=4).orch_config.gpus_per_node == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(arguments.ArgumentError, match=r"--orch-gpus-per-node 2 disagrees with the 4 processes "
                                                      r"torchrun started on this node \(LOCAL_WORLD_SIZE\)"):
        parse(*BALANCED, "--orch-gpus-per-node", "2", world_size=4)
    assert parse(*BALANCED, "--orch-gpus-per-node", "4", world_size=4).orch_config.gpus_per_node == 4


@pytest.mark.parametrize("flag, value", [("--orch-placement", "exact"), ("--orch-placement", "greedy"),
                                         ("--orch-algorithm", "auto"), ("--orch-microbatching", "auto"),
                                         ("--orch-placement-time-limit", "1"), ("--orch-locality", None)])
def test_an_orch_flag_given_without_the_switch_is_refused_even_at_its_default(flag, value):
    """Old code: --orch-placement exact (its default) without --orch-post-balancing was accepted, greedy refused."""
    given = [flag] + ([value] if value is not None else [])
    with pytest.raises(arguments.ArgumentError, match=f"^{flag} given without --orch-post-balancing"):
        parse(*given)
    assert parse(*BALANCED, *given).orch_config is not None


def test_the_orch_flags_defaults_apply_when_not_given():
    assert parse().orch_config is None
    args = parse(*BALANCED)
    config = args.orch_config
    assert (config.algorithm, config.microbatching, config.placement, config.placement_time_limit_s) == \
        ("auto", "auto", "exact", 1.0)
    assert (args.orch_algorithm, args.orch_microbatching, args.orch_placement, args.orch_placement_time_limit) == \
        ("auto", "auto", "exact", 1.0)  # as a checkpoint records them, given or not


@pytest.mark.parametrize("flags, message", [
    (["--lr", "nan"], "--lr must be a finite number in [0, inf), got nan"),
    (["--lr=-1e-3"], "--lr must be a finite number in [0, inf)"),
    (["--min-lr", "inf"], "--min-lr must be a finite number"),
    (["--clip-grad=-1"], "--clip-grad must be a finite number in [0, inf)"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--adam-beta2", "1"], "--adam-beta2 must be a finite number in [0, 1)"),
    (["--adam-eps", "0"], "--adam-eps must be a finite number in (0, inf)"),
    (["--hidden-dropout", "nan"], "--hidden-dropout must be a finite number in [0, 1)"),
    (["--max-image-pixels", "0"], "--max-image-pixels must be >= 1"),
    (["--max-num-tiles", "0"], "--max-num-tiles must be >= 1"),
    (["--max-audio-seconds", "inf"], "--max-audio-seconds must be a finite number in (0, inf)"),
    (["--max-vision-items-per-sample=-2"], "--max-vision-items-per-sample must be >= 1"),
    (BALANCED + ["--orch-placement-time-limit", "nan"], "--orch-placement-time-limit must be > 0, got nan"),
    (["--distributed-timeout-minutes", "nan"], "--distributed-timeout-minutes must be a finite number > 0, got nan"),
    (["--distributed-timeout-minutes", "0"], "--distributed-timeout-minutes must be a finite number > 0"),
    (["--model-config", "no_such_config"], "--model-config no_such_config: model config 'no_such_config' not found"),
    (["--data-path", "no/such/manifest.jsonl"], "--data-path no/such/manifest.jsonl: no such file"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--micro-batch-size", "two"], "argument --micro-batch-size: invalid int value: 'two'"),
])
def test_flags_out_of_range_are_named(flags, message):
    with pytest.raises(arguments.ArgumentError) as raised:
        parse(*flags)
    assert message in str(raised.value)


@pytest.mark.parametrize("flags, world_size, message", [
    (["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--context-parallel-size", "2", "--seq-length", "130"], 2,
     "--seq-length 130 is not a multiple of 2 x --context-parallel-size 2 = 4"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2", "--seq-length",
      "132"], 4, "--seq-length 132 is not a multiple of 2 x --context-parallel-size 2 x --tensor-model-parallel-size "
                 "2 (--sequence-parallel) = 8"),
    (["--context-parallel-size", "2"], 3, "world size 3 is not divisible by --tensor-model-parallel-size (1) x "
                                          "--pipeline-model-parallel-size (1) x --context-parallel-size (2) = 2"),
    (["--context-parallel-size", "0"], 1, "--context-parallel-size must be >= 1"),
    (["--context-parallel-size", "2", "--distributed-backend", "nccl", "--transformer-impl", "local"], 2,
     "--context-parallel-size 2 on GPUs runs Transformer Engine's context-parallel attention"),
    (["--max-position-embeddings", "100"], 1, "--seq-length 128 exceeds the backbone's max_position_embeddings (100)"),
])
def test_parallel_layout_flags_are_checked(flags, world_size, message):
    with pytest.raises(arguments.ArgumentError) as raised:
        parse(*flags, world_size=world_size)
    assert message in str(raised.value)


def test_layout_flags_set_the_data_parallel_size_and_the_backbone():
    args = parse("--tensor-model-parallel-size", "2", "--sequence-parallel", "--context-parallel-size", "2",
                 "--max-position-embeddings", "512", world_size=8)
    assert (args.data_parallel_size, args.sequence_parallel, args.context_parallel_size) == (2, True, 2)
    assert args.mllm_config.backbone.max_position_embeddings == 512
    assert args.orch_config is None and parse(*BALANCED, "--context-parallel-size", "2", world_size=2) \
        .orch_config.context_parallel_size == 2


def test_required_flags_are_an_argument_error():
    with pytest.raises(arguments.ArgumentError, match="the following arguments are required: --seq-length"):
        arguments.parse_args(MLLM_TASK, ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1"], world_size=1)


# ------------------------------------------------------------------------------------------------ traces

def write_trace(path: Path, rows: list) -> Path:
    header = TEXT_COLUMNS + NUMERIC_COLUMNS
    lines = [",".join(header)] + [",".join(str(r.get(c, "")) for c in header) for r in rows]
    text = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


GOOD_ROWS = [dict(task="image_sft", vision_tiles=t, text_tokens=40 + t) for t in range(1, 50)]


@pytest.mark.parametrize("value, problem", [("-3", "-3.0 is negative"), ("nan", "nan is not finite"),
                                            ("inf", "inf is not finite"), ("12x", "'12x' is not a number")])
def test_trace_rows_are_checked_when_loaded(tmp_path, monkeypatch, value, problem):
    monkeypatch.setenv("MEGATRON_ORCH_CACHE", str(tmp_path / "cache"))
    rows = [dict(r) for r in GOOD_ROWS]
    rows[36]["text_tokens"] = value
    path = write_trace(tmp_path / "bad.csv.gz", rows)
    with pytest.raises(ValueError, match=rf"{path}: row 37 \(line 38\), column 'text_tokens': {problem}"):
        load_trace(str(path))
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.npz"))


def test_traces_built_from_rows_are_checked():
    with pytest.raises(ValueError, match=r"trace 't': row 2, column 'audio_sec': -1.0 is negative"):
        Trace.from_rows("t", [{"audio_sec": 1.0}, {"audio_sec": -1.0}])


def test_balance_benchmark_refuses_a_bad_row_it_would_never_draw(tmp_path, monkeypatch, capsys):
    """One example drawn from 200 rows: the bad last row is (almost surely) not drawn, and still refused."""
    from megatron_orch.bench.balance import main

    monkeypatch.setenv("MEGATRON_ORCH_CACHE", str(tmp_path / "cache"))
    rows = [dict(task="asr", audio_sec=1.0 + i, text_tokens=5) for i in range(200)]
    rows[-1]["text_tokens"] = -7
    write_trace(tmp_path / "asr.csv", rows)
    out = tmp_path / "bench.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--trace", "asr.csv", "--traces-dir", str(tmp_path), "--dp", "1", "--per-rank", "1",
              "--gpus-per-node", "1", "--model", "tiny", "--repeats", "1", "--json", str(out)])
    assert exit_info.value.code == 2
    assert not out.exists()
    printed = capsys.readouterr()
    assert printed.out == ""
    assert re.search(r"asr.csv: row 200 \(line 201\), column 'text_tokens': -7.0 is negative", printed.err)


# -------------------------------------------------------------------------------------- pretrain_mllm.py

@pytest.fixture(scope="module")
def no_torch(tmp_path_factory):
    """A PYTHONPATH entry whose ``torch`` fails to import: what runs with it must not need torch."""
    root = tmp_path_factory.mktemp("no_torch")
    (root / "torch").mkdir()
    (root / "torch" / "__init__.py").write_text("raise ImportError('torch was imported before the command line "
                                                "was checked')\n")
    return root


def run_script(args, env_extra=None, pythonpath=(), timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(REPO)])
    env.update(env_extra or {})
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(timeout))


@pytest.mark.parametrize("flags, message", [
    (BALANCED + ["--orch-phases", ""], "--orch-phases must name at least one phase"),
    (["--model-config", "missing.yaml"], "--model-config missing.yaml: model config 'missing.yaml' not found"),
    (["--data-path", "missing.jsonl"], "--data-path missing.jsonl: no such file"),
    (["--tensor-model-parallel-sise", "2"], "unrecognized arguments: --tensor-model-parallel-sise 2"),
])
@pytest.mark.distributed
def test_pretrain_errors_are_one_line_from_rank_0_before_torch_loads(no_torch, tmp_path, flags, message):
    save = tmp_path / "checkpoints"
    argv = [sys.executable, "pretrain_mllm.py", *COMMON, "--save", str(save), *flags]
    for rank in ("0", "1"):
        proc = run_script(argv, {"RANK": rank, "WORLD_SIZE": "2"}, pythonpath=[no_torch])
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == ""
        if rank == "0":
            assert proc.stderr.splitlines() == [f"pretrain_mllm.py: error: {proc.stderr.split('error: ', 1)[1]}"
                                                .rstrip("\n")], proc.stderr
            assert message in proc.stderr
        else:
            assert proc.stderr == ""
    assert not save.exists()


def test_a_bad_manifest_is_one_line_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    """The manifest is read, line by line, right after the flags: no model, no process group."""
    import pretrain_mllm
    from megatron_orch.mllm import providers
    from megatron_orch.trainer import loop

    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "a", "image": ["x.png"]}) + "\n")

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the manifest was checked")

    monkeypatch.setattr(providers, "build_model", refuse)
    monkeypatch.setattr(loop, "initialize", refuse)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exited:
        pretrain_mllm.main_compact(COMMON + ["--data-path", str(manifest)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"pretrain_mllm.py: error: {manifest}:2: unknown keys ['image']; allowed: "
                                "['audio', 'images', 'prompt', 'sizes', 'text']"]


@pytest.mark.distributed
def test_launch_script_ends_with_the_error(no_torch):
    """scripts/train_tiny_cpu.sh checks the command line once before torchrun: the user's last line is the
    error (not torchrun's report of failed ranks), exit status 2, and torch was never needed for it."""
    proc = run_script(["bash", "scripts/train_tiny_cpu.sh", *BALANCED, "--orch-phases", ""],
                      {"MEGATRON_ORCH_SKIP_SETUP": "1", "NPROC": "2"}, pythonpath=[no_torch])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("pretrain_mllm.py: error: --orch-phases must name"), \
        proc.stderr
    assert "torch.distributed" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.distributed
def test_launch_script_checks_with_the_launch_world_size(no_torch):
    proc = run_script(["bash", "scripts/train_tiny_cpu.sh", "--global-batch-size", "6"],
                      {"MEGATRON_ORCH_SKIP_SETUP": "1", "NPROC": "4"}, pythonpath=[no_torch])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "pretrain_mllm.py: error: --global-batch-size 6 is not divisible by --micro-batch-size (2) x "
        "data-parallel size (4) = 8"]


@pytest.mark.distributed
def test_compare_script_checks_both_runs_before_torchrun(tmp_path):
    """scripts/compare_baseline.py (run_main.sh, gpu_check.sh) checks the baseline's and the balanced run's
    command lines first: a mistake is its last line, exit status 2, and no output folder is made."""
    out = tmp_path / "compare"
    proc = run_script([sys.executable, "scripts/compare_baseline.py", "--nproc", "2", "--out", str(out), "--",
                       "--lr", "nan"], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("pretrain_mllm.py: error: --lr must be a finite number in "
                                                     "[0, inf), got nan")
    said = proc.stdout.splitlines()  # what it was checking, and nothing launched
    assert said and all(line.startswith("[compare] ") and "checking its flags" in line for line in said), said
    assert not out.exists()


@pytest.mark.distributed
def test_compare_script_compares_the_flags_it_is_given(monkeypatch, capsys, tmp_path):
    """--compare-flags: what the second run adds (default post-balancing), checked and launched as given;
    the table and the JSON name the runs by it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("compare_under_test", REPO / "scripts" / "compare_baseline.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    checked, launched = [], {}
    monkeypatch.setattr(compare, "check_flags", lambda nproc, flags: checked.append(flags))

    def run(name, nproc, flags, out):
        launched[name] = flags
        return [{"iteration": 1, "lm_loss": 7.0, "elapsed_ms": 10.0, "time_ms": {},
                 "post_balancing": {**{f"{p} {w}": 1.0 for p in ("vision", "audio", "llm")
                                       for w in ("before", "after")}, "plan exposed ms": 0.0}}]

    monkeypatch.setattr(compare, "run", run)
    extra = ["--orch-post-balancing", "--hidden-dropout", "0.1"]
    compare.main(["--out", str(tmp_path), "--compare-flags=--orch-encoder-recompute --seed 7", "--", *extra])
    out = capsys.readouterr().out
    assert list(launched) == ["without", "with"] and checked == list(launched.values())
    assert launched["without"] == compare.DEFAULT_FLAGS + extra
    assert launched["with"] == compare.DEFAULT_FLAGS + extra + ["--orch-encoder-recompute", "--seed", "7"]
    lines = out.splitlines()
    runs = next(i for i, line in enumerate(lines) if line.startswith("[compare] runs: "))
    assert "lm loss without / with (must agree)" in lines[runs + 1], out
    assert "with = also --orch-encoder-recompute --seed 7" in out
    assert out.splitlines()[-1].startswith("[compare] PASSED")
    result = json.loads((tmp_path / "compare.json").read_text())
    assert result["run_names"] == ["without", "with"] and result["compare_flags"][0] == "--orch-encoder-recompute"

    launched.clear()
    compare.main(["--out", str(tmp_path)])  # the default: upstream against post-balancing
    assert launched == {"baseline": compare.DEFAULT_FLAGS,
                        "balanced": compare.DEFAULT_FLAGS + ["--orch-post-balancing"]}
    assert "lm loss off / on (must agree)" in capsys.readouterr().out
    for argv, message in ((["--compare-flags", "--orch-encoder-recompute"], "expected one argument"),
                          (["--compare-flags="], "--compare-flags is empty")):
        proc = run_script([sys.executable, "scripts/compare_baseline.py", "--parse-only", *argv])
        assert proc.returncode == 2 and message in proc.stderr.splitlines()[-1], proc.stderr


def test_the_flag_tables_of_docs_training_are_the_parsers():
    """docs/training.md's flag tables are generated from the compact trainer's parser: they list every flag it
    accepts, and a flag added, removed or re-documented without regenerating them fails here."""
    import runpy

    from megatron_orch.trainer.arguments import build_parser

    flags_doc = runpy.run_path(str(REPO / "scripts" / "flags_doc.py"), run_name="flags_doc")
    doc = flags_doc["DOC"].read_text()
    assert flags_doc["render"](doc) == doc, "docs/training.md's flag tables are stale: run python scripts/flags_doc.py"
    tables = doc.split(flags_doc["BEGIN"], 1)[1]
    for action in build_parser(MLLM_TASK)._actions:
        if action.option_strings and "-h" not in action.option_strings:
            assert f"`{action.option_strings[0]}`" in tables, action.option_strings


def test_encoders_on_every_stage_are_refused_where_they_do_not_fit_one_gpu():
    """--orch-encoder-ranks all against --orch-gpu-memory-gb: the per-GPU model (tiny: a few MB) refused in one
    line naming the bytes while the flags are checked, before any process group exists; fits above them."""
    every = [*BALANCED, "--orch-encoder-ranks", "all", "--pipeline-model-parallel-size", "2"]
    with pytest.raises(arguments.ArgumentError, match=r"^--orch-encoder-ranks all does not fit --orch-gpu-memory-gb "
                                                      r"\(0\.0 GB\): pipeline stage 0's GPUs need 0\.\d GB = "
                                                      "parameters"):
        parse(*every, "--orch-gpu-memory-gb", "0.001", world_size=4)
    assert parse(*every, "--orch-gpu-memory-gb", "80", world_size=4).orch_config.encoders_on_every_stage
    with pytest.raises(arguments.ArgumentError, match="--orch-gpu-memory-gb must be > 0, got 0.0"):
        parse(*every, "--orch-gpu-memory-gb", "0", world_size=4)


def test_encoder_ranks_auto_is_all_where_it_differs_runs_and_fits_else_first_stage():
    """--orch-encoder-ranks auto (the default), decided while the flags are checked: all with PP 2 where it fits
    --orch-gpu-memory-gb (or nothing to check it against: no GPU here), also with Megatron DDP's overlapped reduction
    and the distributed optimizer, and with context parallelism; first-stage where it does not fit, where the layout
    does not run it (an encoder TP that does not divide TP) or where it would be the same layout (PP 1); never refused. The decided value
    is what args and a checkpoint record."""
    pp2 = [*BALANCED, "--pipeline-model-parallel-size", "2"]
    for flags, ranks, reason in [
            (pp2, "all", r"over DP x 2 pipeline stages x 1 encoder replica .*; per-GPU memory not checked"),
            (pp2 + ["--orch-gpu-memory-gb", "80"], "all", r"; fits --orch-gpu-memory-gb 80 \(per-GPU memory model\)"),
            (pp2 + ["--orch-gpu-memory-gb", "0.001"], "first-stage",
             r"--orch-encoder-ranks all does not fit --orch-gpu-memory-gb \(0\.0 GB\)"),
            (pp2 + ["--overlap-grad-reduce", "--use-distributed-optimizer"], "all", r"over DP x 2 pipeline stages"),
            (pp2 + ["--context-parallel-size", "2"], "all", r"over DP x 2 pipeline stages"),
            (pp2 + ["--tensor-model-parallel-size", "2", "--orch-encoder-tensor-parallel-size", "3"], "first-stage",
             r"--orch-encoder-tensor-parallel-size 3 does not divide the backbone's tensor-parallel size 2"),
            (BALANCED, "first-stage", r"one pipeline stage")]:
        args = parse(*flags, world_size=4)
        decision = args.encoder_ranks_decision
        assert (args.orch_config.encoder_ranks.value, args.orch_encoder_ranks, decision.ranks.value) == (ranks,) * 3
        line = decision.line(flag_setting)
        assert decision.asked.value == "auto" and re.search(reason, line), line
    assert parse(*pp2, "--orch-encoder-ranks", "first-stage", world_size=4).encoder_ranks_decision.reason == "as asked"
