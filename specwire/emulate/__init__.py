"""Emulated models: real decodes held to a bigger model's times, and the regimes' presets."""
