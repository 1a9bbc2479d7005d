from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from google.protobuf.descriptor import Descriptor
from tritonclient.grpc import model_config_pb2, service_pb2

from orchestrator.frontdoor import oip_pb2

REPO = Path(__file__).resolve().parents[3]


def _descriptor_bytes(source: str) -> bytes:
    """The serialized FileDescriptorProto a generated module registers (independent of protoc's version)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return ast.literal_eval(node.args[0])
    raise AssertionError("no AddSerializedFile call in the generated module")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    env = {**os.environ, "OUT_DIR": str(tmp_path), "PY": sys.executable}
    subprocess.run([str(REPO / "scripts" / "gen-oip-stubs.sh")], check=True, env=env, timeout=120)
    committed = REPO / "orchestrator" / "frontdoor"
    assert _descriptor_bytes((tmp_path / "oip_pb2.py").read_text()) == \
        _descriptor_bytes((committed / "oip_pb2.py").read_text()), \
        "oip_pb2.py is stale: run scripts/gen-oip-stubs.sh and commit it"
    code = [[ln for ln in (d / "oip_pb2.pyi").read_text().splitlines() if not ln.startswith("#")]
            for d in (tmp_path, committed)]
    assert code[0] == code[1], "oip_pb2.pyi is stale: run scripts/gen-oip-stubs.sh and commit it"


def _fields(desc: Descriptor) -> dict[str, tuple[int, int]]:
    return {f.name: (f.number, f.type) for f in desc.fields}


def test_every_field_matches_the_protocol_numbering() -> None:
    # tritonclient ships the published protocol's messages: ours must agree on every field we
    # declare (name, number, type), recursively, or clients would read garbage.
    theirs = {**service_pb2.DESCRIPTOR.message_types_by_name, **model_config_pb2.DESCRIPTOR.message_types_by_name}
    checked = 0

    def check(ours: Descriptor, other: Descriptor) -> None:
        nonlocal checked
        mine, ref = _fields(ours), _fields(other)
        for name, spec in mine.items():
            assert ref.get(name) == spec, f"{ours.full_name}.{name}: ours {spec}, protocol {ref.get(name)}"
            checked += 1
        for nested in ours.nested_types:
            if not nested.GetOptions().map_entry:
                check(nested, other.nested_types_by_name[nested.name])

    for name, desc in oip_pb2.DESCRIPTOR.message_types_by_name.items():
        check(desc, theirs[name])
    assert checked > 100
