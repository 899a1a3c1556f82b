"""Bad command-line input: one line `error: field=value: allowed ...` on stderr, exit code 2.

Our own checks raise ValueError naming the field (experiments.config.validation,
the campaign sweeper). Hydra rejects other input before our code runs (an
unknown key, an unknown config group option, an override it cannot parse) with
several lines and exit code 1; `bad_input_message` rewrites those in the same
one-line style, and `report_bad_input` installs that as Hydra's error reporter,
so every bad input ends the same way. Anything else (a bug) keeps Hydra's own
report and exit code 1.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

from hydra.errors import (
    CompactHydraException,
    ConfigCompositionException,
    InstantiationException,
    MissingConfigException,
    OverrideParseException,
)
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

EXIT_BAD_INPUT = 2
_MAX_KEYS = 12


class CampaignError(CompactHydraException, ValueError):
    """A campaign that cannot start (bad input) or that finished with failed runs.

    Hydra prints a CompactHydraException as its message alone, without a traceback.
    """


def _first_line(text: str) -> str:
    return str(text).strip().splitlines()[0] if str(text).strip() else ""


def _unknown_key(ex: ConfigCompositionException) -> str | None:
    cause = ex.__cause__
    if not isinstance(cause, OmegaConfBaseException) or "not in struct" not in str(cause):
        return None
    match = re.search(r"use \+(\S+)", str(ex))
    given = match.group(1) if match else cause.full_key
    parent = cause.parent_node
    if isinstance(parent, DictConfig):
        keys = [str(k) for k in parent.keys() if k != "hydra"]
        shown = ", ".join(keys[:_MAX_KEYS]) + (", ..." if len(keys) > _MAX_KEYS else "")
        where = cause.full_key.rpartition(".")[0]
        return f"{given}: unknown key; allowed keys{f' of {where}' if where else ''}: {shown}"
    return f"{given}: unknown key"


def _missing_option(ex: MissingConfigException) -> str | None:
    if not ex.missing_cfg_file or ex.options is None:
        return None
    group, _, value = ex.missing_cfg_file.rpartition("/")
    allowed = ", ".join(ex.options) or "(no options)"
    return f"{group}={value}: allowed {allowed}"


def bad_input_message(ex: BaseException) -> str | None:
    """The one-line message for an exception caused by bad input, None for anything else."""
    if isinstance(ex, CampaignError):
        return str(ex) if getattr(ex, "bad_input", True) else None
    if isinstance(ex, MissingConfigException):
        return _missing_option(ex) or _first_line(str(ex))
    if isinstance(ex, OverrideParseException):
        match = re.search(r"Error parsing override '(.*)'", str(ex))
        detail = str(ex).splitlines()[1] if len(str(ex).splitlines()) > 1 else ""
        detail = detail.split(" expecting ")[0]
        given = match.group(1) if match else str(ex)
        return f"{given}: cannot parse this override ({detail}); write key=value"
    if isinstance(ex, InstantiationException) and isinstance(ex.__cause__, ValueError):
        return _first_line(str(ex.__cause__))
    if isinstance(ex, ConfigCompositionException):
        text = str(ex)
        ambiguous = re.search(r"Ambiguous value for argument '(.*)'", text)
        if ambiguous:
            return (f"{ambiguous.group(1)}: a sweep needs -m (multirun); a list is "
                    "key=[a,b], a string key='a,b'")
        return _unknown_key(ex) or _first_line(text)
    if isinstance(ex, OmegaConfBaseException):
        key = getattr(ex, "full_key", None)
        if key and "not in struct" in str(ex):
            return f"{key}: required, it cannot be removed"
        return f"{key}: {_first_line(getattr(ex, 'msg', None) or str(ex))}" if key else (
            _first_line(str(ex)))
    if isinstance(ex, ValueError):
        return str(ex)
    return None


def exit_bad_input(message: str) -> None:
    """Print `error: <message>` on stderr and exit with code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def report_bad_input() -> None:
    """Make Hydra report bad input the project's way (see the module docstring)."""
    import hydra._internal.utils as hydra_utils  # hydra-core==1.3.8: _run_hydra calls this

    hydra_report = hydra_utils.run_and_report
    if getattr(hydra_report, "reports_bad_input", False):
        return

    def run_and_report(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except Exception as ex:
            error = ex
            message = bad_input_message(error)
            if message is None:  # not bad input: Hydra's own report (exit code 1)
                def reraise() -> Any:
                    raise error
                return hydra_report(reraise)
            exit_bad_input(message)

    run_and_report.reports_bad_input = True
    hydra_utils.run_and_report = run_and_report


__all__ = ["EXIT_BAD_INPUT", "bad_input_message", "exit_bad_input", "report_bad_input"]
