"""Kernel config names are stored in tables: every name must parse to the same config and spell the
same name as when the table was written. tests/data/config_names.json holds names of both Triton
config kinds (from the backends' config spaces and the tables, plus non-canonical spellings that must
be rejected) with what they parsed to when it was recorded."""

import dataclasses
import json
from pathlib import Path

import pytest

from gemmtune.kernels import batched_gemm, triton_gemm

_GOLDEN = json.loads((Path(__file__).parent / "data" / "config_names.json").read_text())
_PARSERS = {"tg_": triton_gemm.parse_config, "bmm_": batched_gemm.parse_config}


def _parse(name: str):
    return _PARSERS["tg_" if name.strip().startswith("tg_") else "bmm_"](name)


def test_golden_covers_both_kinds_and_rejections():
    kinds = {v[0] for v in _GOLDEN.values() if v is not None}
    assert kinds == {"TGConfig", "BmmConfig"}
    assert sum(v is None for v in _GOLDEN.values()) >= 20


@pytest.mark.parametrize("name", sorted(_GOLDEN))
def test_name_round_trips(name):
    want = _GOLDEN[name]
    cfg = _parse(name)
    if want is None:
        assert cfg is None
        return
    assert [type(cfg).__name__, list(dataclasses.astuple(cfg))] == want
    assert cfg.name == name.strip()
    assert type(cfg)(*want[1]).name == name.strip()
