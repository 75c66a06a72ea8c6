"""The CUDA source files beside this module (kernels.cu, mma.cu and the .cuh parts they
include), read as the one string NVRTC compiles.

Each ``#include "part.cuh"`` is replaced by the part's text the first time it is named
(what ``#pragma once`` does for nvcc), so NVRTC needs no include path, and the emulation,
the tests and the build cache all see the whole program as one text.
"""

from __future__ import annotations

import re
from importlib.resources import files

_INCLUDE = re.compile(r'#include "([\w.]+)"\s*$')


def read_cu(name: str) -> str:
    """The text of the CUDA file `name` of this package, with its local includes inlined
    (each part once, where it is first named) and its ``#pragma once`` lines dropped."""
    return _inline(name, set())


def _inline(name: str, seen: set[str]) -> str:
    seen.add(name)
    out = []
    for line in files(__package__).joinpath(name).read_text(encoding="utf-8").splitlines(keepends=True):
        included = _INCLUDE.match(line)
        if included:
            if included[1] not in seen:
                out.append(_inline(included[1], seen))
        elif line.strip() != "#pragma once":
            out.append(line)
    return "".join(out)
