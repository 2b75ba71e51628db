"""`gemmtune` CLI entry point. Each command lives in its own module and is registered here."""

from __future__ import annotations

import click

from .capture_cmd import capture
from .config_cmd import show_config
from .doctor_cmd import doctor

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


@click.group(context_settings=CONTEXT)
@click.version_option(package_name="gemmtune", prog_name="gemmtune")
def cli() -> None:
    """Per-shape tuned GEMMs: capture shapes, tune them, benchmark and deploy the table.

    \b
    Typical loop:
      gemmtune shapes --model config.json --tp 8 -o shapes.csv   (or: gemmtune capture -o shapes.csv -- python serve.py)
      gemmtune tune shapes.csv -o tuned.csv
      gemmtune bench tuned.csv
      GEMMTUNE_CONFIG=tuned.csv python serve.py
    """


for command in (capture, show_config, doctor):
    cli.add_command(command)


def _register_optional() -> None:
    # Commands of the tuner (shapes/tune/bench) register themselves when their modules exist.
    import importlib

    for module in ("shapes_cmd", "tune_cmd", "bench_cmd", "profile_cmd", "bench_model_cmd"):
        try:
            mod = importlib.import_module(f"gemmtune.cli.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"gemmtune.cli.{module}":
                raise
            continue
        cli.add_command(mod.command)


_register_optional()


def main() -> None:
    cli(prog_name="gemmtune")


if __name__ == "__main__":
    main()
