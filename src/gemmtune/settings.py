"""Every environment variable gemmtune reads, declared once: name, parser, default, when it is read, doc.

A reader asks its Setting (`settings.LOG.get()`) at the moment the table below says (`read`): at import,
at first use (then kept for the process), or per call of a command such as optimize() or tune (never per
op call: the hot path reads no variable). A value that cannot be parsed raises EnvVarError naming the
variable and the value. A check that needs a vocabulary from a higher layer (the backends a family has,
the fused ops) is passed to get(check=...) by that layer, and fails the same way.

The families' table variables (GEMMTUNE_CONFIG_<FAMILY>) are named by each family (families/*.py
`env_var`); here one pattern entry declares their parser and doc, so adding a family adds no line here.
The table in docs/settings.md is generated from this module (markdown_table: `gemmtune doctor --settings-table`).
Some variables have a Python API that overrides them (set_config, set_capture, ...); that API records
itself here (api_called) so `gemmtune doctor` says where each effective value came from.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .errors import EnvVarError

IMPORT, FIRST_USE, PER_CALL = "import", "first use", "per call"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def boolean(text: str) -> bool:
    word = text.lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"expected one of {', '.join(TRUE_WORDS + FALSE_WORDS)}")


def choice(*modes: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in modes:
            raise ValueError(f"expected one of {', '.join(modes)}")
        return text.lower()

    parse.modes = modes  # the vocabulary, for the modules that name the modes
    return parse


def whole_number(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("expected a whole number") from None
        if value < lo:
            raise ValueError(f"expected at least {lo}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError("expected a positive number of seconds")
    return value


def path_list(text: str) -> list[str]:
    """':'-separated paths; empty parts are dropped."""
    return [p for p in text.split(":") if p.strip()]


def name_list(text: str) -> list[str]:
    """','-separated names, stripped; empty parts are dropped."""
    return [p.strip() for p in text.split(",") if p.strip()]


def text(value: str) -> str:
    return value


def off_or_path(value: str) -> str:
    """A path, or '' when the value is one of the off words (0, false, no, off)."""
    return "" if value.lower() in FALSE_WORDS else value


# Python APIs called so far in this process, by name (api_called); doctor reports them as the source.
_api_calls: set[str] = set()


def api_called(name: str) -> None:
    """Record that API `name` (set_config, set_capture, ...) set what its variables would set."""
    _api_calls.add(name)


@dataclass(frozen=True)
class Setting:
    name: str  # the variable, or the prefix of a pattern entry ("GEMMTUNE_CONFIG_")
    parse: Callable[[str], object]  # stripped non-empty text -> value; ValueError(why) when it cannot
    default: object  # the value when the variable is unset or empty (immutable: every reader shares it)
    read: str  # IMPORT, FIRST_USE or PER_CALL
    doc: str  # one line, markdown
    example: str = ""  # the value the docs show (`GEMMTUNE_LOG=1`)
    api: tuple[str, ...] = ()  # Python APIs that override the variable
    pattern: bool = False  # name is a prefix: every variable starting with it

    def raw(self, environ: Mapping[str, str] | None = None, name: str | None = None) -> str:
        """The variable's text, stripped ('' when unset)."""
        return (os.environ if environ is None else environ).get(name or self.name, "").strip()

    def get(self, environ: Mapping[str, str] | None = None, check=None, name: str | None = None):
        """The parsed value (the default when unset or empty); `check(value)` may reject it with a
        ValueError. Either failure is an EnvVarError naming the variable and the value. `name`: the
        variable of a pattern entry."""
        var = name or self.name
        raw = self.raw(environ, var)
        if not raw:
            return self.default
        try:
            value = self.parse(raw)
            if check is not None:
                check(value)
        except ValueError as exc:
            raise self.error(raw, str(exc), var) from None
        return value

    def error(self, raw: str, why: str, name: str | None = None) -> EnvVarError:
        return EnvVarError(f"{name or self.name}={raw!r}: {why}")

    def set_by_api(self) -> str:
        """The API call that overrides the variable in this process ('set_config()'), or ''."""
        return next((f"{a}()" for a in self.api if a in _api_calls), "")

    def source(self, environ: Mapping[str, str] | None = None, name: str | None = None) -> str:
        """Where the effective value comes from: the API that set it, the environment, or the default."""
        return self.set_by_api() or ("environment" if self.raw(environ, name) else "default")


