"""Actors of the bus: one actor (or one actor's facade) per module."""
