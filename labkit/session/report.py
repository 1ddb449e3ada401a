"""What a cell on the ranks gave back, as the learner reads it.

`grouped_lines`: each rank's printed lines, lined up by position; a line that several ranks printed
alike is shown once with their ranks (``[ranks 0-3] sum is 10.0``), a line that differs per rank once per
rank. `show_results`: each rank's last expression, grouped the same way (identical text shown once).
`failure_text`: a failed cell, rank by rank, at the learner's own line. `show` / `show_tabs` /
`display_results`: all of it printed (or displayed: figures, a tab per rank) in the kernel.
"""
from __future__ import annotations

import linecache
import re
import sys

from labkit.launching.stacks import where_waiting
from labkit.session import tabs as rank_tabs


def ranks_label(ranks) -> str:
    """[rank 2], [ranks 0-3], [ranks 0, 2]"""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"[rank {ranks[0]}]"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[ranks {ranks[0]}-{ranks[-1]}]"
    return f"[ranks {', '.join(map(str, ranks))}]"


def grouped_lines(texts: dict[int, str]) -> list[str]:
    """{rank: printed text} -> lines, each once with the ranks that printed it at that position."""
    per_rank = {rank: text.splitlines() for rank, text in texts.items() if text}
    out = []
    for i in range(max((len(lines) for lines in per_rank.values()), default=0)):
        same: dict[str, list[int]] = {}
        for rank in sorted(per_rank):
            if i < len(per_rank[rank]):
                same.setdefault(per_rank[rank][i], []).append(rank)
        out += [f"{ranks_label(ranks)} {line}" for line, ranks in same.items()]
    return out


def grouped_results(results: dict[int, dict | None]) -> list[tuple[list[int], dict]]:
    """{rank: mimebundle or None} -> [(ranks, bundle)], ranks whose text/plain agree together."""
    groups: dict[str, tuple[list[int], dict]] = {}
    for rank in sorted(results):
        bundle = results[rank]
        if bundle:
            key = bundle.get("text/plain", repr(sorted(bundle)))
            if "text/plain" not in bundle or len(bundle) > 1:
                key = f"{key}#{rank}"  # a figure or HTML: one per rank
            groups.setdefault(key, ([], bundle))[0].append(rank)
    return list(groups.values())


_CELL_FRAME = re.compile(r'File "<%%ranks[^"]*>", line (\d+)')


def where_raised(text: str, innermost_first: bool = False) -> str | None:
    """'at your cell, line 3: y = 1 / 0', or the exercise line `where_waiting` finds.

    ``text``: a traceback (innermost last) or, with ``innermost_first``, a faulthandler stack.
    """
    where = where_waiting(text, innermost_first=innermost_first)
    if where and "<%%ranks" not in where:
        return where
    found = [(m.group(0), int(m.group(1))) for m in _CELL_FRAME.finditer(text)]
    if not found:
        return where
    filename, line = found[0 if innermost_first else -1]
    filename = filename.split('"')[1]
    code = linecache.getline(filename, line).strip()  # the kernel registered the cell's lines
    return f"at your cell, line {line}" + (f": {code}" if code else "")


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failure_text(failed: dict[int, dict], world_size: int, cell_name: str) -> str:
    """A cell that raised on some ranks: the first rank's traceback, the others in one line each."""
    ranks = sorted(failed)
    first = failed[ranks[0]]
    last_line = lambda text: next((x for x in reversed(text.strip().splitlines()) if x.strip()), "?")  # noqa: E731
    lines = [f"{cell_name} failed on rank(s) {', '.join(map(str, ranks))} of {world_size}: "
             f"{last_line(first['error'])}"]
    where = where_raised(first["error"])
    if where:
        lines.append(f"rank {ranks[0]} raised {where}")
    lines.append(f"\n=== rank {ranks[0]} ===\n{_ANSI.sub('', first['error']).rstrip()}")
    for rank in ranks[1:]:
        text = failed[rank]["error"]
        same = "the same: " if last_line(text) == last_line(first["error"]) else ""
        where = where_raised(text)
        lines.append(f"rank {rank}: {same}{last_line(text)}" + (f" ({where})" if where else ""))
    lines.append("The ranks keep their variables: fix the cell and run it again.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- showing a cell's output in the kernel

def printed(pending) -> tuple[dict, dict]:
    """({rank: stdout}, {rank: stderr}) of the cell's ranks."""
    for ar in pending.values():  # the printed output travels apart from the result (iopub): wait for it
        if ar.ready():
            try:
                ar.wait_for_output(timeout=5)
            except Exception:
                pass
    out = {r: ar.stdout for r, ar in pending.items() if ar.ready() or ar.stdout}
    err = {r: ar.stderr for r, ar in pending.items() if ar.ready() or ar.stderr}
    return out, err


def show_tabs(pending, results, targets) -> bool:
    out, err = printed(pending)
    if not rank_tabs.show(out, err, results, targets):
        return False
    _show_displays(pending)
    return True


def show(pending) -> None:
    out, err = printed(pending)
    for line in grouped_lines(out):
        print(line)
    for line in grouped_lines(err):
        print(line, file=sys.stderr)
    _show_displays(pending)


def _show_displays(pending) -> None:
    for rank, ar in sorted(pending.items()):
        for output in getattr(ar, "outputs", None) or []:  # display() calls: figures, widgets' fallbacks
            _publish(output.get("data", {}), f"{ranks_label([rank])}")


def display_results(results) -> None:
    for ranks, bundle in grouped_results(results):
        _publish(bundle, f"Out{ranks_label(ranks)}")


def _publish(bundle: dict, label: str) -> None:
    if set(bundle) <= {"text/plain"}:
        print(f"{label}: {bundle.get('text/plain', '')}")
        return
    print(f"{label}:")
    try:
        from IPython.display import publish_display_data

        publish_display_data(bundle)
    except Exception:
        print(bundle.get("text/plain", ""))
