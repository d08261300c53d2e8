"""Train the tiny MLLM twice on the same data, post-balancing off (upstream) and on, and compare.

Prints, side by side per iteration: the losses (they must agree: post-balancing does not change what
the model learns), each phase's cost max/mean over DP before and after balancing, the iteration time,
and each phase's compute time per iteration as max/mean over ranks; writes everything as JSON.
Exits non-zero if a loss differs by more than the tolerance (default: fp32 reduction order; bf16
runs need a looser one, since encoders batch other items together and GEMMs round differently).

    python scripts/compare_baseline.py [--nproc 4] [--out runs/compare] [--rtol 1e-5] [-- extra pretrain_mllm.py flags]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_orch.trainer.training_log import parse_iteration_line  # noqa: E402

DEFAULT_FLAGS = ["--model-config", "tiny", "--seq-length", "256", "--micro-batch-size", "2",
                 "--global-batch-size", "32", "--train-iters", "20", "--lr", "1e-3", "--min-lr", "1e-4",
                 "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--weight-decay", "0.01",
                 "--clip-grad", "1.0", "--log-interval", "1", "--seed", "1234"]
BALANCING_FLAGS = ["--orch-post-balancing"]


def run(name: str, nproc: int, flags: list, out_dir: Path) -> list:
    """One torchrun launch; its log goes to out_dir/<name>.log; returns the parsed iteration lines."""
    log_path = out_dir / f"{name}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               str(REPO / "pretrain_mllm.py"), *flags]
    print(f"[compare] {name}: {' '.join(command[2:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    with open(log_path, "w") as log:
        result = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    lines = log_path.read_text().splitlines()
    if result.returncode != 0:
        sys.stderr.write("\n".join(lines[-40:]) + "\n")
        raise SystemExit(f"[compare] the {name} run failed (exit {result.returncode}); log: {log_path}")
    records = [r for r in map(parse_iteration_line, lines) if r is not None]
    if not records:
        raise SystemExit(f"[compare] the {name} run logged no iteration lines; log: {log_path}")
    return records


def check_flags(nproc: int, flags: list) -> None:
    """Check a run's command line once, as its ranks would, before any torchrun starts: a mistake ends the
    script with pretrain_mllm.py's one-line error (exit status 2) instead of a failed run's log."""
    env = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    result = subprocess.run([sys.executable, "-m", "megatron_orch.trainer.arguments", *flags], cwd=REPO, env=env)
    if result.returncode != 0:
        raise SystemExit(result.returncode)


def _ratio(pair) -> float:
    high, mean = pair
    return high / mean if mean > 0 else float("nan")


def table(baseline: list, balanced: list) -> str:
    rows = [f"{'iter':>4} | {'lm loss off':>12} {'lm loss on':>12} {'rel diff':>8} | "
            f"{'vision max/mean':>15} {'audio max/mean':>15} {'llm max/mean':>13} | "
            f"{'ms/iter off':>11} {'on':>7} | {'vision enc ms off':>17} {'on':>11} | {'audio enc ms off':>16} {'on':>11}"]
    for off, on in zip(baseline, balanced):
        pb = on["post_balancing"]
        rel = abs(on["lm_loss"] - off["lm_loss"]) / abs(off["lm_loss"])
        cells = [f"{off['iteration']:>4} | {off['lm_loss']:12.6f} {on['lm_loss']:12.6f} {rel:8.1e} |"]
        cells += [f"{pb[phase + ' before']:6.2f}->{pb[phase + ' after']:<6.2f}" + " " * (width - 14)
                  for phase, width in (("vision", 15), ("audio", 15), ("llm", 13))]
        cells.append(f"| {off['elapsed_ms']:11.1f} {on['elapsed_ms']:7.1f} |")
        for timer in ("vision-encoder-forward", "audio-encoder-forward"):
            t_off, t_on = off["time_ms"].get(timer), on["time_ms"].get(timer)
            fmt = lambda t: "-" if t is None else f"{t[0]:.1f}/{t[1]:.1f}"  # noqa: E731
            cells.append(f"{fmt(t_off):>{17 if timer[0] == 'v' else 16}} {fmt(t_on):>11} |")
        rows.append(" ".join(cells).rstrip(" |"))
    return "\n".join(rows)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=int(os.environ.get("NPROC", "4")),
                        help="processes (DP size with the default flags); default 4 or $NPROC")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare", help="logs and compare.json")
    parser.add_argument("--rtol", type=float, default=1e-5,
                        help="largest relative loss difference accepted (default 1e-5: fp32 on CPU)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="extra pretrain_mllm.py flags after --")
    args = parser.parse_args(argv)
    extra = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    for flags in (DEFAULT_FLAGS + extra, DEFAULT_FLAGS + extra + BALANCING_FLAGS):
        check_flags(args.nproc, flags)
    args.out.mkdir(parents=True, exist_ok=True)
    baseline = run("baseline", args.nproc, DEFAULT_FLAGS + extra, args.out)
    balanced = run("balanced", args.nproc, DEFAULT_FLAGS + extra + BALANCING_FLAGS, args.out)
    print(table(baseline, balanced))
    steps = len(balanced)
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    summary = {phase: {"before": mean([r["post_balancing"][f"{phase} before"] for r in balanced]),
                       "after": mean([r["post_balancing"][f"{phase} after"] for r in balanced])}
               for phase in ("vision", "audio", "llm")}
    exposed = mean([r["post_balancing"]["plan exposed ms"] for r in balanced[1:] or balanced])
    step_ms = mean([r["elapsed_ms"] for r in balanced[1:] or balanced])
    worst = max(abs(on["lm_loss"] - off["lm_loss"]) / abs(off["lm_loss"]) for off, on in zip(baseline, balanced))
    print(f"[compare] {steps} iterations: mean cost max/mean over DP before->after: "
          + ", ".join(f"{p} {v['before']:.2f}->{v['after']:.2f}" for p, v in summary.items()))
    print(f"[compare] exposed planning {exposed:.2f} ms of a {step_ms:.1f} ms step "
          f"({100 * exposed / step_ms:.2f}%, first step excluded: nothing to overlap with)")
    print(f"[compare] largest relative loss difference {worst:.1e} (tolerance {args.rtol:.0e})")
    (args.out / "compare.json").write_text(json.dumps(
        {"flags": DEFAULT_FLAGS + extra, "nproc": args.nproc, "baseline": baseline, "balanced": balanced,
         "imbalance": summary, "exposed_plan_ms": exposed, "step_ms": step_ms, "max_rel_loss_diff": worst,
         "rtol": args.rtol},
        indent=1))
    print(f"[compare] logs and compare.json in {args.out}")
    if len(baseline) != len(balanced) or not worst <= args.rtol:
        raise SystemExit("[compare] FAILED: post-balancing changed the losses")


if __name__ == "__main__":
    main()