SETTINGS: tuple[Setting, ...] = (
    Setting("GEMMTUNE_CONFIG", path_list, (), FIRST_USE, "tuned tables to dispatch with (merged as [the config "
            "format](config.md) says; each file to the family its header names)", "a.csv:b.csv", ("set_config",)),
    Setting("GEMMTUNE_CONFIG_", path_list, (), FIRST_USE, "one family's tables; each family names its variable "
            "(`_BATCHED`, `_A8W8`, `_FMOE`, ...: [families](families.md))", "<FAMILY>=...", ("set_config",),
            pattern=True),
    Setting("GEMMTUNE_CAPTURE", text, "", FIRST_USE, "record every distinct key dispatched, with call counts "
            "(file-locked, crash-safe; several processes may share one file); other families beside it "
            "(`shapes.batched.csv` ...)", "shapes.csv", ("set_capture",)),
    Setting("GEMMTUNE_TUNE_ONLINE", off_or_path, "", FIRST_USE, "tune keys no table answers, in the background, "
            "into this table ([online tuning](tuning.md#online-tuning)); 0, false, no, off: off", "table.csv",
            ("set_online_tuning", "set_miss_hook")),
    Setting("GEMMTUNE_TUNE_ONLINE_BUDGET", positive_seconds, 20.0, FIRST_USE, "seconds of online tuning per key, "
            "end to end", "20", ("set_online_tuning", "set_miss_hook")),
    Setting("GEMMTUNE_TUNE_ONLINE_LIBTYPES", name_list, None, FIRST_USE, "the backends online tuning may pick "
            "(default: all)", "torch,triton", ("set_online_tuning", "set_miss_hook")),
    Setting("GEMMTUNE_TUNE_ONLINE_MODE", choice("background", "blocking"), "background", FIRST_USE, "`blocking` "
            "tunes a missed key in the missing call", "blocking", ("set_online_tuning", "set_miss_hook")),
    Setting("GEMMTUNE_PLUGINS", name_list, (), FIRST_USE, "modules that register extra backends or families "
            "(imported at the first resolution; tuner workers import them too)", "mod1,mod2"),
    Setting("GEMMTUNE_LOG", boolean, False, IMPORT, "log which row / backend each new shape resolved to", "1"),
    Setting("GEMMTUNE_PDL", boolean, True, FIRST_USE, "0: no programmatic dependent launch (read at a device's "
            "first launch): tuned `_pdl` rows run as their plain configs, norms/activations launch plainly", "0"),
    Setting("GEMMTUNE_COMPILE_OPS", text, "", IMPORT, "how `optimize()`'s fused norms, act*mul and RoPE run under "
            "`torch.compile`, per op: `ref` (the PyTorch formula, fused by inductor; default) or `op` (the Triton "
            "kernel as an opaque custom op)", "ref\\|op\\|ref,rope=op", ("set_compile_ops",)),
    Setting("GEMMTUNE_ATTENTION", choice("flash", "triton", "flex", "sdpa", "eager"), "", PER_CALL, "force one "
            "attention tier in optimized models (read by each `optimize()`; wins over its `attention=`)",
            "flash\\|triton\\|flex\\|sdpa\\|eager"),
    Setting("GEMMTUNE_MASKED_PREFILL", choice("sdpa", "triton"), "triton", IMPORT, "masked prefill of models "
            "without softcap: gemmtune's Triton kernel with the mask or SDPA with the mask", "triton\\|sdpa",
            ("set_masked_prefill",)),
    Setting("GEMMTUNE_DECODE_ATTENTION", choice("sdpa", "triton"), "triton", IMPORT, "decode with transformers' "
            "boolean mask in optimized models: gemmtune's split-KV Triton decode kernel or SDPA as "
            "`GEMMTUNE_SDPA_DECODE` says", "triton\\|sdpa", ("set_decode_kernel",)),
    Setting("GEMMTUNE_SDPA_DECODE", choice("gqa", "fold", "fold_efficient", "repeat"), "", IMPORT, "how masked GQA "
            "decode calls SDPA where the decode kernel does not run (default: gqa on CUDA with torch >= 2.11, "
            "else fold)", "gqa\\|fold\\|fold_efficient\\|repeat", ("set_masked_decode",)),
    Setting("GEMMTUNE_MLA_DECODE", choice("torch", "triton"), "triton", IMPORT, "absorbed MLA decode attention: "
            "the latent Triton decode kernel or the fp32 PyTorch form", "triton\\|torch"),
    Setting("GEMMTUNE_SKIP_VERSION_CHECK", boolean, False, PER_CALL, "let `optimize()` run on a transformers "
            "version outside the tested range", "1"),
    Setting("GEMMTUNE_BLASLT_SEARCH", choice("heuristic", "wide"), "heuristic", PER_CALL, "`wide`: the tuner's "
            "blaslt candidates cover cuBLASLt's whole algorithm space, not the heuristic's list and its "
            "neighbours", "wide"),
    Setting("GEMMTUNE_COMPILE_PROCESSES", whole_number(1), None, PER_CALL, "how many processes compile a tune's "
            "Triton kernels on this host, split over its ranks (default 16 per rank, at most one per CPU)", "N"),
    Setting("GEMMTUNE_TUNE_EXIT_AFTER", whole_number(0), 0, PER_CALL, "testing hook: a tune exits abruptly "
            "after writing N rows (0: never)", "N"),
)  # fmt: skip

