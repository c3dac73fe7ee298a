"""The code blocks of a Markdown page, and the commands of its shell blocks.

Used by ``tests/test_docs.py``, which runs every block of ``README.md`` and
``docs/*.md``. A block is a fenced block at the start of a line; its language is
the word after the opening fence. A block is skipped only when the line just
before it (blank lines aside) is an explicit marker: ``<!-- not run: reason -->``.

Example:
    >>> page = "Intro\\n\\n<!-- not run: needs a GPU -->\\n```bash\\nmeshplan train\\n```\\n"
    >>> [(b.lang, b.line, b.text, b.not_run) for b in blocks_of(page)]
    [('bash', 5, 'meshplan train\\n', 'needs a GPU')]
    >>> commands_of(Block("p.md", "console", 1, "$ meshplan plan\\nerror: x\\n"))
    [Command(argv=['meshplan', 'plan'], output=['error: x'], line=1)]
"""

from __future__ import annotations

import dataclasses
import re
import shlex

FENCE = re.compile(r"^```(\S*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.*?)\s*-->\s*$")
SHELL = ("console", "bash", "sh", "shell")
# A console line "$ cmd" or "host0$ cmd": the prompt is a word and a dollar.
PROMPT = re.compile(r"^(?:[\w.-]*)\$ (.*)$")


@dataclasses.dataclass
class Block:
    """One fenced block: its page, language, the line of its first content line, its text."""

    page: str
    lang: str
    line: int
    text: str
    not_run: str | None = None

    @property
    def first_line(self) -> str:
        """The block's first non-blank line (how a failure names it)."""
        return next((s.strip() for s in self.text.splitlines() if s.strip()), "")

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} (block starting {self.first_line!r})"

    @property
    def is_doctest(self) -> bool:
        return self.first_line.startswith(">>>")


@dataclasses.dataclass
class Command:
    """One command of a shell block, split like a shell would, and the output shown after it."""

    argv: list[str]
    output: list[str]
    line: int


def blocks_of(text: str, page: str = "<page>") -> list[Block]:
    """Every fenced block of a Markdown text, in order."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: a code block opened here is never closed")
        before = i - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = NOT_RUN.match(lines[before]) if before >= 0 else None
        body = "".join(line + "\n" for line in lines[start:end])
        not_run = None
        if marker:
            not_run = marker.group(1)
            if not not_run:
                raise ValueError(f"{page}:{before + 1}: a 'not run' marker must give its reason")
        blocks.append(Block(page, opening.group(1), start + 1, body, not_run))
        i = end + 1
    return blocks


def commands_of(block: Block) -> list[Command]:
    """The commands of a shell block.

    In a ``console`` block, commands are the lines after a prompt (``$ `` or
    ``host0$ ``) and the lines up to the next prompt are their output; in
    ``bash``/``sh`` blocks every line is a command. ``#`` starts a comment.
    """
    commands: list[Command] = []
    for offset, raw in enumerate(block.text.splitlines()):
        line = raw.rstrip()
        if block.lang == "console":
            prompt = PROMPT.match(line)
            if not prompt:
                if commands and line:
                    commands[-1].output.append(line)
                continue
            line = prompt.group(1)
        argv = shlex.split(line, comments=True)
        if argv:
            commands.append(Command(argv, [], block.line + offset))
    return commands
