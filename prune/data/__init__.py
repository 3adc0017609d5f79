"""Calibration data: how ``--data`` is spelled, the text it names, and the token windows a model reads."""
