"""Agent tasks that ship with areal-kit: workflows whose episodes call tools (calculator.py)."""
