"""Where a process's memory lives, per NUMA node, from /proc/PID/numa_maps.

A worker pinned to one node's cores but whose pages sit on another node pays remote-memory
latency on every forward pass; these counts let placement see that. Reading numa_maps makes the
kernel walk the process's page tables, so call it at the monitor's pace, not per request.
"""

from __future__ import annotations

import os
import re

_NODE_FIELD = re.compile(r"^N(\d+)=(\d+)$")
_PAGE_SIZE_FIELD = "kernelpagesize_kB="


def parse_numa_maps(text: str) -> dict[int, int]:
    """Sum the `N<node>=<pages>` fields of numa_maps text into {node: pages}.

    Pages are counted in each mapping's own page size (see `parse_numa_maps_bytes` when huge
    pages are in play).
    """
    return _sum_fields(text, in_bytes=False)


def parse_numa_maps_bytes(text: str) -> dict[int, int]:
    """Like `parse_numa_maps`, but in bytes, using each mapping's kernelpagesize_kB."""
    return _sum_fields(text, in_bytes=True)


def _sum_fields(text: str, in_bytes: bool) -> dict[int, int]:
    totals: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()
        scale = _page_bytes(fields) if in_bytes else 1
        for field in fields[2:]:
            m = _NODE_FIELD.match(field)
            if m:
                node = int(m.group(1))
                totals[node] = totals.get(node, 0) + int(m.group(2)) * scale
    return totals


def _page_bytes(fields: list[str]) -> int:
    for field in reversed(fields):
        if field.startswith(_PAGE_SIZE_FIELD):
            try:
                return int(field[len(_PAGE_SIZE_FIELD):]) * 1024
            except ValueError:
                break
    return 4096


def _read_numa_maps(pid: int, proc_root: str) -> str | None:
    try:
        with open(os.path.join(proc_root, str(pid), "numa_maps"), encoding="utf-8",
                  errors="replace") as f:
            return f.read()
    except OSError:  # vanished pid, no NUMA support in the kernel, or no permission
        return None


def worker_numa_pages(pid: int, proc_root: str = "/proc") -> dict[int, int]:
    """{node: pages} of process `pid`; {} when numa_maps cannot be read."""
    text = _read_numa_maps(pid, proc_root)
    return parse_numa_maps(text) if text else {}


def worker_numa_bytes(pid: int, proc_root: str = "/proc") -> dict[int, int]:
    """{node: bytes} of process `pid`; {} when numa_maps cannot be read."""
    text = _read_numa_maps(pid, proc_root)
    return parse_numa_maps_bytes(text) if text else {}
