"""The docs, the scripts (whose header comments and docstrings are their --help) and the package describe the
code as it is: no build-history wording ("now the default", "before this", "the defaults then", ...) and no
issue numbers, which mean nothing to a reader of the repository."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Phrases that date a statement to a change instead of describing the code (each a regex, case-insensitive).
BUILD_HISTORY = (r"\bnow the default\b", r"\bdefault now\b", r"\bthe default is now\b", r"\bbefore this\b",
                 r"\bdefaults? then\b", r"\bpreviously\b", r"\bformerly\b", r"\bformer default\b",
                 r"\bold (tests?|code|behaviou?r)\b", r"\bthe code before\b", r"\s\(before\)", r"\bno longer part of\b",
                 r"\bissues? \d+")
FILES = ("README.md", "docs/*.md", "patches/README.md", "scripts/*", "megatron_orch/**/*.py", "pretrain_mllm.py",
         "setup.py")


def hits(text: str) -> list:
    return [match.group(0) for pattern in BUILD_HISTORY for match in re.finditer(pattern, text, re.IGNORECASE)]


def test_no_build_history_wording():
    found = [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, text.lower().find(hit.lower())) + 1}: {hit}"
             for path in sorted({p for pattern in FILES for p in REPO.glob(pattern) if p.is_file()})
             for text in [path.read_text(errors="replace")] for hit in hits(text)]
    assert not found, found


def test_the_patterns_catch_what_they_are_for():
    assert hits("packed backbone, now the default; equal_count: the defaults then (issues 8, 18)") == [
        "now the default", "defaults then", "issues 8"]
    assert hits("held no longer than upstream holds them; as the data is now") == []
