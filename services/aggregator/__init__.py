"""The aggregator: folds runner telemetry, placements and tasks into the views operators
query, and diagnoses which rank an instance is waiting on."""
