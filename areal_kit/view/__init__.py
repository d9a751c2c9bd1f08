"""`areal-kit view`: one local page of a run, from its trend down to a token, live.

cmd.py is the command, app.py the page's server and JSON, index.py the indexes that let a long
run open fast (samples.index, metrics.view.npz); static/ the page, with uPlot vendored (no network
at run time). docs/view.md says what it shows and what it costs.
"""
