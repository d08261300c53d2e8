"""What a path names when it is not a regular file, for one-line messages (a FIFO or a folder named as an
image is said to be one, never "does not exist"; a folder without ``.nv-meta`` as ``--data-path`` too), and
where a media path leaving its dataset's folder resolves to. Plain Python: no torch
(``megatron_orch.mllm.task`` checks ``--data-path`` with it)."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

_KINDS = ((stat.S_ISDIR, "is a folder"), (stat.S_ISFIFO, "is a FIFO (named pipe)"), (stat.S_ISSOCK, "is a socket"),
          (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"))


def not_a_file(path) -> Optional[str]:
    """Why ``path`` is not a regular file to read (``"does not exist"``, ``"is a folder"``, ``"is a FIFO
    (named pipe)"``, ...), a symlink followed; None if it is one. Opens nothing (a FIFO would block)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a symlink to a missing file" if os.path.islink(path) else "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    for test, kind in _KINDS:
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "is not a regular file"


def outside_folder(path, folder) -> Optional[str]:
    """Where ``path`` resolves to (symlinks followed, ``..`` applied) when that is outside ``folder``;
    None if it stays inside."""
    root, real = os.path.realpath(folder), os.path.realpath(path)
    return None if os.path.commonpath([root, real]) == root else real


def data_path_problem(path) -> Optional[str]:
    """Why ``--data-path`` is neither a JSONL manifest (a file) nor an Energon dataset (a folder with
    ``.nv-meta``); None if it is one of them."""
    if (Path(path) / ".nv-meta").is_dir():
        return None
    problem = not_a_file(path)
    if problem == "does not exist":
        return "no such file (a JSONL manifest) or Energon dataset (a folder with .nv-meta)"
    if problem == "is a folder":
        return ("a folder without .nv-meta: not an Energon dataset (energon prepare writes .nv-meta), nor a JSONL "
                "manifest")
    return None if problem is None else f"{problem}: neither a JSONL manifest nor an Energon dataset"
