"""Package list for setuptools, derived from the folder tree.

The project keeps its top-level folders (app/, engine/, backends/, themes/) and installs
them as `panechat.app`, `panechat.engine`, ...; every folder below them with an
__init__.py is a package, so a new subpackage needs no edit here. The CUDA source files
(.cu, .cuh) ship beside the modules that read them.
"""

from pathlib import Path

from setuptools import setup

ROOTS = {"app": "panechat.app", "engine": "panechat.engine",
         "backends": "panechat.backends", "themes": "panechat.themes"}


def packages() -> list[str]:
    here = Path(__file__).parent
    found = []
    for folder, name in ROOTS.items():
        for init in sorted((here / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(here / folder).parts
            found.append(".".join((name, *rel)))
    return found


DATA = {"": ["*.cu", "*.cuh"]}  # in every package: CUDA source read at run time

setup(packages=packages(), package_dir=dict((name, folder) for folder, name in ROOTS.items()), package_data=DATA)
