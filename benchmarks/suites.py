"""The model suites the benchmarks run: (label, layer, N, K) of each model's linears at a TP degree.

Shapes come from the config.json files of tests/data/models (or --models DIR; a model without a file
falls back to gemmtune's preset of the same name), derived by gemmtune.tuner.model_shapes.model_gemms.
"""

from __future__ import annotations

import pathlib

from gemmtune.tuner.model_shapes import load_model_config, model_gemms

LAYERS = ("qkv", "o", "gate_up", "down")


MODELS_DIR = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "models"


def find_models_dir(arg: str | None) -> pathlib.Path:
    """--models DIR when given (it must exist), else the repository's tests/data/models."""
    if arg is None:
        return MODELS_DIR
    path = pathlib.Path(arg)
    if not path.is_dir():
        raise SystemExit(f"--models {arg}: not a folder")
    return path


def suite_shapes(models_dir: pathlib.Path | None, suite, layers=LAYERS):
    """([(label, layer, N, K)], [config source per model]) for [(model, tp)] and the named layers."""
    out, sources = [], []
    for model, tp in suite:
        path = models_dir / f"{model}.json" if models_dir else None
        cfg, src = load_model_config(str(path) if path and path.is_file() else model)
        sources.append(src)
        for s in model_gemms(cfg, tp):
            if s.name in layers:
                out.append((f"{model} tp{tp}", s.name, s.N, s.K))
    return out, sources
