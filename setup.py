"""Build hook: a wheel carries the serve configs (configs/*.yaml) and the shipped heads (heads/) as
rayspec/_assets/, so that `pip install` of the wheel serves configs/default.yaml from any directory
(rayspec/assets.py finds them). Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
ASSETS = {"configs": "*.yaml", "heads": "**/*"}  # repository directory -> files of it shipped


class BuildPyWithAssets(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads them from the checkout itself
            return
        dest = Path(self.build_lib) / "rayspec" / "_assets"
        shutil.rmtree(dest, ignore_errors=True)  # no file of an earlier build left behind
        for folder, pattern in ASSETS.items():
            for src in sorted((ROOT / folder).glob(pattern)):
                if src.is_file():
                    target = dest / src.relative_to(ROOT)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, target)


setup(cmdclass={"build_py": BuildPyWithAssets})
