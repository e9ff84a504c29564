"""Client side of each method: plain torch functions plus Flower message handlers."""
