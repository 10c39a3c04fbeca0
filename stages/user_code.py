"""A user's Python module, named as verl names one in its config: a file path, `file://<path>` or `pkg://<module>`.

verl lets a config point at the user's own code (`custom_reward_function.path`, a policy loss registered from the
user's file); this loads it once per process and turns every way it can fail (no such file, an import that raises,
even SystemExit) into one error that names the config key.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType


class UserCodeError(ValueError):
    """The user's module cannot be found or fails to import; the message names the config key."""


def load_user_module(path: str, key: str) -> ModuleType:
    """The module at `path` (a file, `file://<path>` or `pkg://<module>`); `key` names the config key in errors."""
    where = f"{key} {path!r}"
    if path.startswith("pkg://"):
        try:
            return importlib.import_module(path.removeprefix("pkg://"))
        except Exception as err:  # noqa: BLE001 - any import failure is the user's file: one clear error
            raise UserCodeError(f"{where} fails to import: {type(err).__name__}: {err}") from None
    file = Path(path.removeprefix("file://")).expanduser().resolve()
    if not file.is_file():
        raise UserCodeError(f"{where}: no such file. Point it at a Python file.")
    try:
        return _exec_file(file)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's file: one clear error
        raise UserCodeError(f"{where} fails to import: {type(err).__name__}: {err}") from None


@cache
def _exec_file(file: Path) -> ModuleType:
    """The module of `file`, executed once per process (registered, so its dataclasses and pickles resolve)."""
    spec = importlib.util.spec_from_file_location(f"asyncrl_user_{abs(hash(str(file)))}", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module
