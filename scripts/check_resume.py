"""Checkpoint save and resume: a resumed run trains exactly as the run that never stopped.

Trains the tiny MLLM three times on the same data (scripts/compare_baseline.py's launch and flags):
``straight`` runs ``--iters`` iterations; ``first_half`` runs the same schedule but stops after half of
them (``--exit-interval``) and saves (``--save``); ``resumed`` loads that checkpoint (``--load``) and
trains to the end. The resumed iterations' losses and grad norms (as the iteration lines print them)
must equal the straight run's exactly (``--rtol`` 0); the first half against the straight run is the
control: if it differs too, the device is not deterministic run to run and resume is not to blame.
Writes ``resume.json`` in ``--out`` (the checkpoint is removed at the end unless
``--keep-checkpoint``); the last line is PASSED or FAILED (exit status 1). gloo with 2 ranks on CPU,
NCCL with 1 on one GPU (``-- --distributed-backend nccl``). Paths are relative to the current folder.

    python scripts/check_resume.py [--nproc 2] [--iters 6] [--out runs/resume] [-- extra pretrain_mllm.py flags]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import compare_baseline  # noqa: E402  (scripts/: its run() launches and parses a training run)

_GRAD_NORM = re.compile(r"\| grad norm: ([-+0-9.eEnaif]+) \|")


def _figures(records: list, log: Path) -> dict:
    """iteration -> (lm loss, grad norm) of a run, the grad norms read from its log's iteration lines."""
    norms = [float(m.group(1)) for m in map(_GRAD_NORM.search, log.read_text().splitlines())
             if m and re.match(r"\s*iteration\s+\d+/", m.string)]
    if len(norms) != len(records):
        norms = [None] * len(records)
    return {r["iteration"]: (r["lm_loss"], norm) for r, norm in zip(records, norms)}


def _worst(a: dict, b: dict, iterations) -> float:
    """Largest relative difference of loss and grad norm over ``iterations`` (inf if one is missing)."""
    worst = 0.0
    for it in iterations:
        if it not in a or it not in b:
            return float("inf")
        for x, y in zip(a[it], b[it]):
            if x is not None and y is not None:
                worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (DP size); default 2")
    parser.add_argument("--iters", type=int, default=6, help="iterations of the straight run (even, >= 2)")
    parser.add_argument("--out", type=Path, default=Path("runs") / "resume", help="logs, checkpoint, resume.json")
    parser.add_argument("--rtol", type=float, default=0.0, help="largest relative difference accepted (default 0)")
    parser.add_argument("--keep-checkpoint", action="store_true",
                        help="keep OUT/checkpoint (default: removed at the end, so that OUT stays small)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="extra pretrain_mllm.py flags after --")
    args = parser.parse_args(argv)
    if args.iters < 2 or args.iters % 2:
        parser.error(f"--iters must be even and >= 2, got {args.iters}")
    extra = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    half, ckpt = args.iters // 2, args.out.resolve() / "checkpoint"
    common = compare_baseline.DEFAULT_FLAGS + ["--global-batch-size", "8"] + extra + [
        "--train-iters", str(args.iters), "--log-interval", "1"]
    runs = {"straight": common, "first_half": common + ["--exit-interval", str(half), "--save", str(ckpt)],
            "resumed": common + ["--load", str(ckpt)]}
    for flags in runs.values():
        compare_baseline.check_flags(args.nproc, flags)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)
    figures = {name: _figures(compare_baseline.run(name, args.nproc, flags, args.out), args.out / f"{name}.log")
               for name, flags in runs.items()}
    if not args.keep_checkpoint:
        shutil.rmtree(ckpt, ignore_errors=True)
    resumed_its = range(half + 1, args.iters + 1)
    control = _worst(figures["straight"], figures["first_half"], range(1, half + 1))
    resumed = _worst(figures["straight"], figures["resumed"], resumed_its)
    print(f"[resume] {'iter':>4} {'straight loss':>14} {'resumed loss':>14} {'straight norm':>14} {'resumed norm':>14}")
    for it in range(1, args.iters + 1):
        s = figures["straight"].get(it, (None, None))
        r = (figures["resumed"] if it > half else figures["first_half"]).get(it, (None, None))
        print(f"[resume] {it:>4} " + " ".join(f"{v!s:>14}" for v in (s[0], r[0], s[1], r[1])))
    result = {"nproc": args.nproc, "iters": args.iters, "flags": common, "rtol": args.rtol,
              "figures": {name: {str(k): v for k, v in f.items()} for name, f in figures.items()},
              "max_rel_diff_resumed": resumed, "max_rel_diff_first_half": control}
    (args.out / "resume.json").write_text(json.dumps(result, indent=1))
    where = f"iterations {half + 1}-{args.iters} resumed from the checkpoint of iteration {half}"
    if not resumed <= args.rtol:
        cause = ("; the first half differs as well (max rel {control:.1e}): the runs are not deterministic, "
                 "resume may not be to blame" if control > args.rtol else "; the first half agrees: resume is")
        raise SystemExit(f"[resume] FAILED: {where}: losses/grad norms differ from the straight run by up to "
                         f"{resumed:.1e} (tolerance {args.rtol:g}){cause.format(control=control)}")
    print(f"[resume] PASSED: {where}: losses and grad norms equal the straight run's (max rel diff {resumed:.1e}, "
          f"tolerance {args.rtol:g}; first half {control:.1e})")


if __name__ == "__main__":
    main()
