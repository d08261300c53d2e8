"""Train the tiny MLLM twice on the same data, post-balancing off (upstream) and on, and compare.

Prints, side by side per iteration: the losses (they must agree: post-balancing does not change what
the model learns), each phase's modeled cost (the planner's FLOPs) as max/mean over DP ranks before and
after balancing, and the measured times: the iteration, and each encoder's forward as max/mean over
ranks; writes everything as JSON. The last line is PASSED, or FAILED if a loss differs by more than the
tolerance (default: fp32 reduction order; bf16 runs need a looser one, since encoders batch other items
together and GEMMs round differently). Paths are relative to the current folder.

``--compare-flags`` says what the second run adds (default ``--orch-post-balancing``), so the same script
compares any two settings that must not change the losses, e.g. encoder recompute on and off with dropout,
post-balancing in both runs (give it with ``=``, since its value starts with ``--``)::

    python scripts/compare_baseline.py --compare-flags=--orch-encoder-recompute -- --orch-post-balancing \
        --hidden-dropout 0.1 --attention-dropout 0.1

    python scripts/compare_baseline.py [--nproc 4] [--out runs/compare] [--rtol 1e-5] [--compare-flags=FLAGS]
                                       [-- extra pretrain_mllm.py flags]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_FLAGS = ["--model-config", "tiny", "--seq-length", "256", "--micro-batch-size", "2",
                 "--global-batch-size", "32", "--train-iters", "20", "--lr", "1e-3", "--min-lr", "1e-4",
                 "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--weight-decay", "0.01",
                 "--clip-grad", "1.0", "--log-interval", "1", "--orch-log-level", "1", "--seed", "1234",
                 # dropout masks follow the rank that computes an example: off, the two runs agree exactly
                 "--hidden-dropout", "0", "--attention-dropout", "0"]
BALANCING_FLAGS = "--orch-post-balancing"  # what the second run adds, by default
# What the launcher (megatron_orch.trainer.launch) prints last when ranks fail.
_FAILURE_PREFIXES = ("pretrain_mllm.py: error", "torchrun: rank")
PROGRESS_EVERY_S = 10.0  # while a run trains (its output goes to its log), a line this often says how far it got


def run(name: str, nproc: int, flags: list, out_dir: Path) -> list:
    """One torchrun launch; its log goes to out_dir/<name>.log; returns the parsed iteration lines."""
    from megatron_orch.trainer.training_log import parse_iteration_line  # imports torch: not for --help
    log_path = out_dir / f"{name}.log"
    command = [sys.executable, "-m", "megatron_orch.trainer.launch", "--standalone", "--nproc-per-node", str(nproc),
               str(REPO / "pretrain_mllm.py"), *flags]
    print(f"[compare] {name}: {' '.join(command[2:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    with open(log_path, "w") as log:
        returncode = _wait_saying_progress(name, subprocess.Popen(command, env=env, stdout=log,
                                                                  stderr=subprocess.STDOUT), log_path)
    lines = log_path.read_text().splitlines()
    if returncode != 0:
        errors = [line for line in lines if line.startswith(_FAILURE_PREFIXES)] or lines[-40:]
        sys.stderr.write(f"[compare] FAILED: the {name} run failed (exit {returncode}); its log: {log_path}\n"
                         + "\n".join(errors) + "\n")
        raise SystemExit(1)
    records = [r for r in map(parse_iteration_line, lines) if r is not None]
    if not records:
        raise SystemExit(f"[compare] FAILED: the {name} run logged no iteration lines; its log: {log_path}")
    return records


def _wait_saying_progress(name: str, process: subprocess.Popen, log_path: Path) -> int:
    """Wait for a run, every :data:`PROGRESS_EVERY_S` saying how far it got (from its log's iteration lines), so
    the script is never silent for long; stop the run if this script is stopped. Returns its exit status."""
    from megatron_orch.trainer.training_log import parse_iteration_line
    start = time.monotonic()
    try:
        while True:
            try:
                return process.wait(timeout=PROGRESS_EVERY_S)
            except subprocess.TimeoutExpired:
                records = [r for r in map(parse_iteration_line, log_path.read_text().splitlines()) if r is not None]
                done = (f"iteration {records[-1]['iteration']} done" if records
                        else "starting its ranks (imports, model and data set-up)")
                print(f"[compare] {name}: {time.monotonic() - start:.0f} s, {done}", flush=True)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def check_flags(nproc: int, flags: list) -> None:
    """Check a run's command line once, as its ranks would, before any torchrun starts: a mistake ends the
    script with pretrain_mllm.py's one-line error (exit status 2) instead of a failed run's log."""
    env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    result = subprocess.run([sys.executable, "-m", "megatron_orch.mllm.task", *flags], env=env)
    if result.returncode != 0:
        raise SystemExit(result.returncode)


def _pair(t) -> str:
    return "-" if t is None else f"{t[0]:.1f}/{t[1]:.1f}"


def _cost(record: dict, key: str) -> str:
    figures = record["post_balancing"]
    return "-" if figures is None else f"{figures[key]:.2f}"


# The table's column groups: (title, [(column, width, cell(baseline record, balanced record))]).
# off = the first run (default: upstream, post-balancing off), on = the second (the --compare-flags added).
_COLUMNS = [
    ("lm loss {off} / {on} (must agree)", [
        ("off", 12, lambda off, on: f"{off['lm_loss']:.6f}"),
        ("on", 12, lambda off, on: f"{on['lm_loss']:.6f}"),
        ("rel diff", 8, lambda off, on: f"{abs(on['lm_loss'] - off['lm_loss']) / abs(off['lm_loss']):.1e}")]),
    ("modeled cost max/mean over DP, before->after", [
        (phase, 12, lambda off, on, p=phase: f"{_cost(on, p + ' before')}->{_cost(on, p + ' after')}")
        for phase in ("vision", "audio", "llm")]),
    ("measured ms/iter", [
        ("off", 7, lambda off, on: f"{off['elapsed_ms']:.1f}"),
        ("on", 7, lambda off, on: f"{on['elapsed_ms']:.1f}")]),
    ("measured encoder forward ms, max/mean over ranks", [
        (f"{phase} {run}", 11, lambda off, on, t=f"{phase}-encoder-forward", r=run:
         _pair((off if r == "off" else on)["time_ms"].get(t)))
        for phase in ("vision", "audio") for run in ("off", "on")]),
]


def table(baseline: list, balanced: list, names=("off", "on")) -> str:
    """Two header lines (column groups, then columns), then one row per iteration; ``names``: what the
    first title calls the two runs."""
    titles = [title.format(off=names[0], on=names[1]) for title, _ in _COLUMNS]
    widths = [sum(width + 1 for _, width, _ in columns) - 1 for _, columns in _COLUMNS]
    widths = [max(w, len(title)) for w, title in zip(widths, titles)]

    def row(first: str, cells: list) -> str:
        return " | ".join([f"{first:>4}", *(f"{cell:>{w}}" for cell, w in zip(cells, widths))]).rstrip()

    def group(columns, texts, width) -> str:
        return " ".join(f"{t:>{w}}" for (_, w, _), t in zip(columns, texts)).rjust(width)

    rows = [row("", [f"{title:<{w}}" for title, w in zip(titles, widths)]),
            row("iter", [group(columns, [c for c, _, _ in columns], w) for (_, columns), w in zip(_COLUMNS, widths)])]
    for off, on in zip(baseline, balanced):
        rows.append(row(str(off["iteration"]), [group(columns, [cell(off, on) for _, _, cell in columns], w)
                                                for (_, columns), w in zip(_COLUMNS, widths)]))
    return "\n".join(rows)


def main(argv=None) -> None:
    # the script the user ran names itself in usage and errors (run_main.sh, compare_baseline.sh set it)
    parser = argparse.ArgumentParser(prog=os.environ.get("ORCH_SCRIPT_NAME") or None,
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NPROC", "4")),
                        help="processes (DP size with the default flags); default 4 or $NPROC")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare", help="logs and compare.json")
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="largest relative loss difference accepted (default 1e-5: fp32 on CPU)")
    parser.add_argument("--compare-flags", default=BALANCING_FLAGS, metavar="FLAGS",
                        help="pretrain_mllm.py flags the second run adds (one string, give it as "
                             f"--compare-flags=FLAGS); default {BALANCING_FLAGS}")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="extra pretrain_mllm.py flags after --")
    parser.add_argument("--parse-only", action="store_true", help=argparse.SUPPRESS)  # compare_baseline.sh
    args = parser.parse_args(argv)
    compare = shlex.split(args.compare_flags)
    if not compare:
        parser.error("--compare-flags is empty: the two runs would be the same")
    if args.parse_only:  # the options are fine (checked with the standard library only, before the set-up)
        return
    from megatron_orch import quiet_megatron_core_warnings
    quiet_megatron_core_warnings()  # before training_log imports megatron-core
    extra = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    default = args.compare_flags == BALANCING_FLAGS
    # The runs' names (logs, table): upstream vs balanced, or without vs with the compared flags.
    first, second = ("baseline", "balanced") if default else ("without", "with")
    for name, flags in ((first, DEFAULT_FLAGS + extra), (second, DEFAULT_FLAGS + extra + compare)):
        print(f"[compare] {name}: checking its flags as its ranks will (importing torch and megatron-core, ~7 s) ...",
              flush=True)
        check_flags(args.nproc, flags)
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = run(first, args.nproc, DEFAULT_FLAGS + extra, args.out)
    balanced = run(second, args.nproc, DEFAULT_FLAGS + extra + compare, args.out)
    if not default:
        print(f"[compare] runs: {first} = the flags of both, {second} = also {args.compare_flags}")
    print(table(baseline, balanced, ("off", "on") if default else (first, second)))
    steps = len(balanced)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    step_ms = mean([r["elapsed_ms"] for r in balanced[1:] or balanced])
    summary, exposed = None, None
    if balanced[0]["post_balancing"] is not None:  # the second run balances
        summary = {phase: {"before": mean([r["post_balancing"][f"{phase} before"] for r in balanced]),
                           "after": mean([r["post_balancing"][f"{phase} after"] for r in balanced])}
                   for phase in ("vision", "audio", "llm")}
        exposed = mean([r["post_balancing"]["plan exposed ms"] for r in balanced[1:] or balanced])
        print(f"[compare] {steps} iterations, modeled cost max/mean over DP (mean of the iterations), before->after "
              "balancing: " + ", ".join(f"{p} {v['before']:.2f}->{v['after']:.2f}" for p, v in summary.items()))
        print(f"[compare] measured exposed planning {exposed:.2f} ms of a {step_ms:.1f} ms step "
              f"({100 * exposed / step_ms:.2f}%, first step excluded: nothing to overlap with)")
    worst = max(abs(on["lm_loss"] - off["lm_loss"]) / abs(off["lm_loss"]) for off, on in zip(baseline, balanced))
    print(f"[compare] largest relative loss difference {worst:.1e} (tolerance {args.rtol:.0e})")
    (args.out / "compare.json").write_text(json.dumps(
        {"flags": DEFAULT_FLAGS + extra, "compare_flags": compare, "run_names": [first, second],
         "nproc": args.nproc, "baseline": baseline, "balanced": balanced,
         "imbalance": summary, "exposed_plan_ms": exposed, "step_ms": step_ms, "max_rel_loss_diff": worst,
         "rtol": args.rtol},
        indent=1))
    print(f"[compare] logs and compare.json in {args.out.resolve()}")
    if len(baseline) != len(balanced) or not worst <= args.rtol:
        what = "post-balancing" if default else args.compare_flags
        raise SystemExit(f"[compare] FAILED: {what} changed the losses (largest relative difference "
                         f"{worst:.1e} > tolerance {args.rtol:.0e})" if len(baseline) == len(balanced) else
                         f"[compare] FAILED: {len(baseline)} {first} and {len(balanced)} {second} iterations")
    print(f"[compare] PASSED: the losses of all {steps} iterations agree within {args.rtol:.0e}")


if __name__ == "__main__":
    main()
