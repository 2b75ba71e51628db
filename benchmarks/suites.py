"""The model suites the benchmarks run: (label, layer, N, K) of each model's linears at a TP degree.

Shapes come from ../shared/models/*.json when found (else gemmtune's presets, which hold the same
facts: the GPU machine has no ../shared), derived by gemmtune.tuner.shapes.model_gemms.
"""

from __future__ import annotations

import os
import pathlib

from gemmtune.tuner.shapes import load_model_config, model_gemms

LAYERS = ("qkv", "o", "gate_up", "down")


def find_models_dir(arg: str | None) -> pathlib.Path | None:
    repo = pathlib.Path(__file__).resolve().parents[1]
    env = os.environ.get("GEMMTUNE_SHARED_DIR")
    cands = [pathlib.Path(arg)] if arg else []
    cands += [pathlib.Path(env) / "models"] if env else []
    cands += [repo.parent / "shared" / "models", repo / "shared" / "models"]
    return next((c for c in cands if (c / "llama-3-8b.json").is_file()), None)


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
