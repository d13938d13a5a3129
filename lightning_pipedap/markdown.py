"""Generated blocks in hand-written Markdown files.

A generated block sits between a begin and an end marker line (HTML comments, invisible when
rendered); :func:`replace_between_markers` swaps the block and keeps the prose around it, so a
document can be regenerated without losing its hand-written parts.
"""

from __future__ import annotations

__all__ = ["MarkersMissingError", "replace_between_markers"]


class MarkersMissingError(ValueError):
    """The text lacks the begin or the end marker (raised only with ``append=False``)."""


def replace_between_markers(text: str, body: str, begin: str, end: str, *, append: bool = True) -> str:
    """Return ``text`` with ``begin``, ``body`` and ``end`` (one per line) in place of its marked block.

    Everything before the first ``begin`` and after the first ``end`` is kept. ``body`` loses its
    trailing whitespace. A text without the markers gets the block appended (after a blank line,
    or alone when ``text`` is blank), ending with a newline.

    Args:
        text: the document.
        body: the new content of the block.
        begin, end: the marker lines.
        append: what to do when a marker is missing: append the block (True) or raise (False).

    Raises:
        MarkersMissingError: a marker is missing and ``append`` is False.
        ValueError: the end marker comes before the begin marker.
    """
    block = f"{begin}\n{body.rstrip()}\n{end}"
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < 0:
        if not append:
            raise MarkersMissingError(f"the text has no {begin!r} ... {end!r} block")
        return (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    if j < i:
        raise ValueError(f"markers out of order: the end marker {end!r} precedes the begin marker {begin!r}")
    return text[:i] + block + text[j + len(end):]
