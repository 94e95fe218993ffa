"""pytest's root. Loading this file puts the repository root on the import path (pytest's rootdir conftest), so
the tests reach the benchmark scripts as the package `benchmarks`, the way `python -m benchmarks.NAME` runs them
from here; everything else they import is the installed jax_megamoe or their own helpers in tests/."""
