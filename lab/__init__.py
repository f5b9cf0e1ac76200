"""GPU kernel lab: the same kernel in several DSLs, checked against one reference, tuned per device."""
__version__ = "0.1.0"
