"""GPU kernel lab: the same kernel in several DSLs, checked against one reference, tuned per device."""
__version__ = "0.2.1"  # part of every study key: bump when measurement changes
