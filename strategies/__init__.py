"""Server side of each method: a Flower strategy plus the server's own work."""
