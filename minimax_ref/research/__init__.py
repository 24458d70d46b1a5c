"""Research: what a forward records and how it is edited (`trace`: `Trace`, `Interventions`), scoring traces and
drift (`score`), and memory plans (`plan`)."""
