"""Lanes that fail on purpose, for the GPU fault campaign (scripts/fault_campaign.py); registered only
through LAB_KERNEL_PACKAGES=tests.fault_lanes."""
