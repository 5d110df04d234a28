"""The rank-table service: places Runner specs onto nodes and publishes each job's
rank table to every subscriber on every change."""
