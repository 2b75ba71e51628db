"""Experiment: `gemmtune bench-model` with optimize(mla_absorb=True) as its "optimize" contender (issue 29).

DeepSeek-V3's absorbed MLA decode (models/mla.py, the latent kernel kernels/mla_decode.py) is opt-in;
bench-model runs optimize() with its defaults, so this wrapper hands it mla_absorb=True. With
NOVERIFY=1 it also passes verify=False: no layer is put back to stock by optimize()'s cached-path check,
which shows the speed the absorbed path would have on every layer (not a product setting: the decode
parity table of the report still judges the result). Every other argument goes to the CLI:

    PYTHONPATH=src python benchmarks/experiments/exp_mla_absorb.py bench-model --model deepseek-v3 --layers 4 \\
        --contenders stock,optimize --keep-going -o OUT_DIR
"""

from __future__ import annotations

import functools
import os
import sys

import gemmtune.models as models
from gemmtune.cli.main import cli

if __name__ == "__main__":
    options = {"mla_absorb": True} | ({"verify": False} if os.environ.get("NOVERIFY") == "1" else {})
    models.optimize = functools.partial(models.optimize, **options)
    cli(sys.argv[1:], prog_name="gemmtune")
