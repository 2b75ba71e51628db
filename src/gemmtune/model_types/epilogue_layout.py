"""The layout of a Linear -> act -> Linear MLP, the MLP optimize() runs on the fused-epilogue GEMMs
(models/epilogue_mlp.py) and `gemmtune shapes --family epilogue` keys: its module's attribute names and the
config fields that size it, as one registry entry declares them."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfigError, count

# config activation name -> the epilogue family's act
EPILOGUE_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                 "relu": "relu"}  # fmt: skip


@dataclass(frozen=True)
class EpilogueLayout:
    """One model type's Linear -> act -> Linear MLP module and the config fields behind it."""

    mlp_class: str  # the MLP module's class name
    up: str  # attribute of the up projection (an nn.Linear)
    act: str  # attribute of the activation module (optimize() identifies it on a probe, never by name)
    down: str  # attribute of the down projection (an nn.Linear)
    dropout: str | None = None  # attribute holding the dropout probability applied after down
    act_field: str = "hidden_act"  # config field naming the activation
    act_default: str = "gelu"  # what transformers reads when the config omits it
    intermediate_field: str = "intermediate_size"
    intermediate_multiple: int = 0  # width = this * hidden_size when the field is missing or null; 0: none
    bias_field: str | None = None  # config field switching the up / down biases; None: always biased
    bias_default: bool = True

    def __post_init__(self):
        if self.act_default not in EPILOGUE_ACTS:
            raise ValueError(f"EpilogueLayout {self.mlp_class}: act_default={self.act_default!r} is not one of "
                             f"{sorted(EPILOGUE_ACTS)}")  # fmt: skip

    def intermediate_size(self, cfg: dict) -> int | None:
        """The MLP's width from the config; None when the config does not size it."""
        if cfg.get(self.intermediate_field) is not None:
            return count(cfg, self.intermediate_field, 1)
        if self.intermediate_multiple and cfg.get("hidden_size") is not None:
            return self.intermediate_multiple * count(cfg, "hidden_size", 1)
        return None

    def required_intermediate_size(self, cfg: dict) -> int:
        inter = self.intermediate_size(cfg)
        if inter is None:
            raise ModelConfigError(
                f"model config has no {self.intermediate_field} (model_type {cfg.get('model_type')!r})"
            )
        return inter

    def epilogue_act(self, cfg: dict) -> str | None:
        """The epilogue family's act of the config's activation; None for one the epilogue GEMMs lack."""
        return EPILOGUE_ACTS.get(cfg.get(self.act_field, self.act_default))

    def bias(self, cfg: dict) -> bool:
        """Whether the up and down projections carry a bias."""
        return self.bias_default if self.bias_field is None else bool(cfg.get(self.bias_field, self.bias_default))
