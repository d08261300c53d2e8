"""torchrun for the launch scripts: a failed run ends with the failing rank's one-line message.

A rank of a training entry point that fails passes its error to :func:`report_exception` (a bad command
line: :func:`report_failure`). Under torchrun the one-line message goes to the rank's error file
(``$TORCHELASTIC_ERROR_FILE``, torchrun's own channel for a child's root cause, which plain torchrun
quotes in its report); the rank also prints it, unless this launcher started it.

``python -m megatron_orch.trainer.launch TORCHRUN_ARGS... SCRIPT.py FLAGS...`` is torchrun with
its own log lines and report left out: when ranks fail it prints, last, each distinct message once with
the ranks that had it (a rank's own error, not the ranks that only quote it), after any rank that ended
by a signal without one (killed: out of memory?), and exits with the failing rank's status
(:func:`_exit_status`: 137 for a rank killed by SIGKILL, 1 for a rank's error). No Python
traceback is printed. ``ORCH_DEBUG=1`` asks for them: every rank's traceback and torchrun's report, as
plain torchrun prints them.

Importing this module imports neither torch nor megatron (the command-line check uses it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Dict, List, NoReturn, Optional, Sequence

DEBUG_ENV = "ORCH_DEBUG"
# Set by main() for the ranks it starts: it prints their messages, so they do not.
_LAUNCHER_ENV = "ORCH_LAUNCHER_REPORTS"


def debug() -> bool:
    """``ORCH_DEBUG=1``: tracebacks and torchrun's report instead of one line per failure."""
    return os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def one_line(error: BaseException) -> str:
    """The error's message on one line, as a command line says it (a setting by its flag:
    :func:`~megatron_orch.megatron.orch_arguments.flag_message`); with its type unless it is a ValueError or one
    of this project's errors (whose messages say what is wrong and where)."""
    from megatron_orch.megatron.orch_arguments import flag_message  # (numba: not at this light module's import)

    text = flag_message(error)
    if not (isinstance(error, ValueError) or type(error).__module__.startswith("megatron_orch")):
        text = f"{type(error).__name__}: {text}"
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def format_line(prog: str, message: str, ranks: Optional[List[int]] = None) -> str:
    """``prog: error: message``, or ``prog: error on rank(s) R: message`` for an error of some ranks."""
    if ranks is None:
        return f"{prog}: error: {message}"
    return f"{prog}: error on rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}: {message}"


def report_failure(prog: str, message: str, rank: Optional[int] = None, quoted: bool = False,
                   show: bool = True) -> None:
    """Report a rank's failure: to its torchrun error file, and to stderr unless the launcher prints it.

    ``rank`` None: an error every rank has alike (the command line), shown without a rank; ``quoted``: the
    rank only quotes another rank's error (:class:`~megatron_orch.comm.status.PeerFailedError`); ``show``
    False: write the error file only (ranks other than 0 of a command-line error).
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        report = {"prog": prog, "rank": rank, "quoted": quoted}
        data = {"message": {"message": message,
                            "extraInfo": {"timestamp": str(int(time.time())), "megatron_orch": report}}}
        try:
            with open(error_file, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # the message is still printed, or the launcher reports the exit status
    if show and not quoted and not os.environ.get(_LAUNCHER_ENV):
        print(format_line(prog, message, None if rank is None else [rank]), file=sys.stderr, flush=True)


def report_exception(prog: str, error: BaseException) -> None:
    """:func:`report_failure` for an exception raised on this rank (global rank from ``$RANK``)."""
    status = sys.modules.get("megatron_orch.comm.status")  # loaded, with torch, if a peer's error was quoted
    quoted = status is not None and isinstance(error, status.PeerFailedError)
    report_failure(prog, one_line(error), rank=int(os.environ.get("RANK", "0")), quoted=quoted)


def _silent_failures(failures: Dict[int, object], reports: Dict[int, dict]) -> Dict[int, int]:
    """``{rank: exit code}`` of the ranks that ended without a message, but for torchrun's SIGTERM to the
    others once one failed; every rank if all were stopped from outside."""
    silent = {rank: f.exitcode for rank, f in sorted(failures.items())
              if rank not in reports and f.exitcode != -signal.SIGTERM}
    if not reports and not silent:  # every rank was stopped from outside
        silent = {rank: f.exitcode for rank, f in sorted(failures.items())}
    return silent


def _reports(failures: Dict[int, object]) -> Dict[int, dict]:
    return {rank: _report(f) for rank, f in sorted(failures.items()) if _report(f) is not None}


def failure_lines(failures: Dict[int, object]) -> List[str]:
    """What the launcher prints for torchrun's failures (global rank -> ``ProcessFailure``)."""
    reports = _reports(failures)
    silent = _silent_failures(failures, reports)
    lines = []
    for code in sorted(set(silent.values())):
        ranks = [r for r, c in silent.items() if c == code]
        was = "were" if len(ranks) > 1 else "was"
        how = f"{was} killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        lines.append(f"torchrun: rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)} {how} without an error "
                     f"message{' (out of memory?)' if code == -signal.SIGKILL else ''} ({DEBUG_ENV}=1: tracebacks "
                     "and torchrun's report)")
    own = {rank: report for rank, report in reports.items() if not report["quoted"]}
    groups: Dict[tuple, List[int]] = {}
    for rank, report in (own or reports).items():
        groups.setdefault((report["prog"], report["message"], report["rank"] is not None), []).append(rank)
    for (prog, message, per_rank), ranks in groups.items():
        lines.append(format_line(prog, message, ranks if per_rank else None))
    return lines


def _exit_status(failures: Dict[int, object]) -> int:
    """The failing rank's status, as a shell reports it: a rank that ended without a message (killed, e.g.
    out of memory, or exited on its own) is the one named first, with 128 + the signal's number for a
    signal (137 for SIGKILL) or its exit status; else the ranks that reported their error: 1 (2 for a
    command-line error). Ranks torchrun stopped with SIGTERM after the failure do not count; all of them
    stopped from outside: 143."""
    reports = _reports(failures)
    silent = _silent_failures(failures, reports)
    if silent:
        code = silent[min(silent)]
        return 128 - code if code < 0 else (code or 1)
    return max([1] + [failures[rank].exitcode for rank in reports if failures[rank].exitcode > 1])


def _report(failure) -> Optional[dict]:
    """What :func:`report_failure` wrote to a rank's error file, with its ``message``; None if it did not."""
    data = failure.message
    report = data.get("extraInfo", {}).get("megatron_orch") if isinstance(data, dict) else None
    return None if report is None else {**report, "message": data["message"]}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(parts)


def _silence_torchrun() -> None:
    """torchrun's own log lines (a rank failed, SIGTERM sent to the others): the summary says it instead."""
    import logging
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """torchrun with the failing ranks' messages as the last lines (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from torch.distributed import run as torchrun
    if debug():
        torchrun.main(argv)
        sys.exit(0)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    os.environ[_LAUNCHER_ENV] = "1"
    args = torchrun.parse_args(argv)
    _silence_torchrun()
    try:
        torchrun.run(args)
    except ChildFailedError as failed:
        sys.stdout.flush()
        for line in failure_lines(failed.failures):
            print(line, file=sys.stderr, flush=True)
        sys.exit(_exit_status(failed.failures))
    sys.exit(0)


if __name__ == "__main__":
    main()
