"""What a worker imports: init, step boundaries, reports to the node agent."""
