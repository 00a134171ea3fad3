"""Engines drive rounds of {sample -> fit -> aggregate -> evaluate}; they know no method."""
