"""The configs that ship with selftune, installed as the package `autotune.configs`.

Nothing to import: this file only makes the folder a package so that an installed selftune
finds its default config, policies, cost models and tune configs through importlib.resources
(autotune/shipped.py), from any directory.
"""
