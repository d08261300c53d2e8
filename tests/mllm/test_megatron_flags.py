"""The audit of Megatron-LM's flags on the MLLM's Megatron-LM launch (``megatron_orch.mllm.megatron_flags``):
every flag of the installed release's parser (``megatron.training.arguments``: the 0.19.2 wheel's, or
core_v0.16.1's from ``../shared/megatron-lm``) is read by the model, read by megatron.training's loop, unable to
change the math, or refused by name, exactly one of these; a flag of a new release that is none of them fails
here. Every refused flag is refused when it differs from Megatron-LM's default, naming its option, and the
launch refuses with one line before anything is initialised (no process group).

The parser is built in a subprocess (``megatron_lm_doubles.install``: the 0.16.1 files need a triton stub).
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_lm_doubles as doubles
from dist_utils import scaled
from test_megatron_lm import README_FLAGS

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import copy, json, pathlib, sys
sys.path.insert(0, 'tests')
import megatron_lm_doubles as doubles
tree, readme = sys.argv[1], json.loads(sys.argv[2])
doubles.install(pathlib.Path(tree) if tree else None)
from megatron_orch.megatron.megatron_lm import POST_BALANCING_REFUSALS
from megatron_orch.mllm import megatron_flags as flags
from megatron_orch.mllm.task import add_mllm_args

class Changed:
    def __repr__(self):
        return 'changed'

megatron = {action.dest for action in flags.megatron_lm_parser(lambda parser: parser)._actions} - {'help'}
parser = flags.megatron_lm_parser(add_mllm_args)
base = parser.parse_args(['--calculate-per-token-loss'])
each = {}
for dest in sorted(set(flags.REFUSED) & megatron):
    args = copy.copy(base)
    setattr(args, dest, Changed())
    each[dest] = flags.refusals_of(args, parser)
options = {}
for action in parser._actions:
    options.setdefault(action.dest, []).extend(action.option_strings)
print(json.dumps({
    'megatron': sorted(megatron), 'classes': {name: sorted(names) for name, names in flags.classes().items()},
    'post_balancing': list(POST_BALANCING_REFUSALS), 'base': flags.refusals_of(base, parser), 'each': each,
    'options': options, 'readme': flags.refusals(readme, add_mllm_args),
    'command_line': flags.refusals(['--swiglu', '--moe-router-score-function', 'sigmoid', '--vocab-size', '512',
                                    '--model-config', 'tiny'], add_mllm_args),
    'moe': flags.refusals(readme + ['--num-experts', '4', '--moe-router-topk', '2', '--moe-ffn-hidden-size', '32',
                                    '--expert-model-parallel-size', '2', '--moe-router-load-balancing-type',
                                    'seq_aux_loss', '--moe-aux-loss-coeff', '1e-2', '--moe-z-loss-coeff', '1e-3',
                                    '--moe-token-dispatcher-type', 'alltoall', '--use-megatron-fsdp'], add_mllm_args)}))
"""


