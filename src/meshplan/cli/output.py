"""What the command line prints: text is always printed literally, never read as markup.

``rich`` reads ``[...]`` in a string as markup, so an error that says "Write a
list of [name, axes] pairs" would print as "Write a list of  pairs". Every
command prints user and library text through :func:`say` (styles are given
beside the text, never inside it), and errors through :func:`print_error`;
table cells are built with :func:`text`.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text

__all__ = ["Piece", "print_error", "say", "text"]

Piece = str | tuple[str, str] | Text
"""A piece of a line: literal text, ``(literal text, rich style)``, or a ``Text``."""


def text(*pieces: Piece) -> Text:
    """One ``Text`` of ``pieces``, each taken literally (``[`` is a bracket, not markup).

    Example:
        >>> from meshplan.cli.output import text
        >>> line = text(("error: ", "bold red"), "Write a list of [name, axes] pairs.")
        >>> line.plain
        'error: Write a list of [name, axes] pairs.'
    """
    out = Text()
    for piece in pieces:
        if isinstance(piece, Text):
            out.append_text(piece)
        elif isinstance(piece, tuple):
            out.append(str(piece[0]), style=piece[1])
        else:
            out.append(str(piece))
    return out


def say(console: Console, *pieces: Piece, **options: Any) -> None:
    """Prints ``pieces`` as one literal line (:func:`text`) on ``console``.

    ``options`` go to ``Console.print`` (e.g. ``soft_wrap=True``: no line
    breaks added at the console's width). Nothing is highlighted.

    Example:
        >>> from rich.console import Console
        >>> from meshplan.cli.output import say
        >>> say(Console(width=80), ("bold", "bold"), " [name, axes] [/] [red]")
        bold [name, axes] [/] [red]
    """
    console.print(text(*pieces), highlight=False, **options)


def print_error(error: Exception | str, console: Console | None = None) -> None:
    """Prints ``error: <message>`` to ``console`` (default: standard error), literally.

    No traceback; the message is printed whole, its lines unbroken.

    Example:
        >>> import sys
        >>> from rich.console import Console
        >>> from meshplan.cli.output import print_error
        >>> print_error(ValueError("Write a list of [name, axes] pairs."),
        ...             Console(file=sys.stdout, width=20))
        error: Write a list of [name, axes] pairs.
    """
    say(console or Console(stderr=True), ("error: ", "bold red"), str(error), soft_wrap=True)
