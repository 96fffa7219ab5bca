"""Host entries (``"host-01 slots=8"``) and MPI-style hostsfiles, validated before launch.

Host names end up in pdsh's ``-w`` list and, through ssh, in a remote shell; a name is
therefore restricted to letters, digits, ``.``, ``_`` and ``-`` (never leading), which
covers DNS names and IPv4 addresses and leaves no room for shell metacharacters or for
being read as an option (``-oProxyCommand=...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
_SLOTS_RE = re.compile(r"slots=(\S+)")


@dataclass(frozen=True)
class HostSpec:
    """One node of a run: its name and how many processes (slots) it runs.

    Args:
        name: host name or IPv4 address as pdsh/ssh should reach it.
        slots: processes torchrun starts on this host (``--nproc-per-node``), > 0.
    """

    name: str
    slots: int

    def __repr__(self) -> str:
        return f"HostSpec({self.name} slots={self.slots})"


def check_host_name(name: str, field: str, entry: str | None = None) -> str:
    """Return ``name`` if it is a safe host name, else raise ``ValueError`` naming ``field``."""
    if not _HOST_RE.fullmatch(name):
        context = f" (in {entry!r})" if entry is not None and entry != name else ""
        raise ValueError(
            f"{field}: host name {name!r}{context} is not allowed; use letters, digits, '.', '_' and '-' "
            f"(not leading), e.g. 'node-01' or '10.0.0.7' (no spaces, shell characters or options)"
        )
    return name


def parse_host_entry(entry: str, default_slots: int, where: str) -> HostSpec:
    """Parse ``"host"`` or ``"host slots=N"``; ``where`` names the source in errors."""
    parts = entry.split()
    if not parts:
        raise ValueError(f"{where}: empty host entry; write 'hostname slots=N'")
    name = check_host_name(parts[0], where, entry)
    slots = default_slots
    for extra in parts[1:]:
        match = _SLOTS_RE.fullmatch(extra)
        if match is None:
            raise ValueError(
                f"{where}: cannot parse {extra!r} in host entry {entry!r}; the only option is 'slots=N', "
                f"e.g. '{name} slots=8'"
            )
        try:
            slots = int(match.group(1))
        except ValueError:
            raise ValueError(f"{where}: slots={match.group(1)!r} of host {name!r} is not an integer") from None
    if slots <= 0:
        raise ValueError(f"{where}: host {name!r} has slots={slots}; slots must be > 0 (processes on that host)")
    return HostSpec(name, slots)


def parse_hosts(entries: list[str], default_slots: int, field: str = "hosts") -> list[HostSpec]:
    """Parse a list of host entries and reject duplicates."""
    specs = [parse_host_entry(e, default_slots, f"{field}[{i}]") for i, e in enumerate(entries)]
    return _no_duplicates(specs, field)


def read_hostsfile(path: str, default_slots: int) -> list[HostSpec]:
    """Read an MPI-style hostsfile: one ``host [slots=N]`` per line, ``#`` starts a comment."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hostsfile={path!r} does not exist; give the path of a file with one 'host slots=N' per line")
    specs = []
    for lineno, line in enumerate(p.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if text:
            specs.append(parse_host_entry(text, default_slots, f"hostsfile {path!r} line {lineno}"))
    if not specs:
        raise ValueError(f"hostsfile={path!r} lists no hosts; add lines like 'node-01 slots=8'")
    return _no_duplicates(specs, f"hostsfile {path!r}")


def _no_duplicates(specs: list[HostSpec], field: str) -> list[HostSpec]:
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"{field}: duplicate host {spec.name!r}; list each host once and set its slots=N")
        seen.add(spec.name)
    return specs
