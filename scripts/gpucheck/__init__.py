"""The pieces of scripts/gpu_check.py (issue #24): steps, checks, probes, load and report."""
