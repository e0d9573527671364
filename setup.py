"""The wheel carries the repository's top-level templates/, specs/ and generated/ inside the package,
as ddtree_gen/_data/ (ddtree_gen/paths.py finds them there), so an installed ddtree-gen renders, builds
and loads the shipped specs anywhere. The repository keeps its layout; an editable install reads the
top-level folders directly and copies nothing. Everything else is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DATA_FOLDERS = ("templates", "specs", "generated")   # refs/ (test bundles, ~20 MB) stays in the repository
SKIP = shutil.ignore_patterns(".lock", ".*.tmp", "__pycache__")


class build_py_with_data(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return   # the checkout's folders are read in place
        dest = Path(self.build_lib) / "ddtree_gen" / "_data"
        for folder in DATA_FOLDERS:
            src = ROOT / folder
            if not src.is_dir():
                raise SystemExit(f"setup.py: {src} is missing: the wheel must carry {folder}/")
            shutil.rmtree(dest / folder, ignore_errors=True)
            shutil.copytree(src, dest / folder, ignore=SKIP)


setup(cmdclass={"build_py": build_py_with_data})
