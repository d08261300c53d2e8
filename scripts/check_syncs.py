"""Every host-device synchronisation of the training step, with where it comes from (CUDA only).

The torchrun target: runs pretrain_mllm.py's compact trainer with scripts/compare_baseline.py's default
flags (the tiny model) followed by the pretrain_mllm.py flags after ``--``, with
``megatron_orch.trainer.loop.train_step`` wrapped so that from step ``--from-step`` on (default 3: the
first steps allocate and warm up) each step runs under ``torch.cuda.set_sync_debug_mode("warn")``.
Every "called a synchronizing CUDA operation" warning is recorded with a short stack: the innermost
megatron_orch frames, and the frame that called into torch. Rank 0 prints a table of call sites with
counts and writes JSON (``--json``). A sync whose caller into torch is megatron_orch code is *ours*
(the hot path must have none); one made inside megatron-core (e.g. its optimizer's grad-norm
``.item()``) is listed as upstream's. The last line is PASSED (none of ours, except sites matching
``--allow``) or FAILED (exit status 1).

Without CUDA there is nothing to observe: the script says so and exits with status 2 (on CPU,
``tests/comm/test_comm_device.py`` checks the collectives' devices instead; ``gpu_check.sh --cpu`` runs it).

    python -m megatron_orch.trainer.launch --standalone --nproc-per-node 1 scripts/check_syncs.py \\
        --json syncs.json -- --global-batch-size 8 --train-iters 5 --log-interval 5 --bf16 --orch-post-balancing
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import compare_baseline  # noqa: E402  (scripts/: the default training flags; stdlib only at import)

PROG = "check_syncs.py"
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's sync debug warning (c10/cuda)


def parse_args(argv=None):
    """(our options, the pretrain_mllm.py flags after ``--``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0],
                                     usage=f"{PROG} [--json PATH] [--from-step N] [--allow TEXT]... "
                                           "-- pretrain_mllm.py flags")
    parser.add_argument("--json", type=Path, default=None, help="write the sync sites here (rank 0)")
    parser.add_argument("--from-step", type=int, default=3, help="first observed step (default 3)")
    parser.add_argument("--allow", action="append", default=[], metavar="TEXT",
                        help="a sync of ours whose caller into torch (file:line function) contains TEXT does not fail "
                             "the check (repeatable)")
    parser.add_argument("--frames", type=int, default=3, help="megatron_orch frames kept per stack (default 3)")
    args = parser.parse_args(ours)
    if args.from_step < 1 or args.frames < 1:
        parser.error("--from-step and --frames must be >= 1")
    return args, flags


def _frame(f) -> str:
    path = f.filename
    for root in ("megatron_orch/", "megatron/core/", "torch/"):
        if root in path:
            path = root + path.rsplit(root, 1)[1]
            break
    return f"{path}:{f.lineno} {f.name}"


class SyncRecorder:
    """Wraps a train_step: steps from ``from_step`` on run under the sync debug mode, each sync recorded."""

    def __init__(self, from_step: int, frames: int):
        self.from_step, self.frames = from_step, frames
        self.step = 0
        self.observed: list = []
        self.counts: Counter = Counter()
        self.sites: dict = {}

    def wrap(self, train_step):
        import torch

        def observed(*args, **kwargs):
            self.step += 1
            if self.step < self.from_step:
                return train_step(*args, **kwargs)
            torch.cuda.synchronize()  # the previous work's syncs are not this step's
            self.observed.append(self.step)
            with warnings.catch_warnings():
                warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
                shown = warnings.showwarning
                warnings.showwarning = lambda message, category, *rest: (
                    self.record() if SYNC_MESSAGE in str(message) else shown(message, category, *rest))
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return train_step(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        return observed

    def record(self) -> None:
        stack = [f for f in traceback.extract_stack()[:-1]
                 if not f.filename.endswith(("warnings.py", "check_syncs.py"))]
        ours = [f for f in stack if "megatron_orch" in f.filename]
        outside_torch = [f for f in stack if "/torch/" not in f.filename]
        caller = outside_torch[-1] if outside_torch else stack[-1]
        key = (" < ".join(_frame(f) for f in reversed(ours[-self.frames:])) or "(no megatron_orch frame)",
               _frame(caller), threading.current_thread().name)
        self.counts[key] += 1
        site = self.sites.setdefault(key, {"steps": Counter(), "stack": [_frame(f) for f in stack[-12:]]})
        site["steps"][self.step] += 1

    def report(self, allow) -> dict:
        sites = []
        for (where, caller, thread), count in self.counts.most_common():
            ours = "megatron_orch/" in caller
            sites.append({"site": where, "caller": caller, "thread": thread, "count": count, "ours": ours,
                          "allowed": ours and any(text in caller for text in allow),
                          "per_step": dict(self.sites[(where, caller, thread)]["steps"]),
                          "stack": self.sites[(where, caller, thread)]["stack"]})
        return {"observed_steps": self.observed, "syncs": sum(self.counts.values()), "sites": sites,
                "ours_not_allowed": sum(s["count"] for s in sites if s["ours"] and not s["allowed"])}


def main(argv=None) -> int:
    args, flags = parse_args(argv)
    from megatron_orch.trainer import launch
    if "RANK" not in os.environ:
        launch.report_failure(PROG, "not started by torchrun ($RANK is not set): python -m "
                                    "megatron_orch.trainer.launch --standalone --nproc-per-node 1 "
                                    "scripts/check_syncs.py -- FLAGS")
        return 2
    import torch
    if not torch.cuda.is_available():
        launch.report_failure(PROG, "cannot observe syncs: no CUDA device here (torch.cuda.set_sync_debug_mode "
                                    "reports CUDA synchronisations only); on CPU, tests/comm/test_comm_device.py "
                                    "checks the collectives' devices instead (gpu_check.sh --cpu runs it)",
                              show=os.environ.get("RANK") == "0")
        return 2
    import pretrain_mllm
    from megatron_orch.trainer import loop
    recorder = SyncRecorder(args.from_step, args.frames)
    loop.train_step = recorder.wrap(loop.train_step)
    flags = compare_baseline.DEFAULT_FLAGS + flags
    sys.argv = ["pretrain_mllm.py", *flags]
    pretrain_mllm.main()  # a failed run exits here with the trainer's one-line error
    report = recorder.report(args.allow)
    rank = int(os.environ["RANK"])
    steps = report["observed_steps"]
    headline = (f"{report['syncs']} syncs in {len(steps)} observed steps ({steps[0] if steps else '-'}-"
                f"{steps[-1] if steps else '-'}) at {len(report['sites'])} call sites; "
                f"{report['ours_not_allowed']} of them from megatron_orch code")
    if rank == 0:
        print(f"[syncs] {'count':>5} {'ours':>4}  site (innermost megatron_orch frames) | caller into torch | thread")
        for s in report["sites"]:
            mark = "yes" if s["ours"] and not s["allowed"] else ("ok" if s["allowed"] else "no")
            print(f"[syncs] {s['count']:>5} {mark:>4}  {s['site']} | {s['caller']} | {s['thread']}")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"flags": flags, **report, "headline": headline}, indent=1))
    if not steps:
        launch.report_failure(PROG, f"[syncs] FAILED: no step observed (--from-step {args.from_step} after "
                                    f"{recorder.step} steps)", show=rank == 0)
        return 1
    if report["ours_not_allowed"]:
        launch.report_failure(PROG, f"[syncs] FAILED: {headline}", show=rank == 0)
        return 1
    if rank == 0:
        print(f"[syncs] PASSED: {headline}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