@pytest.fixture(scope="module")
def audit():
    files = doubles.megatron_lm_files_or_skip()
    tree = "" if files.on_path else str(files.root)
    result = subprocess.run([sys.executable, "-c", PROBE, tree, json.dumps(README_FLAGS)], cwd=REPO,
                            capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.distributed
def test_every_flag_of_the_installed_parser_is_in_exactly_one_class(audit):
    classes = {name: set(names) for name, names in audit["classes"].items()}
    unclassified = [dest for dest in audit["megatron"] if not any(dest in names for names in classes.values())]
    assert not unclassified, f"Megatron-LM flags in no class of megatron_orch.mllm.megatron_flags: {unclassified}"
    names = list(classes)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            assert not classes[first] & classes[second], (first, second, sorted(classes[first] & classes[second]))
    # post-balancing's own refusals are settings upstream runs with (read) or refused already
    present = set(audit["post_balancing"]) & set(audit["megatron"])
    assert present <= set(audit["classes"]["read by megatron.training"]) | set(audit["classes"]["read by the model"]) \
        | set(audit["classes"]["refused"]), sorted(present)


@pytest.mark.distributed
def test_every_refused_flag_is_refused_by_name_when_it_differs_from_the_default(audit):
    assert audit["base"] == [], audit["base"]  # Megatron-LM's defaults and --calculate-per-token-loss: nothing refused
    assert audit["each"], "no refused flag in this release's parser"
    for dest, problems in audit["each"].items():
        assert len(problems) == 1, (dest, problems)
        option = problems[0].split(" ", 1)[0]
        assert option in audit["options"][dest] and option.startswith("--"), (dest, problems)
        assert problems[0].startswith(f"{option} (changed): "), problems


@pytest.mark.distributed
def test_a_command_line_is_refused_flag_by_flag(audit):
    assert audit["readme"] == [], audit["readme"]  # the README's launch line trains
    problems = audit["command_line"]
    assert [p.split(" ", 1)[0] for p in problems] == ["--moe-router-score-function", "--swiglu",
                                                      "--calculate-per-token-loss", "--vocab-size"], problems
    assert "MoE backbone" in problems[0] and "architecture comes from --model-config" in problems[1]
    assert "vocab_size 1024" in problems[3]
    # an MoE backbone's shape, expert parallelism, losses and dispatcher are read, and so is sharding
    assert audit["moe"] == [], audit["moe"]


@pytest.mark.distributed
def test_the_launch_refuses_in_one_line_before_any_collective():
    """main_megatron_lm with a refused flag: one line naming it, from parsing alone (no process group exists)."""
    files = doubles.megatron_lm_files_or_skip()
    tree = None if files.on_path else str(files.root)
    code = ("import sys, pathlib, runpy; sys.path.insert(0, 'tests'); import megatron_lm_doubles as d\n"
            f"d.install(None if {tree!r} is None else pathlib.Path({tree!r}))\n"
            "import torch.distributed as dist\n"
            "main = runpy.run_path('pretrain_mllm.py', run_name='pretrain_mllm')['main_megatron_lm']\n"
            f"sys.argv = ['pretrain_mllm.py', *{README_FLAGS!r}, '--swiglu', '--normalization', 'RMSNorm']\n"
            "try:\n"
            "    main()\n"
            "except SystemExit as exit:\n"
            "    print(repr(exit.code)); print('initialised:', dist.is_initialized())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=scaled(300))
    assert result.returncode == 0, result.stdout + result.stderr
    *_, code, initialised = result.stdout.strip().splitlines()
    assert initialised == "initialised: False"
    line = ast.literal_eval(code)
    assert line.startswith("pretrain_mllm.py: error: --normalization ('RMSNorm'): the MLLM's architecture"), line
    assert "; --swiglu (True): " in line and "\n" not in line


# Megatron-LM's sequence-packing scheduler (train_step re-packs each step and passes its own num_microbatches to the
# schedule): in Megatron-LM from PR #6742 (head 095c361), in no release's parser nor main's at d98e8a6.
PACKING_SCHEDULER_FLAGS = (["--sequence-packing-scheduler", "dp_balanced"], ["--use-varlen-dataset"])


@pytest.mark.distributed
def test_the_upstream_packing_scheduler_is_refused_with_post_balancing_before_any_collective():
    """main_megatron_lm with --orch-post-balancing and Megatron-LM's packing scheduler stops before any process
    group exists: where the installed parser has the flag, with one line naming it and saying why; where it has
    none (the releases, main before PR #6742), with Megatron-LM's own parser error naming it."""
    files = doubles.megatron_lm_files_or_skip()
    tree = None if files.on_path else str(files.root)
    code = ("import json, sys, pathlib, runpy; sys.path.insert(0, 'tests'); import megatron_lm_doubles as d\n"
            f"d.install(None if {tree!r} is None else pathlib.Path({tree!r}))\n"
            "import torch.distributed as dist\n"
            "from megatron_orch.mllm import megatron_flags\n"
            "options = megatron_flags.megatron_lm_parser(lambda parser: parser)._option_string_actions\n"
            "main = runpy.run_path('pretrain_mllm.py', run_name='pretrain_mllm')['main_megatron_lm']\n"
            f"for flag in {PACKING_SCHEDULER_FLAGS!r}:\n"
            f"    sys.argv = ['pretrain_mllm.py', *{README_FLAGS!r}, '--orch-post-balancing', *flag]\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit as exit:\n"
            "        print(json.dumps([flag[0] in options, exit.code, dist.is_initialized()]))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=scaled(300))
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = [json.loads(line) for line in result.stdout.strip().splitlines() if line.startswith("[")]
    assert len(outcomes) == len(PACKING_SCHEDULER_FLAGS), result.stdout + result.stderr
    for flag, (known, code, initialised) in zip(PACKING_SCHEDULER_FLAGS, outcomes):
        assert not initialised, flag
        if not known:  # argparse's error (status 2), on stderr
            assert code == 2 and f"unrecognized arguments: {' '.join(flag)}" in result.stderr, (flag, code)
            continue
        assert code.startswith(f"pretrain_mllm.py: error: {flag[0]} ("), code
        assert "two balancers would move the same examples" in code and "\n" not in code, code


@pytest.mark.distributed
def test_every_flag_of_the_installed_parser_is_taken_or_explained_by_the_compact_trainer(audit):
    """On ``--orch-trainer compact`` each of the installed release's Megatron-LM options is a flag of the compact
    trainer or refused with a reason (never argparse's bare "unrecognized arguments")."""
    from megatron_orch.mllm.task import MLLM_TASK
    from megatron_orch.trainer import arguments
    parser = arguments.build_parser(MLLM_TASK)
    known = parser._option_string_actions
    unexplained = [option for dest in audit["megatron"] for option in audit["options"][dest]
                   if option.startswith("--") and option not in known
                   and "is not implemented by the compact trainer" not in arguments.unknown_flags(
                       [option], known, MLLM_TASK.explain_flag)]
    assert not unexplained, unexplained
