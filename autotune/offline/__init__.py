"""The offline tools: profile a model into a cost model, simulate and tune policies on traces, validate the simulator against the live server."""
