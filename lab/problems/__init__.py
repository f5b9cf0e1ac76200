"""Problems: what a kernel computes, independent of any DSL.

A problem module in this package defines a subclass of :class:`Problem` and assigns an instance to
``PROBLEM``; it is found by name (the module name), so adding a kernel adds a file here.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

from lab.devices import LabError


@dataclass(frozen=True)
class Tolerance:
    """Parity bands on relative errors: ||out - ref|| / ||ref|| and max|out - ref| / max|ref|."""
    rel_l2: float
    rel_max: float


class Problem:
    """Base class. Shapes are dicts of problem dimensions plus ``dtype`` (a torch dtype name)."""

    name: str = ""
    dims: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()      # dims that are true/false options rather than sizes

    def check_shape(self, shape: dict) -> None:
        missing = [d for d in self.dims if d not in shape]
        extra = [k for k in shape if k not in self.dims and k not in ("dtype",)]
        if missing or extra:
            raise LabError(f"{self.name} shape needs {', '.join(self.dims)} and dtype"
                           f"{'; missing ' + ', '.join(missing) if missing else ''}"
                           f"{'; unknown ' + ', '.join(extra) if extra else ''}")
        if shape.get("dtype") not in self.dtypes:
            raise LabError(f"{self.name} dtype {shape.get('dtype')!r} not in {', '.join(self.dtypes)}")
        bad = [d for d in self.dims if d not in self.flags
               and (isinstance(shape[d], bool) or not isinstance(shape[d], int) or shape[d] <= 0)]
        bad += [f for f in self.flags if not isinstance(shape[f], bool)]
        if bad:
            raise LabError(f"{self.name} shape dims must be positive integers"
                           f"{' (flags ' + ', '.join(self.flags) + ': true/false)' if self.flags else ''}: "
                           f"{', '.join(bad)}")

    def make_inputs(self, shape: dict, device: str, seed: int) -> dict:
        """Fresh random inputs (never zeros) drawn from ``seed``."""
        raise NotImplementedError

    def alloc_outputs(self, shape: dict, device: str) -> dict:
        """Output buffers filled with NaN so that an element the kernel never writes fails parity."""
        raise NotImplementedError

    def reference(self, inputs: dict, shape: dict) -> dict:
        """Outputs computed in higher precision (fp32 or fp64)."""
        raise NotImplementedError

    def tolerance(self, shape: dict) -> Tolerance:
        raise NotImplementedError

    def output_tolerances(self, shape: dict) -> dict[str, Tolerance]:
        """Bands of outputs that differ from :meth:`tolerance` (each with its reason in the problem)."""
        return {}

    def flops(self, shape: dict) -> float:
        """Floating-point operations of one call."""
        raise NotImplementedError

    def bytes_moved(self, shape: dict) -> float:
        """Fewest bytes one call must move through device memory (inputs read once, outputs written once)."""
        raise NotImplementedError

    def parity_shapes(self, shape: dict) -> list[dict]:
        """Extra small shapes (ragged ones included) checked with every trial besides the timed one."""
        return []


def names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def get(name: str) -> Problem:
    if name not in names():
        raise LabError(f"unknown kernel {name!r} (known: {', '.join(names())})")
    return importlib.import_module(f"{__name__}.{name}").PROBLEM
