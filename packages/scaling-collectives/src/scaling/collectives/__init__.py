"""scaling.collectives: communication for every parallel feature."""

__all__: list[str] = []
