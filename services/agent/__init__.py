"""The node agent: keeps this node in the inventory, runs one runner process per assigned
rank, and ships every runner's flight recorder to NATS."""
