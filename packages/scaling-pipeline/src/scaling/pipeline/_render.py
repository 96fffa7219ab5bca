"""Text and PNG pictures of schedules: stage × time grids and rank × step grids."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from scaling.pipeline._instructions import Instruction

_CELL = 5


def render_program_grid(programs: Sequence[Sequence[Instruction]], positions: Sequence[int] | None = None) -> str:
    """One row per stage, one column per instruction; ``[x]`` marks where each stage stands.

    Example:
        >>> from scaling.pipeline._instructions import Forward
        >>> print(render_program_grid([[Forward(0)], [Forward(0)]], [1, 0]))
        stage 0: F0   (done)
        stage 1: [F0]
    """
    rows = []
    width = max([_CELL - 1, *(len(i.short) + 2 for prog in programs for i in prog)]) + 1
    for s, prog in enumerate(programs):
        cells = []
        for i, ins in enumerate(prog):
            label = ins.short
            if positions is not None and positions[s] == i:
                label = f"[{label}]"
            cells.append(label.ljust(width if width > _CELL else _CELL))
        if positions is not None and positions[s] >= len(prog):
            cells.append("(done)")
        rows.append(f"stage {s}: " + "".join(cells).rstrip())
    return "\n".join(rows)


def _unit(timeline: Sequence[Sequence[tuple[float, float, Instruction]]]) -> float:
    durations = [e - b for row in timeline for b, e, _ in row if e > b]
    return min(durations) if durations else 1.0


def render_timeline(timeline: Sequence[Sequence[tuple[float, float, Instruction]]], makespan: float) -> str:
    """Stage × time grid: each column is the shortest compute cost; ``.`` is idle time.

    A compute longer than one column shows its label, then ``-`` to its end.
    """
    unit = _unit(timeline)
    width = int(round(makespan / unit))
    ticks = [str(col) if col % 5 == 0 else "" for col in range(width)]
    rows = [("time:    " + " ".join(t.ljust(4) for t in ticks)).rstrip()]
    for s, row in enumerate(timeline):
        cells = ["."] * width
        for start, end, ins in row:
            first, last = int(round(start / unit)), int(round(end / unit))
            for col in range(first, last):
                cells[col] = ins.short if col == first else "-"
        rows.append(f"stage {s}: " + " ".join(c.ljust(4) for c in cells).rstrip())
    return "\n".join(rows)


def save_timeline_png(
    timeline: Sequence[Sequence[tuple[float, float, Instruction]]], makespan: float, path: str
) -> None:
    """Draw the stage × time grid with matplotlib (an optional dependency).

    Raises:
        ImportError: matplotlib is not installed; install ``scaling-pipeline[plot]``.
    """
    try:
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError as exc:
        raise ImportError("save_png needs matplotlib; pip install 'scaling-pipeline[plot]'") from exc
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}
    fig, ax = plt.subplots(figsize=(max(6.0, makespan * 0.4), 0.6 * len(timeline) + 1))
    for s, row in enumerate(timeline):
        for start, end, ins in row:
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8), facecolors=colors.get(ins.short[0], "grey"))
            ax.text((start + end) / 2, s, ins.short, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("time (cost units)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