_BY_NAME = {s.name: s for s in SETTINGS if not s.pattern}
_PATTERNS = [s for s in SETTINGS if s.pattern]


def lookup(name: str) -> Setting:
    """The Setting declaring variable `name` (an exact entry, else a pattern entry whose prefix it has)."""
    found = _BY_NAME.get(name) or next((p for p in _PATTERNS if name.startswith(p.name) and name != p.name), None)
    if found is None:
        raise KeyError(f"{name} is not a gemmtune setting (declare it in gemmtune/settings.py)")
    return found


def declared(name: str) -> bool:
    try:
        lookup(name)
    except KeyError:
        return False
    return True


def get(name: str, environ: Mapping[str, str] | None = None, check=None):
    """The parsed value of variable `name` (for variables named at run time: a family's GEMMTUNE_CONFIG_*)."""
    return lookup(name).get(environ, check, name)


CONFIG = _BY_NAME["GEMMTUNE_CONFIG"]
CAPTURE = _BY_NAME["GEMMTUNE_CAPTURE"]
TUNE_ONLINE = _BY_NAME["GEMMTUNE_TUNE_ONLINE"]
TUNE_ONLINE_BUDGET = _BY_NAME["GEMMTUNE_TUNE_ONLINE_BUDGET"]
TUNE_ONLINE_LIBTYPES = _BY_NAME["GEMMTUNE_TUNE_ONLINE_LIBTYPES"]
TUNE_ONLINE_MODE = _BY_NAME["GEMMTUNE_TUNE_ONLINE_MODE"]
PLUGINS = _BY_NAME["GEMMTUNE_PLUGINS"]
LOG = _BY_NAME["GEMMTUNE_LOG"]
PDL = _BY_NAME["GEMMTUNE_PDL"]
COMPILE_OPS = _BY_NAME["GEMMTUNE_COMPILE_OPS"]
ATTENTION = _BY_NAME["GEMMTUNE_ATTENTION"]
MASKED_PREFILL = _BY_NAME["GEMMTUNE_MASKED_PREFILL"]
DECODE_ATTENTION = _BY_NAME["GEMMTUNE_DECODE_ATTENTION"]
SDPA_DECODE = _BY_NAME["GEMMTUNE_SDPA_DECODE"]
MLA_DECODE = _BY_NAME["GEMMTUNE_MLA_DECODE"]
SKIP_VERSION_CHECK = _BY_NAME["GEMMTUNE_SKIP_VERSION_CHECK"]
BLASLT_SEARCH = _BY_NAME["GEMMTUNE_BLASLT_SEARCH"]
COMPILE_PROCESSES = _BY_NAME["GEMMTUNE_COMPILE_PROCESSES"]
TUNE_EXIT_AFTER = _BY_NAME["GEMMTUNE_TUNE_EXIT_AFTER"]


def _shown(value) -> str:
    if value is None or value == "" or value == () or value == []:
        return "-"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, (list, tuple)):
        return ",".join(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def markdown_table() -> str:
    """docs/settings.md's table: one row per setting, in declaration order."""
    rows = ["| variable | default | read | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        api = f" (API: {', '.join(f'`{a}`' for a in s.api)})" if s.api else ""
        var = f"`{s.name}{'' if s.pattern else '='}{s.example}`"
        rows.append(f"| {var} | {_shown(s.default)} | {s.read} | {s.doc}{api} |")
    return "\n".join(rows) + "\n"


def effective(environ: Mapping[str, str] | None = None, names: list[str] | None = None) -> dict[str, str]:
    """{variable: 'value (source)'} for every exact setting and each of `names` (a pattern's variables,
    after the exact GEMMTUNE_CONFIG): the parsed value, the error its text raises, or the API call that
    overrides it."""
    exact = [s.name for s in SETTINGS if not s.pattern]
    at = exact.index(CONFIG.name) + 1
    out = {}
    for name in exact[:at] + [n for n in names or [] if n not in exact] + exact[at:]:
        s = lookup(name)
        raw = s.raw(environ, name)
        if s.set_by_api():
            out[name] = f"set by {s.set_by_api()} (environment: {raw or 'unset'})"
            continue
        try:
            value = _shown(s.get(environ, name=name))
        except EnvVarError as exc:
            out[name] = f"bad value ({exc})"
            continue
        out[name] = f"{value} ({s.source(environ, name)})"
    return out
