"""No status dict or role string crosses between the node's parts (issue 44): inside the node process
they pass records (orchestrator/control/records.py) and read them by field. JSON status is read only at
the control edge, where a status reply is rendered for a person or another program:

- ``orchestrator/cli/``: the CLI, which holds only status replies from another process (and turns
  one into a ``NodeView`` with ``NodeView.from_dict`` before its ``status`` table reads it).

The ``status`` table (``orchestrator/control/status_format.py``) reads a ``NodeView`` by field.

The Prometheus renderer (``orchestrator/node/metrics.py``) reads the node's ``NodeView`` by field, and
the fleet agent, which receives its node's status reply over the wire, reads it as a ``NodeView``
(``NodeView.from_dict``), so neither is on the edge.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "orchestrator"

#: Where a status reply's JSON is read (see the module docstring), relative to the repository.
CONTROL_EDGE = (
    "orchestrator/cli/",
)

#: Reading a role or the SLO attainment out of a status dict.
DICT_READS = re.compile(r"""\[\s*["']role["']\s*\]|\.get\(\s*["']role["']|"""
                        r"""\[\s*["']slo_attainment["']\s*\]|\.get\(\s*["']slo_attainment["']""")


def _at_edge(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return any(rel == e or (e.endswith("/") and rel.startswith(e)) for e in CONTROL_EDGE)


def test_the_edge_names_files_that_exist() -> None:
    for e in CONTROL_EDGE:
        assert (ROOT / e).exists(), e


def test_no_status_dict_reads_inside_the_node() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if _at_edge(path):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if DICT_READS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, ("status dict reads outside the control edge (read the records of "
                       "orchestrator/control/records.py by field instead):\n" + "\n".join(found))


def test_the_pattern_finds_what_it_looks_for() -> None:
    for text in ('i["role"]', "a.get('slo_attainment')", 'i.get("role", "active")', 'x[ "slo_attainment" ]'):
        assert DICT_READS.search(text), text
    for text in ("st.role", "t.slo_attainment", '"role": Role.ACTIVE'):
        assert not DICT_READS.search(text), text
