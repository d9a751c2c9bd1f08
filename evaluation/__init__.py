"""Eval manifest and prompt templates, shipped as the package data `areal_kit.evaluation` (eval/data.py)."""
