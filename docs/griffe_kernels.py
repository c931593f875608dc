"""A griffe extension for the API reference: the top-level `kernels/` folder is `kvxfer.kernels`.

pyproject.toml installs `kernels/` as the subpackage `kvxfer.kernels` (`package-dir`), which
griffe's static loader cannot see: it finds `kvxfer.*` by walking `kvxfer/`. Once `kvxfer` is
loaded, this loads `kernels/` and hangs it under `kvxfer` as `kernels`, so its objects get their
installed paths (`kvxfer.kernels.gather_kv`) and the kernels' own `kvxfer.kernels.*` imports
resolve. mkdocs.yml names it under mkdocstrings' `extensions`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

KERNELS_DIR = Path(__file__).resolve().parents[1] / "kernels"


class KernelsAsSubpackage(griffe.Extension):
    """Attach the `kernels/` package to `kvxfer` as `kvxfer.kernels`."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Run once a package is loaded: graft `kernels/` onto `kvxfer` if it is not there."""
        if pkg.name != "kvxfer" or "kernels" in pkg.members:
            return
        kernels = loader.load(KERNELS_DIR, try_relative_path=True)
        if not isinstance(kernels, griffe.Module):
            raise TypeError(f"{KERNELS_DIR} loaded as {type(kernels).__name__}, not a package")
        pkg.set_member("kernels", kernels)
