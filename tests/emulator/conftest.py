"""Fixtures of the emulator's tests: see ``tests.emulator.support``."""
