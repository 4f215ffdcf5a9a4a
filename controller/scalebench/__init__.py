"""scalebench: Denali-style server consolidation framework."""
