"""The files a serve config needs beside the code: the serve configs (`configs/*.yaml`) and the heads
shipped with the repository (`heads/`). In a checkout (an editable install) they are the checkout's;
a wheel carries copies in `rayspec/_assets/` (setup.py puts them there), so that an installed
rayspec serves its default config from any directory:

    rayspec serve --config default
    serve run "$(rayspec configs-dir)/default.yaml"

Relative paths inside a config (`draft_model: heads/smollm2-135m-eagle3`) are read from the working
directory first, then from `assets_root()` (deployments.config.resolve_local_path).
"""

from __future__ import annotations

from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]
_WHEEL = Path(__file__).resolve().parent / "_assets"


def assets_root() -> Path:
    """The directory holding configs/ and heads/: the checkout this module runs from, else the
    wheel's copies."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "configs").is_dir():
        return _CHECKOUT
    return _WHEEL


def configs_dir() -> Path:
    return assets_root() / "configs"


def config_path(spec: str | Path) -> Path:
    """A serve config named on the command line: a file from the working directory, else the same
    relative path under assets_root() (`configs/default.yaml` from anywhere), else a shipped
    config's name (`default`, `default.yaml`)."""
    path = Path(spec).expanduser()
    if path.is_file() or path.is_absolute():
        return path
    for candidate in (assets_root() / path, configs_dir() / path, configs_dir() / f"{path}.yaml"):
        if candidate.is_file():
            return candidate
    shipped = ", ".join(sorted(p.stem for p in configs_dir().glob("*.yaml")))
    raise FileNotFoundError(f"{spec}: no such file, nor a shipped config ({shipped})")
