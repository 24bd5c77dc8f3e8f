"""The rolling engine: batch arithmetic and gate verdicts (pure), the step engine, the journal."""
